"""The root README's and the benchmarks README's claims about behaviour, checked as a new user reads them.

``test_docs.py`` runs the README's Python block, ``test_docs_snippets.py`` parses every concrete ``conduit``
command line of the docs, ``integration-tests/test_repository.py`` checks the two opening commands, and the
refusal and checkpoint suites cover bad input and ``state_dict``. Here: what the README's example says it
delivers, the delivered-batch lifetime under each scheduler it names, the names of "How it is organised",
the command table's synopses, the test and static-check instructions, and the paths and files both READMEs name.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
README = (ROOT / "README.md").read_text()
BENCH_README = (ROOT / "benchmarks/README.md").read_text()


def _section(text: str, title: str) -> str:
    """The body of the ``## title`` section."""
    body = text.split(f"\n## {title}\n", 1)
    assert len(body) == 2, f"the README has no '## {title}' section"
    return body[1].split("\n## ", 1)[0]


# -- "Using the core": what the example's comments promise ---------------------------------------------------------

def test_the_core_example_delivers_what_its_comments_say() -> None:
    """``batch["obs"]: [32, 84]; info.weights, info.handles``; the on-policy loop is 4 minibatches x 3 epochs, each
    item once per epoch, and the rollout is used up after it (a further delivery is a typed error)."""
    from conduit import EmptyBufferError

    code = re.findall(r"```python\n(.*?)```", README, re.S)[0]
    replay_line = 'batch, info = replay.deliver(32, beta=0.4)'
    loop_line = "    mb, info = ppo.deliver()"
    assert replay_line in code and loop_line in code, "the README's example changed; update this test with it"
    code = code.replace(replay_line, replay_line + "; replay_info = info", 1)
    code = code.replace(loop_line, loop_line + "; minibatches.append(mb['obs'].clone())", 1)
    ns: dict[str, Any] = {"minibatches": []}
    exec(compile(code, "README.md", "exec"), ns)
    replay, ppo = ns["replay"], ns["ppo"]
    try:
        batch, info = ns["batch"], ns["replay_info"]
        assert tuple(batch["obs"].shape) == (32, 84)
        assert info.weights is not None and tuple(info.weights.shape) == (32,)
        assert len(info.handles) == 32
        mbs: list[torch.Tensor] = ns["minibatches"]
        assert [tuple(m.shape) for m in mbs] == [(64, 84)] * 12, "4 minibatches of the 256-item rollout, 3 epochs"
        # (the items are told apart by their random rows)
        for epoch in range(3):
            rows = torch.cat(mbs[4 * epoch: 4 * epoch + 4])
            assert torch.unique(rows, dim=0).shape[0] == 256, f"epoch {epoch} repeated or skipped an item"
            assert torch.equal(torch.unique(rows, dim=0), torch.unique(torch.cat(mbs[:4]), dim=0)), \
                f"epoch {epoch} delivered other items than epoch 0"
        with pytest.raises(EmptyBufferError, match="ingest a rollout and seal it"):
            ppo.deliver()
    finally:
        replay.close()
        ppo.close()


# -- "a batch stays valid until the second delivery after it", under each scheduler the README names -----------

@pytest.mark.parametrize("scheduler", ["Synchronous", "Overlapped", "Automatic"])
@pytest.mark.parametrize("row_floats", [84, 4096], ids=["small-batch", "1MiB-batch"])
def test_a_delivered_batch_stays_valid_until_the_second_delivery_after_it(scheduler: str, row_floats: int) -> None:
    """The next delivery never overwrites a batch the caller holds (small batches rotate over two buffers,
    batches of 1 MiB and more reuse an unreferenced one); ``batch.clone()`` keeps one longer."""
    import conduit

    sched = {"Synchronous": conduit.Synchronous, "Overlapped": lambda: conduit.Overlapped(g_del=3),
             "Automatic": conduit.Automatic}[scheduler]()
    schema = conduit.ExperienceSchema(obs=conduit.Field((row_floats,), torch.float32))
    edp = conduit.ExperienceDataPlane(schema, capacity=256, semantics=conduit.Replay(seed=1), scheduler=sched)
    try:
        edp.ingest({"obs": torch.randn(256, row_floats)})
        kept: torch.Tensor | None = None
        for k in range(8):
            batch, _ = edp.deliver(64)
            obs = batch["obs"]
            assert isinstance(obs, torch.Tensor)
            snapshot = obs.clone()
            if k == 0:
                kept_obs = batch.clone()["obs"]
                assert isinstance(kept_obs, torch.Tensor)
                kept = kept_obs
            edp.deliver(64)
            assert torch.equal(obs, snapshot), f"delivery {k} was overwritten by the next delivery"
        assert kept is not None
        later = edp.deliver(64)[0]["obs"]
        assert isinstance(later, torch.Tensor)
        assert kept.data_ptr() != later.data_ptr(), "a clone shares the reused delivery buffer"
    finally:
        edp.close()


