"""A cross-process determinism subprocess dies with the process that started it.

It runs in its own session (so that a timeout can kill it with what it started); with nothing tying it to its
parent, a parent killed outright (a test runner's SIGKILL) while the subprocess hung left it running for ever. Here
a real parent process starts a subprocess whose factory's module hangs at import, and is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conduit.testing.lifecycle import HANG_S, eventually

pytestmark = pytest.mark.skipif(os.name != "posix", reason="parent death is watched on posix only")


def _gone(pid: int) -> bool:
    """Whether process ``pid`` ended (a zombie that its new parent has not reaped yet counts as ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


def test_a_hung_subprocess_dies_when_its_parent_is_killed(tmp_path: Path) -> None:
    marker = tmp_path / "hanging"
    (tmp_path / "hangs_at_import.py").write_text(textwrap.dedent(f"""
        import pathlib, time
        pathlib.Path({str(marker)!r}).touch()
        time.sleep(3600)
    """))
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            sys.path.insert(0, {str(tmp_path)!r})
            from conduit.testing.crossprocess import _start
            print(_start("hangs_at_import:factory", 0).proc.pid, flush=True)
            time.sleep(3600)
        """)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    child = None
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert eventually(marker.exists, timeout=HANG_S), "the subprocess never reached the factory's module"
        assert not _gone(child)
        parent.kill()
        parent.wait()
        assert eventually(lambda: _gone(child), timeout=HANG_S), "the subprocess outlived its killed parent"
    finally:
        parent.kill()
        parent.wait()
        if child is not None and not _gone(child):
            os.killpg(child, signal.SIGKILL)  # (its own session: what it started goes too)
