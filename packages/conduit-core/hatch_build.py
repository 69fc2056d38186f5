"""Build hook: compile conduit-core's optional C kernels where a C compiler is found.

``conduit.semantics._sumtree`` (the compiled sum tree behind prioritized replay) and ``conduit.storage._rows`` (the
host ring's one-call row store behind synchronous ingestion) are built next to their sources with the compiler and
flags this Python was built with (``sysconfig``'s ``LDSHARED``): in the source tree for an editable install, and
into the wheel otherwise (the wheel is then tagged for this platform). Where no compiler works, the build goes on
without them and the same semantics run on NumPy and torch alone (``conduit.semantics.sumtree.SumTree``, the
general ingestion path), slower; set ``CONDUIT_NO_NATIVE=1`` to build without them on purpose (a pure wheel, e.g.
for a machine with another Python).

Run as a script it compiles them for the Python that runs it, without hatchling (a machine that got a pure wheel,
or runs the source tree)::

    python packages/conduit-core/hatch_build.py                  # next to the sources, in src/
    python packages/conduit-core/hatch_build.py --into SITE      # into SITE/conduit/..., where a wheel went
                                                                 # (SITE must hold conduit/__init__.py)

It prints what it built or why not, and exits 1 when a kernel could not be built (conduit then runs without it).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:  # run as a script, where hatchling need not be installed
    BuildHookInterface = object  # type: ignore[assignment,misc]

ROOT = Path(__file__).resolve().parent
SOURCES = {"src/conduit/semantics/_sumtree.c": "conduit/semantics",
           "src/conduit/storage/_rows.c": "conduit/storage"}


def compile_kernels(root: Path, into: Path | None = None) -> tuple[dict[str, Path], dict[str, str]]:
    """Compile every source in :data:`SOURCES` (relative to ``root``) for this Python: next to the source, or into
    ``into``/package. Returns the modules built (package -> file) and the failures (source -> why); a failed
    kernel leaves no module of that name behind (one an earlier build left was compiled from another source)."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    ldshared = sysconfig.get_config_var("LDSHARED")
    if not suffix:
        return {}, {source: "this Python names no extension suffix (sysconfig EXT_SUFFIX)" for source in SOURCES}
    include = sysconfig.get_paths()["include"]
    built: dict[str, Path] = {}
    failed: dict[str, str] = {}
    for source, package in SOURCES.items():
        src = Path(root, source)
        out = (src.parent if into is None else Path(into, package)) / (src.stem + suffix)
        tmp = out.with_name(f"{out.name}.{os.getpid()}.part")  # (two builds at once write files of their own)
        try:
            if not ldshared:
                raise OSError("no C compiler settings in sysconfig (LDSHARED)")
            out.parent.mkdir(parents=True, exist_ok=True)
            cmd = [*shlex.split(ldshared), "-O2", "-fPIC", f"-I{include}", str(src), "-o", str(tmp)]
            subprocess.run(cmd, check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as e:
            failed[source] = getattr(e, "stderr", "") or str(e)
            tmp.unlink(missing_ok=True)
            out.unlink(missing_ok=True)
            continue
        tmp.replace(out)  # (at once: an import never finds a half-written file)
        built[package] = out
    return built, failed


def remove_kernels(root: Path) -> None:
    """Remove the modules an earlier build left next to the sources (an editable install imports them)."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for source in SOURCES if suffix else ():
        src = Path(root, source)
        src.with_name(src.stem + suffix).unlink(missing_ok=True)


class NativeBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        if os.environ.get("CONDUIT_NO_NATIVE") == "1":
            if version == "editable":  # (a wheel leaves src/ alone: it excludes modules found there)
                remove_kernels(Path(self.root))
            return
        built, failed = compile_kernels(Path(self.root))
        for source, why in failed.items():
            self.app.display_warning(f"conduit-core: compiling {Path(source).name} failed, so its kernels run on "
                                     f"NumPy and torch alone:\n{why}")
        if version != "editable":
            for package, out in built.items():
                build_data["pure_python"] = False
                build_data["infer_tag"] = True
                build_data["force_include"][str(out)] = f"{package}/{out.name}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Compile conduit-core's C kernels for the Python running this.")
    p.add_argument("--into", type=Path, help="a folder holding the installed conduit package (default: src/)")
    args = p.parse_args(argv)
    if args.into is not None and not (args.into / "conduit" / "__init__.py").is_file():  # (a mistyped SITE)
        p.error(f"--into {args.into} holds no conduit package (no {args.into / 'conduit' / '__init__.py'}), so the "
                f"installed conduit would not import kernels built there. Pass the folder conduit was installed into: "
                f"{sys.executable} -c 'import conduit, pathlib; print(pathlib.Path(conduit.__file__).parents[1])'")
    built, failed = compile_kernels(ROOT, args.into)
    for out in built.values():
        print(f"built {out}")
    for source, why in failed.items():
        print(f"not built: {source} ({why.strip()}); conduit runs without it", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
