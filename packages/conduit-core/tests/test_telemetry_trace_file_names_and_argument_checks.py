"""Telemetry's trace file names and the argument checks of its readers and of ``measure_iteration``.

Each case was a known defect:

* the temporary file of :func:`~conduit.telemetry.write_atomically` kept the first 200 *characters* of the target's
  name, so a valid name of more than about 220 bytes in non-ASCII characters (80 CJK characters: 240 bytes) gave a
  temporary name past a file name's 255 bytes: ``Telemetry.chrome_trace(path)`` raised ``OSError: File name too
  long``, and ``conduit demo --synthetic --trace NAME`` (whose probe writes the name itself) ran the whole loop and
  then ended in that traceback, writing no trace;
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conduit.cli import main
from conduit.telemetry import Telemetry

#: a valid file name of 245 bytes (85 characters): each CJK character is 3 bytes in UTF-8
LONG_NAME = "轨迹" * 40 + ".json"


def _long_names_work(folder: Path) -> bool:
    try:
        (folder / LONG_NAME).write_text("")
    except OSError:  # (a file system that takes no such name: nothing to check there)
        return False
    (folder / LONG_NAME).unlink()
    return True


def test_a_trace_is_written_to_a_valid_name_of_many_multibyte_characters(tmp_path: Path) -> None:
    assert len(os.fsencode(LONG_NAME)) <= 255
    if not _long_names_work(tmp_path):
        pytest.skip("this file system does not take a 245-byte file name")
    tel = Telemetry()
    tel.record("deliver", 4, 64, 1.0, 2.0)
    trace = tel.chrome_trace(tmp_path / LONG_NAME)
    assert json.loads((tmp_path / LONG_NAME).read_text()) == trace
    assert os.listdir(tmp_path) == [LONG_NAME], "a temporary file was left behind"


def test_demo_writes_its_trace_to_a_valid_name_of_many_multibyte_characters(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if not _long_names_work(tmp_path):
        pytest.skip("this file system does not take a 245-byte file name")
    out = tmp_path / LONG_NAME
    rc = main(["demo", "--synthetic", "--obs-dim", "4", "--iterations", "1", "--warmup", "0", "--rollout", "4",
               "--batch", "4", "--capacity", "16", "--no-baseline", "--trace", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert any(e["ph"] == "X" for e in json.loads(out.read_text())["traceEvents"])
    assert os.listdir(tmp_path) == [LONG_NAME]
