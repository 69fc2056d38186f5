"""The repository keeps its promises: README commands, CI, and core's independence from frameworks."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def test_readme_opens_with_the_two_commands_and_ci_runs_the_test_one() -> None:
    """The README starts with exactly two commands; .ci/run runs the second verbatim."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block is not None and text.index("```bash") < 40, "README must open with a bash block"
    cmds = [c for c in block.group(1).splitlines() if c.strip()]
    assert len(cmds) == 2, cmds
    assert "conduit demo" in cmds[0]
    assert "pytest" in cmds[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert cmds[1] in ci, f".ci/run does not run the README's test command {cmds[1]!r}"


def test_core_imports_no_framework() -> None:
    """conduit-core never imports an RL framework or an adapter; Ray only in ``conduit.distributed``."""
    banned = {"verl", "transfer_queue", "srl", "realhf", "rlsrl", "conduit_rllib", "conduit_verl", "conduit_srl"}
    core = ROOT / "packages/conduit-core/src/conduit"
    for path in core.rglob("*.py"):
        ray_ok = (core / "distributed") in path.parents
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in banned, f"{path.relative_to(ROOT)} imports {name}"
                assert not name.startswith("ray.rllib"), f"{path.relative_to(ROOT)} imports {name}"
                assert ray_ok or name.split(".")[0] != "ray", f"{path.relative_to(ROOT)} imports {name}"


def _root_conftest() -> Any:
    spec = importlib.util.spec_from_file_location("_root_conftest_under_test", ROOT / "conftest.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_test_files_go_to_the_workers_heaviest_first_each_file_whole() -> None:
    """``--dist loadfile`` hands out files in collection order (xdist's own reordering, by number of tests, is off):
    the root conftest puts the files the durations file lists as longest first, a file it does not list before
    them, and keeps each file's tests together and in order."""
    conftest = _root_conftest()
    seconds = json.loads(conftest.DURATIONS.read_text())
    assert seconds and all(isinstance(v, (int, float)) and v >= 0 for v in seconds.values())
    light, heavy = sorted(seconds, key=seconds.get)[0], sorted(seconds, key=seconds.get)[-1]
    items = [SimpleNamespace(nodeid=f"{light}::a"), SimpleNamespace(nodeid=f"{heavy}::b"),
             SimpleNamespace(nodeid="integration-tests/test_not_listed.py::c"),
             SimpleNamespace(nodeid=f"{light}::d"), SimpleNamespace(nodeid=f"{heavy}::e")]
    conftest._heaviest_files_first(items)
    assert [i.nodeid.rsplit("::", 1)[1] for i in items] == ["c", "b", "e", "a", "d"]


def test_a_run_records_each_files_seconds_for_the_durations_file(tmp_path: Path) -> None:
    """A recording run writes each file's seconds, and the tests it runs do not see the variable (a pytest subprocess
    a test starts would record too and write its one file over the durations file mid-run)."""
    out = tmp_path / "durations.json"
    target = "integration-tests/test_repository.py"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"{target}::test_tests_do_not_inherit_the_recording_variable"], cwd=ROOT,
                          env={**os.environ, "CONDUIT_RECORD_DURATIONS": str(out)}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recorded = json.loads(out.read_text())
    assert list(recorded) == [target] and recorded[target] >= 0


def test_tests_do_not_inherit_the_recording_variable() -> None:
    """(Checked for real when :func:`test_a_run_records_each_files_seconds_for_the_durations_file` runs it in a
    recording run.)"""
    assert "CONDUIT_RECORD_DURATIONS" not in os.environ
