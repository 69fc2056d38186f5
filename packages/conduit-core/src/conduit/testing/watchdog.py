"""A pytest plugin: a test that outlives its time limit by a grace period ends its process, its stacks kept.

pytest-timeout fails a test that runs past its limit (its ``timeout`` marker or ini value) from a Python signal
handler, which never runs in a process frozen with the GIL held (CPython 3.11's ``sys._current_frames`` froze one:
python/cpython#106883); such a test would hang the whole run. This plugin arms :mod:`faulthandler`'s C-level timer
for each test at its limit plus ``CONDUIT_WATCHDOG_GRACE_S`` (300 s unless set): when it fires it writes every
thread's stack and ends the process. Under pytest-xdist the stacks go to a file per worker and the controller adds
them to the crashed test's report (xdist then goes on with a new worker); in a single process they go to the
stderr pytest started with. Without a limit (no pytest-timeout, or a limit of 0) nothing is armed.

Load it with ``-p conduit.testing.watchdog`` (the repository's pytest ``addopts`` do), so that it is imported before
pytest captures output.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import tempfile
from collections.abc import Generator
from pathlib import Path
from typing import IO, Any

import pytest

__all__ = ["GRACE_ENV", "DIR_ENV", "time_limit"]

#: seconds past a test's own limit before the watchdog ends its process
GRACE_ENV = "CONDUIT_WATCHDOG_GRACE_S"
#: the folder where each xdist worker's stacks go (``<worker>.txt``); the controller sets it for its workers
DIR_ENV = "CONDUIT_WATCHDOG_DIR"

#: stderr as it was when pytest loaded this plugin (with ``-p``: before output capture replaced it)
_STDERR_FD = os.dup(2)
_out: IO[str] | None = None
_made_dir: str | None = None


def time_limit(item: pytest.Item) -> float:
    """``item``'s pytest-timeout limit in seconds (its marker's, else the ini ``timeout``); 0 for none."""
    mark = item.get_closest_marker("timeout")
    if mark is not None:
        value = mark.args[0] if mark.args else mark.kwargs.get("timeout")
        return float(value) if value is not None else 0.0
    try:
        return float(item.config.getini("timeout") or 0)
    except ValueError:  # (no such ini key: pytest-timeout is not loaded)
        return 0.0


def _grace_s() -> float:
    return float(os.environ.get(GRACE_ENV, 300))


def _stacks_file(worker: str) -> Path:
    return Path(os.environ[DIR_ENV]) / f"{worker}.txt"


def pytest_configure(config: pytest.Config) -> None:
    global _out, _made_dir
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:  # a single process, or xdist's controller (which starts its workers later: they inherit it)
        _made_dir = os.environ[DIR_ENV] = tempfile.mkdtemp(prefix="conduit-watchdog-")
        _out = os.fdopen(_STDERR_FD, "w", closefd=False)
    else:
        _out = open(_stacks_file(worker), "w")  # noqa: SIM115 - held for the session: written only when it fires


def pytest_unconfigure(config: pytest.Config) -> None:
    global _out, _made_dir
    if _out is not None:
        _out.close()
        _out = None
    if _made_dir is not None:
        shutil.rmtree(_made_dir, ignore_errors=True)
        os.environ.pop(DIR_ENV, None)
        _made_dir = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    limit, out, armed = time_limit(item), _out, False
    if limit > 0 and out is not None:
        faulthandler.dump_traceback_later(limit + _grace_s(), exit=True, file=out)
        armed = True
    try:
        yield
    finally:
        if armed:
            faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched: Any) -> None:
    """pytest-xdist's controller, for a worker that ended while running ``crashitem``: add the stacks it wrote."""
    gateway = getattr(getattr(report, "node", None), "gateway", None)
    if DIR_ENV not in os.environ or gateway is None:
        return
    path = _stacks_file(str(gateway.id))
    if path.is_file() and path.stat().st_size:
        report.longrepr = (f"{report.longrepr}\nThe watchdog ended the worker {_grace_s():g} s "
                           f"past the test's time limit (frozen: pytest-timeout could not fail it). Every thread's "
                           f"stack:\n{path.read_text()}")
