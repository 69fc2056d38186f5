"""A migration off the disk tier deletes the old storage's files when it commits, not when the old storage is
garbage-collected; a migration that fails keeps them (the buffer still uses that storage).

Before, the files stayed for as long as anything referred to the old storage (a reference cycle, a caller's
variable, a traceback): a process that rebalanced off disk repeatedly could keep several capacity-sized column
files on the volume. Each test below keeps a reference to the old storage, so only the commit can remove them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, Overlapped, Replay
from conduit.errors import ConfigurationError, SchemaError
from conduit.placement import DiskPlacement, HostPlacement

SCHEMA = ExperienceSchema(x=Field((4,)))


def _disk_dirs(root: Path) -> list[Path]:
    return sorted(root.glob("conduit-disk-*"))


def _filled(root: Path, **kw: Any) -> ExperienceDataPlane:
    edp = ExperienceDataPlane(SCHEMA, capacity=16, semantics=Replay(seed=3), placement=DiskPlacement(directory=root),
                              **kw)
    edp.ingest({"x": torch.arange(40, dtype=torch.float32).reshape(10, 4)})
    edp.flush()
    return edp


@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "overlapped"])
def test_migrating_off_disk_deletes_the_old_files_at_commit(tmp_path: Path, overlapped: bool) -> None:
    kw: dict[str, Any] = {"scheduler": Overlapped(g_ing=2, g_del=2)} if overlapped else {}
    edp = _filled(tmp_path, **kw)
    old = edp.storage  # held: only the migration's commit can delete the files
    (old_dir,) = _disk_dirs(tmp_path)
    edp.migrate(HostPlacement())
    assert not old_dir.exists(), "the disk storage migrated off still has its files"
    assert old is not edp.storage
    with pytest.raises(ConfigurationError, match="closed"):  # the old storage is closed, not silently usable
        old.gather(torch.zeros(1, dtype=torch.int64))
    batch, info = edp.deliver(16)  # the buffer is intact on the new tier
    assert torch.equal(batch["x"], info.handles.to(torch.float32)[:, None] * 4 + torch.arange(4.0))
    assert len(edp) == 10
    edp.close()


def test_migrating_disk_to_disk_keeps_only_the_new_files(tmp_path: Path) -> None:
    edp = _filled(tmp_path)
    old = edp.storage
    (old_dir,) = _disk_dirs(tmp_path)
    edp.migrate(DiskPlacement(directory=tmp_path))
    dirs = _disk_dirs(tmp_path)
    assert old_dir not in dirs and dirs == [edp.storage.directory]  # type: ignore[attr-defined]
    assert old.directory == old_dir  # type: ignore[attr-defined]
    assert len(edp) == 10
    edp.close()


def test_a_failed_migration_off_disk_keeps_the_files_and_the_buffer(tmp_path: Path) -> None:
    edp = _filled(tmp_path)
    old = edp.storage
    (old_dir,) = _disk_dirs(tmp_path)
    before = edp.state_dict()

    def bad(batch: Any) -> Any:
        raise RuntimeError("boom")

    grown = ExperienceSchema(x=Field((4,)), y=Field((1,)))
    with pytest.raises(SchemaError, match="transform failed"):
        edp.migrate(HostPlacement(), schema=grown, transform=bad)
    assert edp.storage is old and old_dir.exists() and _disk_dirs(tmp_path) == [old_dir]
    after = edp.state_dict()
    assert torch.equal(after["storage"]["data"]["x"], before["storage"]["data"]["x"])
    edp.ingest({"x": torch.ones(2, 4)})
    assert len(edp) == 12
    edp.close()
