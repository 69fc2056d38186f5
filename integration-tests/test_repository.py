"""The repository keeps its promises: README commands, CI, and core's independence from frameworks."""

from __future__ import annotations

import ast
import re
from pathlib import Path

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
