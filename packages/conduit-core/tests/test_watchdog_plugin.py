"""``conduit.testing.watchdog``: a test frozen with the GIL held (where pytest-timeout cannot fail it) ends its xdist
worker past its limit plus the grace, and the report names the test and shows where it froze; the run goes on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

FROZEN = '''
import ctypes
import pytest

@pytest.mark.timeout(1)
def test_frozen_with_the_gil_held():
    libc = ctypes.PyDLL(None)  # PyDLL: its calls keep the GIL
    mutex = ctypes.create_string_buffer(64)  # zeroed: a default (non-recursive) pthread mutex
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)  # locked again by its owner: waits for ever, GIL held, deaf to signals

def test_after_it():
    assert True
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="freezes a thread on a glibc pthread mutex")
@pytest.mark.timeout(300)
def test_a_test_frozen_with_the_gil_held_fails_alone_with_its_stack(tmp_path: Path) -> None:
    (tmp_path / "test_frozen.py").write_text(FROZEN)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "CONDUIT_WATCHDOG"))}
    env["CONDUIT_WATCHDOG_GRACE_S"] = "1"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "1", "-p", "no:cacheprovider",
                           "-p", "conduit.testing.watchdog", "test_frozen.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert "crashed while running 'test_frozen.py::test_frozen_with_the_gil_held'" in out, out[-4000:]
    assert "The watchdog ended the worker 1 s past the test's time limit" in out, out[-4000:]
    assert 'test_frozen.py", line 10 in test_frozen_with_the_gil_held' in out, out[-4000:]  # where it froze
    assert "1 failed, 1 passed" in out, out[-4000:]  # the next test ran on a new worker
