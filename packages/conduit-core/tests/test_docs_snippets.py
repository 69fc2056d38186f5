"""What a user copies from the docs works as written: core's package README, the scheduling
doc's example, every concrete ``conduit ...`` command line in the docs, the benchmark scripts' command
lines, and the placement map's boundaries quoted in ``benchmarks/docs/placement.md``.

(``test_docs.py`` covers the top-level README's Python blocks and the docstring examples.)
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest
import torch
from conduit import ExperienceSchema, Field
from conduit.cli import build_parser

ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "README.md", *sorted((ROOT / "packages").glob("*/README.md")), ROOT / "benchmarks/README.md",
        *sorted((ROOT / "benchmarks/docs").glob("*.md"))]


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def test_core_package_readme_example_runs() -> None:
    blocks = _python_blocks(ROOT / "packages/conduit-core/README.md")
    assert blocks, "packages/conduit-core/README.md has no Python example"
    for code in blocks:
        ns: dict[str, object] = {}
        exec(compile(code, "packages/conduit-core/README.md", "exec"), ns)
        batch, info = ns["batch"], ns["info"]
        assert batch["obs"].shape == (16, 4), batch["obs"].shape  # type: ignore[index]
        assert info.weights.shape == (16,)  # type: ignore[attr-defined]


def test_scheduling_doc_example_runs_with_a_schema_and_a_rollout() -> None:
    blocks = _python_blocks(ROOT / "benchmarks/docs/scheduling.md")
    assert blocks, "benchmarks/docs/scheduling.md has no Python example"
    ns: dict[str, object] = {"schema": ExperienceSchema(obs=Field((8,), torch.float32)),
                             "rollout": {"obs": torch.randn(64, 8)}}
    try:
        exec(compile(blocks[0], "benchmarks/docs/scheduling.md", "exec"), ns)
        assert ns["batch"]["obs"].shape == (512, 8)  # type: ignore[index]
    finally:
        edp = ns.get("edp")
        if edp is not None:
            edp.close()  # type: ignore[attr-defined]


def _doc_commands() -> list[tuple[str, list[str]]]:
    """Every concrete ``conduit <sub> ...`` command line in the docs (not the placeholders of a table)."""
    out = []
    for path in DOCS:
        text = path.read_text()
        lines = [m.group(1) for m in re.finditer(r"`([^`\n]*conduit (?:plan|profile|schedule|simulate)[^`\n]*)`",
                                                    text)]
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            lines += [ln for ln in block.splitlines()
                      if re.search(r"(^|/)conduit (plan|profile|schedule|simulate)", ln)]
        for line in lines:
            if any(p in line for p in ("...", "|", "NAME", " D ", " C ", " B ", "[--")):
                continue  # a synopsis, not a command
            argv = shlex.split(line.split("#", 1)[0])
            argv = argv[next(i for i, a in enumerate(argv) if a.endswith("conduit")) + 1:]
            if argv[0] == "plan" and "--topology" not in argv:
                continue  # prose naming a flag (`conduit plan --json`), not a command to run
            out.append((f"{path.relative_to(ROOT)}: conduit {' '.join(argv)}", argv))
    return out


COMMANDS = _doc_commands()


def test_the_docs_quote_cli_commands() -> None:
    assert len(COMMANDS) >= 5, COMMANDS


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_documented_cli_command_parses(where: str, argv: list[str]) -> None:
    parser = build_parser()
    try:
        args, rest = parser.parse_known_args(argv)
    except SystemExit as e:  # argparse refused a flag or a value
        pytest.fail(f"{where}: `conduit {' '.join(argv)}` is refused by the CLI (exit {e.code})")
    assert not rest, f"{where}: the CLI does not know {rest}"
    assert callable(args.func)


def test_placement_doc_quotes_the_placement_map_boundaries() -> None:
    """``planner.placement_map`` on dgx-a100-80g, capacity 1e6, batch 512: the byte boundaries
    and the largest d per placement that placement.md quotes are what the planner computes."""
    from conduit.placement import Planner, Workload, load_topology

    text = " ".join((ROOT / "benchmarks/docs/placement.md").read_text().split())
    m = re.search(r"gpu\[cuda:0\] below ([\d,]+) B per transition \(d <= (\d+)\), sharded x2 below ([\d,]+) B "
                  r"\(d <= (\d+)\)", text)
    assert m is not None, "placement.md no longer quotes the placement map's boundaries"
    gpu_below, gpu_d, x2_below, x2_d = (int(g.replace(",", "")) for g in m.groups())
    pmap = Planner(load_topology("dgx-a100-80g")).placement_map(
        Workload.transitions(1000, capacity=1_000_000, batch=512), min_item_bytes=1000, max_item_bytes=200_000)
    assert [round(b) for b in pmap.boundaries] == [gpu_below, x2_below], (pmap.boundaries, gpu_below, x2_below)
    item = lambda d: Workload.transitions(d, capacity=1_000_000, batch=512).item_bytes  # noqa: E731
    assert str(pmap.lookup(item(gpu_d))) == "gpu[cuda:0]" and str(pmap.lookup(item(gpu_d + 1))) != "gpu[cuda:0]"
    assert str(pmap.lookup(item(x2_d))) == "sharded[cuda:0,cuda:1]"
    assert str(pmap.lookup(item(x2_d + 1))) != "sharded[cuda:0,cuda:1]"


# -- the benchmark scripts' and the synthetic demo's command lines the docs quote ------------------------------------

#: run in a fresh interpreter (the scripts set environment variables and ``sys.path`` when loaded): each command's
#: ``parse_args`` runs for real (a refused flag or value exits 2 with argparse's message), and nothing after it does
_PARSE_ONLY = r"""
import argparse, json, runpy, sys