# -- "How it is organised": the names exist, where the README says, in the roles it gives them -------------------

ROLES = {
    "Semantics": ["Replay", "OnPolicy"],
    "Sampler": ["UniformSampler", "PrioritizedSampler"],
    "Placement": ["HostPlacement", "DevicePlacement", "ShardedPlacement", "DiskPlacement", "AdaptivePlacement"],
    "Scheduler": ["Synchronous", "Overlapped", "Automatic"],
}


def test_the_roles_and_classes_of_how_it_is_organised_are_conduits() -> None:
    import conduit

    section = _section(README, "How it is organised")
    for role, classes in ROLES.items():
        for name in classes:
            assert re.search(rf"\b{name}\b", section), f"the README no longer names {name}; update ROLES"
            assert name in conduit.__all__, f"the README names conduit's {name}, which conduit does not export"
            assert issubclass(getattr(conduit, name), getattr(conduit, role)), f"{name} is not a {role}"
    for name in ("ExperienceDataPlane", "Telemetry", "ExposureLog"):
        assert name in conduit.__all__
    edp = conduit.ExperienceDataPlane(conduit.ExperienceSchema(x=conduit.Field((2,))), capacity=4)
    try:  # "the object an adapter holds. Its roles: ..."
        assert isinstance(edp.semantics, conduit.Semantics) and isinstance(edp.placement, conduit.Placement)
        assert isinstance(edp.scheduler, conduit.Scheduler) and isinstance(edp.telemetry, conduit.Telemetry)
        assert callable(edp.migrate) and callable(edp.telemetry.chrome_trace)  # online migration, Chrome traces
    finally:
        edp.close()


def test_the_subpackages_hold_what_how_it_is_organised_says() -> None:
    from conduit.placement import (
        BandwidthProfile,
        CostModel,
        PlacementMap,
        Planner,
        available_topologies,
        discover_topology,
        load_topology,
    )
    from conduit.simulation import ClusterCostModel, ClusterPlanner
    from conduit.testing import (
        ConcurrencySuite,
        CoreOnPolicyEndpoint,
        CoreReplayEndpoint,
        FreshnessSuite,
        OnPolicyEndpoint,
        ReplayEndpoint,
        ReplaySuite,
    )
    from conduit.testing.suites.base import SuiteBase
    from conduit.testing.suites.prefetch import PrefetchFreshnessChecks, PrefetchReplayChecks

    section = _section(README, "How it is organised")
    declared = re.search(r"declared JSON for ((?:`[\w-]+`,? ?(?:or )?)+)", section)
    assert declared is not None, "the README no longer lists the declared topologies"
    names = re.findall(r"`([\w-]+)`", declared.group(1))
    assert names and set(names) | {"local"} == set(available_topologies()), (names, available_topologies())
    for name in names:
        assert load_topology(name).name == name
    assert callable(discover_topology) and callable(BandwidthProfile.from_dict) and callable(PlacementMap.lookup)
    # "the scale simulator driving the same planner and cost model"
    assert issubclass(ClusterPlanner, Planner) and issubclass(ClusterCostModel, CostModel)
    # "the conformance suites (ReplaySuite, FreshnessSuite, ConcurrencySuite, prefetch checks)"
    assert issubclass(ReplaySuite, PrefetchReplayChecks) and issubclass(FreshnessSuite, PrefetchFreshnessChecks)
    assert issubclass(ConcurrencySuite, SuiteBase)
    # "plus the reference endpoints they are proven on"
    assert issubclass(CoreReplayEndpoint, ReplayEndpoint) and issubclass(CoreOnPolicyEndpoint, OnPolicyEndpoint)


