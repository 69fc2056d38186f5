"""The Conduit TransferQueue backend: clears during two-phase puts, and the error of a missing sample.

* A clear that reached a unit after a put's prepared part (and before its commit) did not apply to that part: the
  commit stored the cleared samples again. verl clears consumed keys (``tq.kv_clear``) and TransferQueue's controller
  hands freed global indexes to new keys, so the old samples came back, or landed under another key. On SimpleStorage
  a put that reached its unit before a clear is cleared by it. A unit now remembers which of a prepared put's global
  indexes a clear named, and the commit skips them.
* A read of a sample the storage does not hold raised Conduit's ``MissingKeyError``, a plain ``KeyError``: code
  that, as TransferQueue's docs say, catches ``transfer_queue.StorageKeyNotFoundError`` for a read racing a clear
  did not catch it. ``MissingKeyError`` is now a ``StorageKeyNotFoundError`` too.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from test_put_all_or_nothing import (  # noqa: E402
    _expected,
    _Gate,
    _gated,
    _metas,
    _Put,
    _reach,
    _rows,
    _run,
    _state,
    _unit_state,
    _wire,
)

pytestmark = pytest.mark.requires("verl")


def test_a_clear_after_a_put_was_prepared_is_not_undone_by_its_commit() -> None:
    """Put "a" of global indexes 2 and 4 is prepared; a clear of 2 comes; a new key's put takes index 2 (the
    controller reuses freed indexes); "a" commits. Index 2 must hold the new put's sample and 4 "a"'s; a prepared put
    whose every index was cleared stores nothing; a clear of an index a put prepares later does not touch it."""
    from conduit_verl.tq_storage import DEFAULTS
    from conduit_verl.unit import _UnitState

    unit = _UnitState(dict(DEFAULTS, capacity=4, mean_length=2, num_units=2))
    unit.prepare("a", [2, 4], _wire([1.0, 2.0]))
    unit.clear([2])
    unit.put([2], _wire([7.0]))  # the new key under the freed index
    unit.commit("a", {})
    assert _unit_state(unit) == {"r": {2: [7.0], 4: [2.0]}, "uid": {2: "u7.0", 4: "u2.0"}, "pending": []}, (
        "the commit of a put prepared before a clear stored the cleared sample again, over the new key's")

    unit.prepare("b", [6], _wire([3.0]))
    unit.clear([6])
    unit.commit("b", {})
    unit.clear([8])
    unit.prepare("c", [8], _wire([5.0]))  # prepared after the clear of 8: stores it
    unit.commit("c", {})
    assert _unit_state(unit) == {"r": {2: [7.0], 4: [2.0], 8: [5.0]}, "uid": {2: "u7.0", 4: "u2.0", 8: "u5.0"},
                                 "pending": []}, "a wholly cleared prepared put stored, or a later put lost samples"
    assert unit.cleared == {}, f"the commits left their cleared indexes behind: {unit.cleared}"


def test_a_missing_sample_is_transfer_queues_storage_key_not_found_error() -> None:
    """SimpleStorage raises transfer_queue.StorageKeyNotFoundError for a sample it does not hold; so must Conduit,
    for a cleared sample, a field a unit never got, and a sample a prepared put has not committed yet."""
    import transfer_queue as tq
    from conduit_verl.compat import MissingKeyError
    from conduit_verl.tq_storage import DEFAULTS
    from conduit_verl.unit import _UnitState

    unit = _UnitState(dict(DEFAULTS, capacity=4, mean_length=2, num_units=2))
    unit.put([0, 2], _wire([1.0, 2.0]))
    unit.clear([2])
    unit.prepare("p", [4], _wire([3.0]))
    for gis, fields in (([2], ["r"]), ([2], ["uid"]), ([0], ["nope"]), ([4], ["r"])):
        with pytest.raises(tq.StorageKeyNotFoundError) as err:
            unit.get(gis, fields)
        assert isinstance(err.value, MissingKeyError) and isinstance(err.value, KeyError)


@pytest.mark.slow
def test_kv_clear_during_a_put_over_two_units_leaves_nothing_of_it(tq_session: Any, tmp_path: Path) -> None:
    """Through TransferQueue with two real units: a put spanning both is held after every unit prepared it, its
    samples are cleared, then it commits. Nothing of it may be stored on either unit (it used to be stored whole,
    after the clear), and reading it raises transfer_queue.StorageKeyNotFoundError, as on SimpleStorage."""
    import transfer_queue as tq
    import verl  # noqa: F401  (verl loads its plugins: conduit-verl registers the "Conduit" backend)
    from transfer_queue.metadata import BatchMeta

    tq_session("Conduit", num_units=2, capacity=4, mean_length=2)
    client = tq.get_client()
    manager = client.storage_manager
    kept = _metas(client, "clr", ["k0", "k1"])
    _run(lambda: manager.put_data(_rows([9.0, 8.0], ["k0", "k1"]), kept))
    meta = _metas(client, "clr", ["a0", "a1"])
    assert sorted(int(g) % 2 for g in meta.global_indexes) == [0, 1], "the put must span both units"

    with _gated(manager) as gates:
        put = _Put(manager, _rows([1.0, 2.0], ["a0", "a1"]), meta, gates, _Gate())
        _reach(put)  # both units prepared it; it waits before committing
        _run(lambda: manager.clear_data(meta))
        assert put.gate is not None
        put.gate.open()
        error = put.finish()

    assert error is None, f"the put's commit was refused: {error!r}"
    got = _state(manager, tmp_path)
    want = _expected([(kept, [9.0, 8.0], ["k0", "k1"])])
    assert got == want, f"samples cleared while their put was in flight were stored after the clear:\n got  {got}\n" \
                        f" want {want}"
    gis = [int(g) for g in meta.global_indexes]
    for field in ("r", "uid"):
        with pytest.raises(tq.StorageKeyNotFoundError):
            asyncio.run(manager.get_data(BatchMeta(global_indexes=gis, partition_ids=["clr"] * 2,
                                                   field_schema={field: {}})))
    back = asyncio.run(manager.get_data(BatchMeta(global_indexes=[int(g) for g in kept.global_indexes],
                                                  partition_ids=["clr"] * 2, field_schema={"r": {}})))
    rows = [row.tolist() for row in back["r"].unbind(0)]
    assert rows == [[9.0, 9.0], [8.0, 8.0]], f"the other samples changed: {rows}"


@pytest.mark.slow
def test_a_restore_one_unit_refuses_changes_no_unit(tq_session: Any, tmp_path: Path) -> None:
    """Two units; unit 1's checkpoint file is not a Conduit one. load_checkpoint must raise SchemaError and leave
    both units as they were (unit 0 used to restore its file before unit 1 refused, mixing two points in time);
    with the right file back, the restore brings both units to the checkpoint."""
    import shutil

    import torch
    import transfer_queue as tq
    import verl  # noqa: F401
    from conduit import SchemaError

    tq_session("Conduit", num_units=2, capacity=4, mean_length=2)
    client = tq.get_client()
    manager = client.storage_manager
    first = _metas(client, "ckpt", ["a0", "a1"])
    _run(lambda: manager.put_data(_rows([1.0, 2.0], ["a0", "a1"]), first))
    ckpt = tmp_path / "ckpt"
    _run(lambda: manager.save_checkpoint(str(ckpt)))
    saved = _state(manager, tmp_path)
    later = _metas(client, "ckpt", ["b0", "b1"])
    _run(lambda: manager.put_data(_rows([3.0, 4.0], ["b0", "b1"]), later))
    now = _state(manager, tmp_path)
    assert now != saved

    unit1 = ckpt / "conduit_unit_1.pt"
    shutil.copy(unit1, tmp_path / "good_unit_1.pt")
    torch.save({"format": 99}, unit1)
    with pytest.raises(SchemaError, match="not written by a Conduit storage unit"):
        _run(lambda: manager.load_checkpoint(str(ckpt)))
    got = _state(manager, tmp_path)
    assert got == now, f"a refused restore changed the units:\n got  {got}\n want {now}"

    shutil.copy(tmp_path / "good_unit_1.pt", unit1)
    _run(lambda: manager.load_checkpoint(str(ckpt)))
    assert _state(manager, tmp_path) == saved, "the restore did not bring the units to the checkpoint"
