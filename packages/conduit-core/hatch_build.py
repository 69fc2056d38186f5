"""Build hook: compile conduit-core's optional C kernels where a C compiler is found.

``conduit.semantics._sumtree`` (the compiled sum tree behind prioritized replay) and ``conduit.storage._rows`` (the
host ring's one-call row store behind synchronous ingestion) are built next to their sources with the compiler and
flags this Python was built with (``sysconfig``'s ``LDSHARED``): in the source tree for an editable install, and
into the wheel otherwise (the wheel is then tagged for this platform). Where no compiler works, the build goes on
without them and the same semantics run on NumPy and torch alone (``conduit.semantics.sumtree.SumTree``, the
general ingestion path), slower; set ``CONDUIT_NO_NATIVE=1`` to build without them on purpose.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCES = {"src/conduit/semantics/_sumtree.c": "conduit/semantics",
           "src/conduit/storage/_rows.c": "conduit/storage"}


class NativeBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        ldshared = sysconfig.get_config_var("LDSHARED")
        off = os.environ.get("CONDUIT_NO_NATIVE") == "1"
        if off or not suffix or not ldshared:
            if suffix:  # a module an earlier build left would still be imported (an editable install reads src/)
                for source in SOURCES:
                    src = Path(self.root, source)
                    src.with_name(src.stem + suffix).unlink(missing_ok=True)
            if not off:
                self.app.display_warning("conduit-core: no C compiler settings in sysconfig; its kernels run "
                                         "on NumPy and torch alone")
            return
        include = sysconfig.get_paths()["include"]
        for source, package in SOURCES.items():
            src = Path(self.root, source)
            out = src.with_name(src.stem + suffix)
            tmp = out.with_name(f"{out.name}.{os.getpid()}.part")  # (two builds at once write files of their own)
            cmd = [*shlex.split(ldshared), "-O2", "-fPIC", f"-I{include}", str(src), "-o", str(tmp)]
            try:
                subprocess.run(cmd, check=True, capture_output=True, text=True)
            except (OSError, subprocess.CalledProcessError) as e:
                detail = getattr(e, "stderr", "") or str(e)
                self.app.display_warning(f"conduit-core: compiling {src.name} failed, so its kernels run on NumPy "
                                         f"and torch alone:\n{detail}")
                tmp.unlink(missing_ok=True)
                out.unlink(missing_ok=True)  # (a module an earlier build left was compiled from another source)
                continue
            tmp.replace(out)  # (at once: an import never finds a half-written file)
            if version != "editable":
                build_data["pure_python"] = False
                build_data["infer_tag"] = True
                build_data["force_include"][str(out)] = f"{package}/{out.name}"
