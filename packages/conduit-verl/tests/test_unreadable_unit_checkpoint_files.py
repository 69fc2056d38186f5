"""A storage unit's checkpoint file that cannot be read (truncated, empty, not a torch file) is refused typed.

A unit read its file with ``torch.load`` and checked the format only of what that returned; a file it could not read
at all (a copy cut short, a disk that filled up, another program's pickle) raised torch's or pickle's own error
(``RuntimeError: PytorchStreamReader failed ...``, ``EOFError``, ``UnpicklingError``), which reached the caller of
``tq.load_checkpoint`` as Ray's ``RayTaskError`` wrapper, its message starting with the unit's remote traceback. The
unit now refuses such a file with the :class:`~conduit.SchemaError` its docstring promised for a file not written by
a Conduit unit, saying what to do, and nothing is staged or changed.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.requires("verl")


def _cut(data: bytes) -> bytes:
    return data[: len(data) // 2]


#: ways a unit's file can be unreadable: what to write in its place, from the intact file's bytes
UNREADABLE: dict[str, Callable[[bytes], bytes]] = {
    "truncated": _cut,
    "empty": lambda data: b"",
    "a plain pickle": lambda data: pickle.dumps({"format": 1}),
    "text": lambda data: b"not a checkpoint\n",
}


@pytest.mark.parametrize("how", sorted(UNREADABLE))
def test_a_unit_refuses_an_unreadable_file_typed_and_changes_nothing(tmp_path: Path, how: str) -> None:
    from conduit import SchemaError
    from conduit_verl.packing import from_wire, pack_column, to_wire
    from conduit_verl.tq_storage import DEFAULTS
    from conduit_verl.unit import _UnitState

    unit = _UnitState(dict(DEFAULTS, capacity=2, mean_length=2))
    unit.put([0, 1], {"r": to_wire(pack_column(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), 2)), "uid": ["a", "b"]})
    good = tmp_path / "unit.pt"
    unit.save(str(good))
    unit.put([2], {"r": to_wire(pack_column(torch.tensor([[5.0, 6.0]]), 1)), "uid": ["c"]})
    bad = tmp_path / "bad.pt"
    bad.write_bytes(UNREADABLE[how](good.read_bytes()))

    for read in (unit.stage, unit.load):
        with pytest.raises(SchemaError, match="could not be read as a Conduit storage unit checkpoint") as err:
            read(str(bad))
        assert str(bad) in str(err.value) and "intact copy" in str(err.value)
        assert unit.staged is None, "an unreadable file left something staged"
        assert from_wire(unit.get([0, 1, 2], ["r"])["r"]).values.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        assert unit.get([0, 1, 2], ["uid"])["uid"] == ["a", "b", "c"]

    assert unit.load(str(good)) == 2  # the intact file still restores
    assert unit.get([0, 1], ["uid"])["uid"] == ["a", "b"] and 2 not in unit.fields["r"]


@pytest.mark.slow
def test_a_restore_with_a_truncated_unit_file_raises_schema_error_itself(tq_session: Any, tmp_path: Path) -> None:
    """Two units; unit 1's file is cut short. The manager's restore raises the unit's SchemaError itself (no Ray
    wrapper, its message first) and neither unit changes."""
    import shutil
    import sys

    import ray
    import transfer_queue as tq
    import verl  # noqa: F401  (verl loads its plugins: conduit-verl registers the "Conduit" backend)
    from conduit import SchemaError

    sys.path.insert(0, str(Path(__file__).parent))
    from test_put_all_or_nothing import _metas, _rows, _run, _state

    tq_session("Conduit", num_units=2, capacity=4, mean_length=2)
    client = tq.get_client()
    manager = client.storage_manager
    _run(lambda: manager.put_data(_rows([1.0, 2.0], ["a0", "a1"]), _metas(client, "ckpt", ["a0", "a1"])))
    ckpt = tmp_path / "ckpt"
    _run(lambda: manager.save_checkpoint(str(ckpt)))
    _run(lambda: manager.put_data(_rows([3.0, 4.0], ["b0", "b1"]), _metas(client, "ckpt", ["b0", "b1"])))
    now = _state(manager, tmp_path)

    unit1 = ckpt / "conduit_unit_1.pt"
    shutil.copy(unit1, tmp_path / "good_unit_1.pt")
    unit1.write_bytes(_cut(unit1.read_bytes()))
    with pytest.raises(SchemaError) as err:
        _run(lambda: manager.load_checkpoint(str(ckpt)))
    assert type(err.value) is SchemaError and not isinstance(err.value, ray.exceptions.RayTaskError)
    assert str(err.value).startswith(f"{unit1} could not be read"), str(err.value)[:300]
    assert _state(manager, tmp_path) == now, "a refused restore changed the units"


@pytest.mark.slow
def test_a_relative_checkpoint_dir_is_the_callers(tq_session: Any, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's ``trainer.default_local_dir`` is relative (``checkpoints/<project>/<experiment>``) and TransferQueue hands
    the checkpoint dir on as given. The manager created it in its own working directory, but each unit wrote its file
    relative to the unit process's working directory (another one; on another node, another machine): the save failed
    there with Ray's untyped wrapper of FileNotFoundError, or the files landed outside the checkpoint. Saves and
    restores now resolve the dir against the caller's working directory."""
    import sys

    import transfer_queue as tq
    import verl  # noqa: F401  (verl loads its plugins: conduit-verl registers the "Conduit" backend)

    sys.path.insert(0, str(Path(__file__).parent))
    from test_put_all_or_nothing import _metas, _rows, _run, _state

    tq_session("Conduit", num_units=1, capacity=4, mean_length=2)
    client = tq.get_client()
    manager = client.storage_manager
    _run(lambda: manager.put_data(_rows([1.0, 2.0], ["a0", "a1"]), _metas(client, "rel", ["a0", "a1"])))
    saved = _state(manager, tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # (the units' processes keep the working directory they started in)
    _run(lambda: manager.save_checkpoint("checkpoints/step_1/transfer_queue"))
    assert (work / "checkpoints/step_1/transfer_queue/conduit_unit_0.pt").is_file()
    _run(lambda: manager.put_data(_rows([3.0], ["b0"]), _metas(client, "rel", ["b0"])))
    _run(lambda: manager.load_checkpoint("checkpoints/step_1/transfer_queue"))
    assert _state(manager, tmp_path) == saved, "the restore did not bring back what was saved"