def test_the_distributed_tier_has_what_the_readme_lists() -> None:
    """Shards in Ray actors, shard-fault detection, loss reports and replication (importing starts no Ray)."""
    import dataclasses
    import inspect

    from conduit import ConduitError
    from conduit.distributed import DistributedDataPlane, LossReport, ShardLostError

    assert "replication" in inspect.signature(DistributedDataPlane).parameters
    assert "on_loss" in inspect.signature(DistributedDataPlane).parameters
    assert issubclass(ShardLostError, ConduitError)
    fields = {f.name for f in dataclasses.fields(LossReport)}  # a loss report: what was lost, what was recovered
    assert {"shard", "lost", "recovered"} <= fields, fields


def test_the_packages_table_names_installed_packages_under_their_import_names() -> None:
    rows = re.findall(r"^\| `packages/([\w-]+)` \| `(\w+)` \|", _section(README, "Packages"), re.M)
    assert len(rows) == 4, rows
    for directory, module in rows:
        assert (ROOT / "packages" / directory / "src" / module / "__init__.py").is_file(), (directory, module)
        assert importlib.util.find_spec(module) is not None, f"{module} is not installed in this environment"
        assert (ROOT / "packages" / directory / "README.md").is_file()


# -- "The command line": the table's synopses are what the parser takes --------------------------------------------

def test_the_command_tables_flags_are_the_clis() -> None:
    import argparse

    from conduit.cli import build_parser
    from conduit.placement import available_topologies

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    cells = re.findall(r"^\| `conduit (\w+)([^`]*)` \|", _section(README, "The command line"), re.M)
    assert [c for c, _ in cells] == ["demo", "profile", "plan", "schedule", "simulate"], cells
    assert set(sub.choices) == {c for c, _ in cells}
    for command, synopsis in cells:
        known = {s for a in sub.choices[command]._actions for s in a.option_strings}
        for flag in re.findall(r"--[a-z][a-z-]*", synopsis):
            assert flag in known, f"`conduit {command}{synopsis}`: the CLI has no {flag}"
    assert "local" in available_topologies()  # --topology NAME|local


# -- "Tests": the instructions match the configuration ----------------------------------------------------------

def test_plain_pytest_runs_every_packages_tests_and_the_integration_tests() -> None:
    import tomllib  # (the tests run on the project's Python 3.11; the packages themselves need 3.10)

    paths = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["testpaths"]
    want = {str(p.relative_to(ROOT)) for p in sorted((ROOT / "packages").glob("*/tests"))} | {"integration-tests"}
    assert set(paths) == want, f"testpaths {paths} != every package's tests plus integration-tests {sorted(want)}"
    assert re.search(r"^pytest-xdist==", (ROOT / "requirements/dev.txt").read_text(), re.M), "-n 2 needs xdist"
    assert (ROOT / "packages/conduit-core/tests/test_distributed.py").is_file()  # the README's example of one file


def test_a_gpu_test_is_skipped_with_a_reason_without_cuda() -> None:
    """"Tests that need a GPU are marked gpu and skipped with a reason on CPU" (and run where there is one)."""
    target = "packages/conduit-core/tests/test_disk_and_sharded_storage_edges.py"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider", "-q", "-rs",
                           "-m", "gpu", target], cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    if torch.cuda.is_available():
        assert proc.returncode == 0 and "needs a CUDA GPU" not in out, out
    else:
        assert proc.returncode == 0 and "1 skipped" in out, out
        assert "needs a CUDA GPU" in out, out


