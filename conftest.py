"""Root pytest configuration: markers that skip with a reason where the machine lacks a part, and the order in
which test files are handed to pytest-xdist's workers (heaviest first)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

#: seconds each test file took in a full run (``file: seconds``). Refresh it with a full run that records them:
#: ``CONDUIT_RECORD_DURATIONS=.test-durations.json .venv/bin/python -m pytest -n 2 --dist loadfile``
DURATIONS = Path(__file__).with_name(".test-durations.json")
#: where a run writes each file's seconds (setup, call and teardown of its tests), when set
RECORD = "CONDUIT_RECORD_DURATIONS"
#: read once and taken out of the environment: a pytest subprocess that a test starts would otherwise record too and
#: write its one file over the durations file mid-run (the controller of an xdist run gets every worker's reports)
_record_to = os.environ.pop(RECORD, None)
_recorded: dict[str, float] = {}

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def pytest_configure(config: pytest.Config) -> None:
    # ``--dist loadfile`` hands files out in collection order only without its own reordering (by number of
    # tests, which put the few-test, minute-long files last: one worker ran them alone at the end)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _heaviest_files_first(items)
    import torch

    has_gpu = torch.cuda.is_available()
    for item in items:
        if item.get_closest_marker("gpu") and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; the CPU path is tested separately"))


#: fixtures that connect a test module to a local Ray cluster kept running between modules
#: (``conduit.distributed.testing.kept_cluster``); each conftest that defines one keeps a cluster of its own shape
CLUSTER_FIXTURES = ("ray_local", "cluster")


def _cluster_of(item: pytest.Item) -> str:
    """The kept cluster ``item`` connects to: where its cluster fixture is defined and that fixture's name ("" for
    none)."""
    info = getattr(item, "_fixtureinfo", None)
    for name in CLUSTER_FIXTURES:
        if name in getattr(item, "fixturenames", ()):
            defs = info.name2fixturedefs.get(name) if info is not None else None
            return f"{defs[-1].baseid}::{name}" if defs else name
    return ""


def _heaviest_files_first(items: list[pytest.Item]) -> None:
    """Order whole files by their time in :data:`DURATIONS`, longest first (a file not listed, e.g. a new one, goes
    first, and its group with it); tests keep their order within a file. Two workers taking files in this order
    finish close together.

    Files whose tests connect to the same kept Ray cluster (:data:`CLUSTER_FIXTURES`) run one after another, the
    group with the most seconds first and the files that need no cluster last: a worker process keeps one cluster
    and starts another when a file needs another shape (seconds of CPU each time), so interleaving the groups
    would start clusters over and over."""
    try:
        seconds = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return
    first_seen: dict[str, int] = {}
    cluster: dict[str, str] = {}
    for i, item in enumerate(items):
        f = item.nodeid.split("::", 1)[0]
        first_seen.setdefault(f, i)
        cluster[f] = cluster.get(f) or _cluster_of(item)
    group_seconds: dict[str, float] = {}
    for f, c in cluster.items():
        group_seconds[c] = group_seconds.get(c, 0.0) + float(seconds.get(f, float("inf")))

    def key(item: pytest.Item) -> tuple[bool, float, str, float, int]:
        f = item.nodeid.split("::", 1)[0]
        c = cluster[f]
        return not c, -group_seconds[c], c, -float(seconds.get(f, float("inf"))), first_seen[f]

    items.sort(key=key)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _record_to:
        f = report.nodeid.split("::", 1)[0]
        _recorded[f] = _recorded.get(f, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _record_to and _recorded and not hasattr(session.config, "workerinput"):  # (the controller has every report)
        rows = ",\n".join(f"  {json.dumps(f)}: {round(s, 1)}" for f, s in sorted(_recorded.items()))
        Path(_record_to).write_text("{\n" + rows + "\n}\n")
