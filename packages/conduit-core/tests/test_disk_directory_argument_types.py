"""The disk tier given a directory that is no path.

Bug found: ``DiskStorage(..., directory=123)`` (and ``DiskPlacement(directory=123)``, or a bytes path, when the buffer
is built) raised a bare TypeError from ``pathlib``; the other refusals of the disk tier are typed. Now a
ConfigurationError names what to pass, and nothing is made on disk.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conduit import ConfigurationError, ExperienceDataPlane, ExperienceSchema, Field
from conduit.placement import DiskPlacement
from conduit.storage import DiskStorage

SCHEMA = ExperienceSchema(id=Field((), torch.int64))


@pytest.mark.parametrize("directory", [123, b"/tmp", 1.5, ["/tmp"]])
def test_a_directory_that_is_no_path_is_refused_typed(directory: object) -> None:
    with pytest.raises(ConfigurationError, match="directory"):
        DiskStorage(SCHEMA, 4, directory=directory)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="directory"):
        ExperienceDataPlane(SCHEMA, capacity=4, placement=DiskPlacement(directory=directory))  # type: ignore[arg-type]


def test_str_and_pathlike_directories_are_taken(tmp_path: Path) -> None:
    for d in (str(tmp_path), tmp_path):
        st = DiskStorage(SCHEMA, 4, directory=d)
        assert st.directory.parent == tmp_path
        st.close()