@pytest.mark.parametrize(("script", "packages", "installs"), [
    ("gpu_checks.sh", ("conduit-core", "conduit-srl"),
     "CONDUIT_NO_NATIVE=1 .venv/bin/python -m pip wheel --no-deps -w .whl packages/conduit-core packages/conduit-srl"),
    ("gpu_rllib_bundle.sh", ("conduit-core", "conduit-srl", "conduit-rllib", "conduit-verl"),
     "$PWD/packages/conduit-core/src:$PWD/packages/conduit-rllib/src:$PWD/packages/conduit-srl/src"),
])
def test_the_gpu_scripts_run_every_gpu_marked_test_file_of_their_packages(script: str, packages: tuple[str, ...],
                                                                       installs: str) -> None:
    """The README: ``gpu_checks.sh`` runs the GPU tests of core and the SRL adapter (what it installs),
    ``gpu_rllib_bundle.sh`` those of core, the SRL adapter and the RLlib adapter (and the verl adapter's, when its
    bundle is carried). A step may name its files after ``-m gpu`` or pass ``"${tests[@]}"``, the words of the
    script's ``tests=(...)`` and ``tests+=(...)``. Both compile core's C kernels with the GPU machine's Python
    (``kernels``, from ``gpu_step.sh``), whose version differs from this venv's: the wheels made here are pure."""
    text = (ROOT / "benchmarks/scripts" / script).read_text()
    assert re.search(r"^\s*kernels\b", text, re.M), f"{script} does not compile the kernels where it runs"
    step = re.search(r"^\s*step gpu_tests .*?-m gpu (.*?)\n", text, re.M)
    assert step is not None, f"{script} has no gpu_tests step running -m gpu"
    if step.group(1).strip() == '"${tests[@]}"':
        covered = [w for m in re.finditer(r"\btests\+?=\((.*?)\)", text, re.S) for w in m.group(1).split()]
    else:
        tail = re.search(r"-m gpu \\\n(.*?)\n", text[step.start():], re.S)
        assert tail is not None, f"{script}: the gpu_tests step names no test files"
        covered = tail.group(1).split()
    assert installs in text, f"{script} does not put {packages} on the GPU machine"
    for package in packages:
        if "$PWD/packages/" in text:  # (run from the working tree, not installed)
            assert f"$PWD/packages/{package}/src" in text, f"{script} does not put {package} on PYTHONPATH"
        for path in sorted((ROOT / "packages" / package / "tests").glob("test_*.py")):
            if "pytest.mark.gpu" not in path.read_text():
                continue
            rel = str(path.relative_to(ROOT))
            assert any(rel == c or rel.startswith(c.rstrip("/") + "/") for c in covered), \
                f"{rel} has GPU tests that {script} does not run"


def test_ci_runs_the_readmes_static_checks_beside_the_tests() -> None:
    """The README's ruff and mypy commands run in CI, started before the README's test command and waited for (their
    status checked) after it, as the README says ("beside the tests")."""
    ci = (ROOT / ".ci/run").read_text()
    section = " ".join(_section(README, "Tests").split())
    assert "CI runs them beside the tests" in section
    ruff = re.search(r"`(\.venv/bin/ruff check [^`]+)`", section)
    assert ruff is not None and ruff.group(1) in ci, "CI does not run the README's ruff command"
    tests = ci.index("-m pytest -n 2")
    assert ci.index(ruff.group(1)) < tests, "CI starts the static checks after the tests, not beside them"
    assert ci.index('wait "$static"') > tests and '[ "$status" -eq 0 ]' in ci[tests:], \
        "CI does not check the static checks' exit status after the tests"
    mypy_line = next(ln for ln in ci.splitlines() if "-m mypy" in ln)
    readme_mypy = re.search(r"`\.venv/bin/python -m mypy ([^`]+)`", section)
    assert readme_mypy is not None, "the README names no mypy command"
    named = sorted(str(p.relative_to(ROOT)) for arg in readme_mypy.group(1).split() for p in ROOT.glob(arg))
    assert "benchmarks" in named and len(named) == len(list(ROOT.glob("packages/*/src"))) + 1
    assert sorted(mypy_line.split()[3:]) == named, f"CI's mypy does not check what the README's command names: {named}"
    for src in ROOT.glob("packages/*/src"):
        (module,) = [p for p in src.iterdir() if p.is_dir() and (p / "__init__.py").is_file()]
        assert (module / "py.typed").is_file(), f"{module.relative_to(ROOT)} ships no py.typed"


