"""The header line a script's results file starts with: the machine, the command that wrote it, the date."""

from __future__ import annotations

import datetime
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name as ``lscpu`` reports it (``/proc/cpuinfo`` where there is no ``lscpu``), or ``unknown``."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def header_line(script: str, argv: Sequence[str] | None = None) -> str:
    """``Machine: <n> CPUs (nproc), <model>; command: `<command>`; date: <UTC date>.`` for ``script`` run with
    ``argv`` (the process's arguments when None)."""
    args = list(sys.argv[1:] if argv is None else argv)
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    command = shlex.join(["python", f"benchmarks/scripts/{script}", *args])
    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    return f"Machine: {ncpu} CPUs (nproc), {cpu_model()}; command: `{command}`; date: {date}."
