"""Every name a reader could look up in the docs exists: the dotted ``conduit...`` / ``conduit_<adapter>...`` names,
the ``test_...`` functions cited as evidence, and the repository paths the package READMEs and
``benchmarks/docs/*.md`` name (``test_readme_claims.py`` checks the root and benchmarks READMEs' paths).

The docs: the root README, every package README, ``benchmarks/README.md`` and ``benchmarks/docs/*.md``.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "README.md", *sorted((ROOT / "packages").glob("*/README.md")), ROOT / "benchmarks/README.md",
        *sorted((ROOT / "benchmarks/docs").glob("*.md"))]

#: dotted names in the docs that are not Python objects, and what they are
NOT_OBJECTS = {
    "conduit.conformance": "the entry-point group adapters register their conformance endpoints under",
}

#: files the docs name that a command writes where it runs (not repository files)
OUTPUTS = {"conduit-demo-rllib.png", "conduit-synthetic-trace.json", "dqn128.png"}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _dotted_names(text: str) -> set[str]:
    """``conduit.X.Y`` / ``conduit_rllib.X`` ... at the start of a code span (a call's arguments left off)."""
    return set(re.findall(r"`((?:conduit|conduit_rllib|conduit_verl|conduit_srl)(?:\.[A-Za-z_]\w*)+)", text))


def _resolve(dotted: str) -> str | None:
    """None if ``dotted`` names a module or an attribute of one, else what is missing."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name is not None and not dotted.startswith(e.name):
                raise  # (a dependency missing, not the documented name)
            continue
        for j, attr in enumerate(parts[i:], start=i):
            if not hasattr(obj, attr):
                return f"{'.'.join(parts[:j])} has no {attr!r}"
            obj = getattr(obj, attr)
        return None
    return f"no module {parts[0]!r}"


def _doc_names_by_package() -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {}
    for doc in DOCS:
        for name in sorted(_dotted_names(doc.read_text())):
            if name not in NOT_OBJECTS:
                out.setdefault(name.split(".")[0], []).append((_rel(doc), name))
    return out


NAMES = _doc_names_by_package()


@pytest.mark.parametrize("package", ["conduit", "conduit_rllib", "conduit_verl", "conduit_srl"])
def test_every_dotted_name_the_docs_give_imports(package: str) -> None:
    """``conduit.semantics.sumtree.COMPILED``, ``conduit_rllib.compat.check`` ...: each imports as written (an
    adapter's names are checked where that adapter is installed)."""
    if package != "conduit":
        pytest.importorskip(package)
    named = NAMES.get(package, [])
    assert package != "conduit" or len(named) >= 10, named
    wrong = [f"{doc}: `{name}`: {why}" for doc, name in named if (why := _resolve(name)) is not None]
    assert not wrong, "\n".join(wrong)


def test_the_dotted_name_check_catches_a_wrong_name() -> None:
    assert _resolve("conduit.semantics.sumtree.COMPILED") is None
    assert _resolve("conduit.semantics.sumtree.COMPILD") is not None
    assert _resolve("conduit.semantic.sumtree") is not None
    assert _dotted_names("see `conduit.storage.columnar.stream_thresholds(llc)` and `conduit_srl.install()`") == {
        "conduit.storage.columnar.stream_thresholds", "conduit_srl.install"}


def _test_functions() -> set[str]:
    names: set[str] = set()
    for rel in _repository_files():
        if Path(rel).name.startswith("test") and rel.endswith(".py"):
            names |= set(re.findall(r"^\s*(?:async )?def (test_\w+)", (ROOT / rel).read_text(), re.M))
    for path in (ROOT / "packages/conduit-core/src/conduit/testing").rglob("*.py"):  # the conformance suites' tests
        names |= set(re.findall(r"^\s*def (test_\w+)", path.read_text(), re.M))
    return names


def test_every_test_the_docs_cite_exists() -> None:
    """A doc that cites ``test_prefetch_never_crosses_a_policy_version`` as its evidence names a test that runs."""
    defined = _test_functions()
    cited = [(_rel(doc), name) for doc in DOCS for name in sorted(set(re.findall(r"`(test_\w+)(?:[`\[(])",
                                                                                    doc.read_text())))]
    assert len(cited) >= 10, cited
    wrong = [f"{doc}: `{name}`" for doc, name in cited if name not in defined]
    assert not wrong, "the docs cite tests that do not exist:\n" + "\n".join(wrong)


def _repository_files() -> list[str]:
    """The files under the repository root, outside version-control, environment and cache folders (no git needed:
    the tests also run from an unpacked source tree)."""
    import os

    skip = {".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", "node_modules"}
    files = []
    for folder, subfolders, names in os.walk(ROOT):
        subfolders[:] = [s for s in subfolders if s not in skip]  # (not walked at all: a venv holds many files)
        files += [str((Path(folder) / n).relative_to(ROOT)) for n in names]
    return files


_PATH = re.compile(r"`([\w./{},-]+\.(?:py|md|json|sh|png|txt|toml|pt|log|csv|so))`|\]\(((?!https?:|#|mailto:)[^)#\s]+)")


def _missing_paths(doc: Path, text: str, files: list[str]) -> list[str]:
    """The paths ``text`` (from ``doc``) names that are no repository file or folder.

    A path with a folder resolves against the doc's folder, the repository root, ``benchmarks/`` (and its
    ``results/`` and ``scripts/``), the doc's package (its root, ``tests/``, ``src/``) or core's ``src/``
    (``conduit/placement/cost.py``); ``tests/x.py`` may be any package's; ``{a,b}`` expands. A bare file name is
    found anywhere in the repository. ``..._x.json`` (a shortened name) is left alone."""
    basenames = {Path(f).name for f in files}
    package = doc.relative_to(ROOT).parts[1] if doc.relative_to(ROOT).parts[0] == "packages" else None
    bases = [doc.parent, ROOT, ROOT / "benchmarks", ROOT / "benchmarks/results", ROOT / "benchmarks/scripts",
             ROOT / "packages/conduit-core/src"]
    if package is not None:
        bases += [ROOT / "packages" / package / sub for sub in ("", "tests", "src")]
    missing = []
    for m in _PATH.finditer(text):
        token = m.group(1) or m.group(2)
        if token.startswith("...") or token in OUTPUTS:
            continue
        brace = re.search(r"\{([^}]*)\}", token)
        variants = [token[:brace.start()] + v + token[brace.end():] for v in brace.group(1).split(",")] \
            if brace else [token]
        for path in variants:
            if "/" not in path:
                found = path in basenames
            elif path.startswith("tests/"):
                found = any((p / path).exists() for p in (ROOT / "packages").iterdir()) or \
                    any((base / path).exists() for base in bases)
            else:
                found = any((base / path).exists() for base in bases)
            if not found:
                missing.append(path)
    return missing


def test_every_path_the_package_readmes_and_benchmark_docs_name_exists() -> None:
    files = _repository_files()
    wrong = []
    for doc in [d for d in DOCS if d.parent.name == "docs" or d.parent.parent.name == "packages"]:
        wrong += [f"{_rel(doc)}: {path}" for path in _missing_paths(doc, doc.read_text(), files)]
    assert not wrong, "the docs name files that are not in the repository:\n" + "\n".join(wrong)


def test_the_path_check_catches_a_wrong_path() -> None:
    files = _repository_files()
    doc = ROOT / "benchmarks/docs/placement.md"
    assert _missing_paths(doc, "`conduit/placement/cost.py`, `test_tiers.py`, `conduit/storage/{sharded,disk}.py`, "
                                "[x](scheduling.md#what-there-is)", files) == []
    assert _missing_paths(doc, "`conduit/placement/costs.py` and `test_tier.py` and [x](schedule.md)", files) == [
        "conduit/placement/costs.py", "test_tier.py", "schedule.md"]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _broken_anchors(doc: Path, text: str) -> list[str]:
    """The ``[..](file.md#heading)`` links (and ``file.md#heading`` code spans) of ``text`` whose heading the
    target lacks (headings inside code blocks are not headings)."""
    wrong = []
    for m in re.finditer(r"\]\(((?!https?:)[^)\s#]*)#([^)\s]+)\)|`([\w./-]+\.md)#([\w-]+)`", text):
        target, anchor = (m.group(1), m.group(2)) if m.group(2) else (m.group(3), m.group(4))
        path = (doc.parent / target).resolve() if target else doc
        if not path.is_file():
            wrong.append(f"{target}#{anchor} (no such file)")
            continue
        body = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        if anchor not in {_anchor(h) for h in re.findall(r"^#+ (.+)$", body, re.M)}:
            wrong.append(f"{target}#{anchor}")
    return wrong


def test_every_link_to_a_heading_in_the_docs_resolves() -> None:
    wrong = [f"{_rel(doc)}: {link}" for doc in DOCS for link in _broken_anchors(doc, doc.read_text())]
    assert not wrong, "links to headings that do not exist:\n" + "\n".join(wrong)
    doc = ROOT / "benchmarks/docs/rllib.md"
    assert _broken_anchors(doc, "[a](../README.md#prioritized-replay-step) `../README.md#host-tier`") == []
    assert _broken_anchors(doc, "[a](../README.md#prioritised-replay-step) [b](#no-such-heading)") == [
        "../README.md#prioritised-replay-step", "#no-such-heading"]
