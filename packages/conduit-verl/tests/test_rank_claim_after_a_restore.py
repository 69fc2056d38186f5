"""After a checkpoint restore, unit 0's claim of a field's rank limit takes in what the other units hold.

A restore drops unit 0's claims (the restored samples are what the fields hold). A field the checkpoint left only on
another unit is then unknown to unit 0, and the next put of it claimed the put's own rank limit there: a lower-rank put
(accepted: lower ranks are padded) claimed a limit below the one every unit holds the field at, and from then on
every put at the field's own rank was refused ("holds samples of rank <= 0 (a put of it came first), a put brought
rank 1"), from every client, although one unit, or two units without the restore, accept it. The put now claims the
largest rank limit its units reported holding (every unit answers a put's preparation).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).parent))

from test_put_all_or_nothing import _on_unit, _run  # noqa: E402

pytestmark = [pytest.mark.requires("verl"), pytest.mark.slow]


def _col(rows: list[list[float]] | list[float]) -> TensorDict:
    t = torch.tensor(rows, dtype=torch.float32)
    return TensorDict({"f": t}, batch_size=[t.shape[0]])


def test_a_field_held_only_on_unit_1_keeps_its_rank_limit_after_a_restore(tq_session: Any, tmp_path: Path) -> None:
    import transfer_queue as tq
    import verl  # noqa: F401  (verl loads its plugins: conduit-verl registers the "Conduit" backend)

    tq_session("Conduit", num_units=2, capacity=4, mean_length=2)
    client = tq.get_client()
    manager = client.storage_manager
    first = _on_unit(client, "rk", "a", 1)  # the field's first put: rank 1, held on unit 1 only
    _run(lambda: manager.put_data(_col([[1.0, 2.0]]), first))
    ckpt = tmp_path / "ckpt"
    _run(lambda: manager.save_checkpoint(str(ckpt)))
    _run(lambda: manager.load_checkpoint(str(ckpt)))  # unit 0's claims go; unit 1 holds "f" at rank 1

    lower = _on_unit(client, "rk", "b", 0)  # a rank-0 put (padded) to unit 0
    _run(lambda: manager.put_data(_col([3.0]), lower))
    same = _on_unit(client, "rk", "c", 0)  # the field's own rank again: what every unit holds it at
    _run(lambda: manager.put_data(_col([[4.0, 5.0]]), same))

    from transfer_queue.metadata import BatchMeta

    gis = [int(m.global_indexes[0]) for m in (first, lower, same)]
    got = _run_get(manager, BatchMeta(global_indexes=gis, partition_ids=["rk"] * 3, field_schema={"f": {}}))
    col = got["f"]  # (samples of two ranks: a NonTensorStack of tensors, as SimpleStorage returns them)
    rows = col.unbind() if isinstance(col, torch.Tensor) else list(col)
    assert [r.tolist() for r in rows] == [[1.0, 2.0], 3.0, [4.0, 5.0]]


def _run_get(manager: Any, meta: Any) -> Any:
    import asyncio

    return asyncio.run(manager.get_data(meta))