class Parsed(BaseException):
    pass

real = argparse.ArgumentParser.parse_args
def parse_args(self, args=None, namespace=None):
    real(self, args, namespace)
    raise Parsed

argparse.ArgumentParser.parse_args = parse_args
results = {}
for where, argv in json.loads(sys.argv[1]):
    sys.argv = list(argv)
    try:
        if argv[0] == "conduit":
            from conduit.cli import main
            main(argv[1:])
        elif argv[0] == "-m":  # python -m conduit.X / conduit_<adapter>.X
            sys.argv = list(argv[1:])
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
        results[where] = "ran past its arguments without parsing them"
    except Parsed:
        results[where] = "ok"
    except SystemExit as e:
        results[where] = f"refused (exit {e.code})"
print(json.dumps(results))
"""


def _doc_script_commands() -> list[tuple[str, list[str]]]:
    """The ``benchmarks/scripts/*.py`` command lines of the docs' bash blocks (``[--flag]`` taken as given) and of
    their inline code with arguments, the ``conduit demo --synthetic`` ones (core's own demo), and the ``python -m
    conduit.X ...`` / ``python -m conduit_<adapter>.X ...`` ones of installed packages."""
    scripts = {p.name for p in (ROOT / "benchmarks/scripts").glob("*.py")}
    out = []
    for path in DOCS:
        text = path.read_text()
        blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
        lines = [(ln, True) for block in blocks for ln in block.splitlines()]
        lines += [(span, False) for span in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))]
        for line, in_block in lines:
            if not re.search(r"\.py\b|conduit demo", line):
                continue
            words = shlex.split(line.split("#", 1)[0].replace("[", " ").replace("]", " "))
            if "..." in words:
                continue  # a variant of a command quoted before
            at = next((i for i, w in enumerate(words) if w.endswith(".py") and Path(w).name in scripts), None)
            if at is not None and (in_block or len(words) > at + 1):
                out.append((f"{path.relative_to(ROOT)}: {' '.join(words[at:])}",
                            [str(ROOT / "benchmarks/scripts" / Path(words[at]).name), *words[at + 1:]]))
            demo = next((i for i, w in enumerate(words) if w.endswith("conduit") and words[i + 1:i + 2] == ["demo"]),
                        None)
            if demo is not None and "--synthetic" in words and len(words) > demo + 3:
                out.append((f"{path.relative_to(ROOT)}: {' '.join(words[demo:])}", ["conduit", *words[demo + 1:]]))
        for m in re.finditer(r"python -m (conduit(?:_\w+)?(?:\.\w+)*)([^`\n]*)", text):  # an installed package's
            if importlib.util.find_spec(m.group(1).split(".")[0]) is not None:
                argv = [m.group(1), *shlex.split(m.group(2).split("#", 1)[0].rstrip(" \\"))]
                out.append((f"{path.relative_to(ROOT)}: python -m {' '.join(argv)}", ["-m", *argv]))
    return sorted(dict(out).items())  # (a line quoted twice in one doc: once)


@pytest.mark.timeout(300)
def test_documented_script_and_synthetic_demo_commands_parse() -> None:
    """Each benchmark script's command line as the docs quote it (e.g. ``rllib_breakdown.py dqn --obs-dim 5000
    --capacity 50000 --iterations 6``) and ``conduit demo --synthetic --obs-dim 1000`` is accepted by the argument
    parser of what it runs (not run: most take minutes)."""
    import json
    import subprocess
    import sys

    commands = _doc_script_commands()
    assert len(commands) >= 10, commands
    takes_none = [(w, argv) for w, argv in commands
                  if argv[0] not in ("conduit", "-m") and "argparse" not in Path(argv[0]).read_text()]
    assert all(len(argv) == 1 for _, argv in takes_none), f"given arguments it does not read: {takes_none}"
    commands = [c for c in commands if c not in takes_none]
    assert any("rllib_breakdown.py" in w for w, _ in commands) and any("demo --synthetic" in w for w, _ in commands)
    assert any("python -m conduit.distributed.measure" in w for w, _ in commands), commands
    done = subprocess.run([sys.executable, "-c", _PARSE_ONLY, json.dumps(commands)], capture_output=True, text=True,
                          timeout=280, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    bad = {w: r for w, r in results.items() if r != "ok"}
    assert not bad, f"{bad}\n{done.stderr[-3000:]}"
    assert set(results) == {w for w, _ in commands}