def test_the_setup_the_readme_states() -> None:
    """torch 2.13.0 (CPU) installed first, then every package editable; Python 3.10+: every package says so, and
    every source file is valid Python 3.10 syntax."""
    bootstrap = (ROOT / "scripts/bootstrap.sh").read_text()
    assert bootstrap.index("requirements/torch-cpu.txt") < bootstrap.index("requirements/dev.txt")
    assert re.search(r"^torch==2\.13\.0$", (ROOT / "requirements/torch-cpu.txt").read_text(), re.M)
    dev = (ROOT / "requirements/dev.txt").read_text()
    for package in sorted((ROOT / "packages").glob("*/pyproject.toml")):
        assert f"-e packages/{package.parent.name}" in dev, f"bootstrap does not install {package.parent.name}"
        assert 'requires-python = ">=3.10"' in package.read_text(), package
        for path in (package.parent / "src").rglob("*.py"):
            ast.parse(path.read_text(), str(path), feature_version=(3, 10))


# -- paths both READMEs name, and the benchmarks README's table of areas --------------------------------------------

def test_every_repository_path_the_readmes_name_exists() -> None:
    named = set(re.findall(r"\]\(((?!https?:|#)[^)#]+)", README))
    named |= set(re.findall(r"`((?:benchmarks|packages|scripts|integration-tests)/[\w./-]+)`", README))
    for path in sorted(named):
        assert (ROOT / path).exists(), f"README.md names {path}, which does not exist"
    bench = set(re.findall(r"\]\(((?!https?:|#)[^)#]+)", BENCH_README))
    bench |= set(re.findall(r"`((?:results|scripts)/[\w./-]+|benchmarks/[\w./-]+|test_bench_\w+\.py)`", BENCH_README))
    for path in sorted(bench):
        where = ROOT / path if path.startswith("benchmarks/") else ROOT / "benchmarks" / path
        assert where.exists(), f"benchmarks/README.md names {path}, which does not exist"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_benchmarks_area_table_links_resolve() -> None:
    rows = re.findall(r"^\| [^|]+ \| ([^|]*) \| (.+) \|$", BENCH_README.split("## Host tier", 1)[0], re.M)
    links = [link for _, cell in rows for link in re.findall(r"\(([^)]+)\)", cell)]
    assert len(links) >= 10, links
    for link in links:
        doc, _, anchor = link.partition("#")
        path = ROOT / "benchmarks" / doc if doc else ROOT / "benchmarks/README.md"
        assert path.is_file(), link
        if anchor:
            anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}
            assert anchor in anchors, f"{link}: no such heading in {path.relative_to(ROOT)}"


def test_the_prioritized_table_names_the_path_each_column_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """"one C call per draw and per update" is what a prioritized buffer does where the kernels are built (CI builds
    them): its sampler's tree is a CompiledSumTree, and the benchmark's step (deliver, then update_priorities with
    the handles as NumPy and float64 priorities) calls its one-call draw and update once each."""
    import numpy as np
    from conduit import ExperienceDataPlane, ExperienceSchema, Field, PrioritizedSampler, Replay
    from conduit.semantics.sumtree import COMPILED, CompiledSumTree, SumTree

    section = BENCH_README.split("## Prioritized replay step", 1)[1]
    assert ("| capacity | cpprb | Conduit (one C call per draw and per update) | Conduit (compiled tree, NumPy around "
            "it: the code before) |") in section
    calls: list[str] = []
    for name in ("draw", "set_by_handle"):
        kernel = getattr(CompiledSumTree, name)
        monkeypatch.setattr(CompiledSumTree, name,
                            lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))  # type: ignore[func-returns-value]
    for capacity in (5000, 50000):
        edp = ExperienceDataPlane(ExperienceSchema(obs=Field((4,))), capacity=capacity,
                                  semantics=Replay(PrioritizedSampler(alpha=0.6)))
        try:
            assert type(edp.semantics.sampler._tree) is (CompiledSumTree if COMPILED else SumTree)  # type: ignore[attr-defined]
            edp.ingest({"obs": torch.zeros(capacity, 4)})
            calls.clear()
            _, info = edp.deliver(32)
            assert edp.update_priorities(info.handles.numpy(), np.random.default_rng(1).random(32) + 0.01) == 32
            assert calls == (["draw", "set_by_handle"] if COMPILED else []), calls
        finally:
            edp.close()


def test_ci_runs_every_benchmark_once_without_statistics() -> None:
    assert "--benchmark-disable" in BENCH_README
    assert re.search(r"^\.venv/bin/python -m pytest benchmarks --benchmark-disable", (ROOT / ".ci/run").read_text(),
                     re.M)
