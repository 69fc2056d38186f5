"""The kernels' build (``packages/conduit-core/hatch_build.py``), run as a script: what a machine that got a pure
wheel, or runs the source tree (the GPU scripts), uses to compile the C kernels for its own Python."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from conduit.semantics import sumtree

HOOK = Path(__file__).resolve().parents[1] / "hatch_build.py"


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("conduit_build_hook", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_builds_every_kernel_into_a_site_folder(tmp_path: Path) -> None:
    """``hatch_build.py --into SITE`` puts each module where an installed ``conduit`` package would import it, with
    every kernel the package looks for; where this install has no compiled kernels (no compiler at install) the
    script says so and exits 1 instead."""
    (tmp_path / "conduit").mkdir()
    (tmp_path / "conduit" / "__init__.py").write_text("")  # (where a wheel installed conduit)
    proc = subprocess.run([sys.executable, str(HOOK), "--into", str(tmp_path)], capture_output=True, text=True,
                          timeout=240)
    if not sumtree.COMPILED:  # (test_the_compiled_tree_is_built says whether that is expected here)
        assert proc.returncode == 1 and "not built" in proc.stderr, proc.stdout + proc.stderr
        return
    assert proc.returncode == 0, proc.stdout + proc.stderr
    suffix = _hook().sysconfig.get_config_var("EXT_SUFFIX")
    rows = tmp_path / "conduit" / "storage" / f"_rows{suffix}"
    tree = tmp_path / "conduit" / "semantics" / f"_sumtree{suffix}"
    assert f"built {rows}" in proc.stdout and f"built {tree}" in proc.stdout, proc.stdout
    assert all(hasattr(_load(rows, "_rows"), k) for k in ("put", "gather"))
    assert all(hasattr(_load(tree, "_sumtree"), k) for k in sumtree.KERNELS)


def test_into_a_folder_that_holds_no_conduit_package_is_refused_and_builds_nothing(tmp_path: Path) -> None:
    """A mistyped ``--into`` (another Python's site-packages, a folder that does not exist) would otherwise print
    ``built ...`` for modules the installed conduit never imports, and ``sumtree.COMPILED`` would stay False there.
    The script refuses it, says what to pass, and writes nothing."""
    site = tmp_path / "site-packages"
    proc = subprocess.run([sys.executable, str(HOOK), "--into", str(site)], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "holds no conduit package" in proc.stderr and "conduit.__file__" in proc.stderr, proc.stderr
    assert "built" not in proc.stdout, proc.stdout
    assert not site.exists(), "a refused --into created folders"


def test_a_kernel_that_does_not_compile_is_reported_and_leaves_no_module(tmp_path: Path) -> None:
    """A source that fails to compile is named with the compiler's message, and a module an earlier build left under
    that name is removed (it was compiled from another source); the other kernel is still built."""
    hook = _hook()
    root, site = tmp_path / "src-root", tmp_path / "site"
    suffix = hook.sysconfig.get_config_var("EXT_SUFFIX")
    (bad, bad_pkg), (good, good_pkg) = hook.SOURCES.items()
    for source in (bad, good):
        (root / source).parent.mkdir(parents=True, exist_ok=True)
    (root / bad).write_text("this is not C;\n")
    (root / good).write_text((HOOK.parent / good).read_text())
    leftover = site / bad_pkg / (Path(bad).stem + suffix)
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"an older build")
    built, failed = hook.compile_kernels(root, site)
    assert list(failed) == [bad] and "error" in failed[bad].lower(), failed
    assert not leftover.exists()
    if sumtree.COMPILED:  # (a compiler works here)
        assert built == {good_pkg: site / good_pkg / (Path(good).stem + suffix)}
        assert built[good_pkg].is_file()
    assert not list(site.rglob("*.part")), "a failed or finished build leaves no temporary file"
