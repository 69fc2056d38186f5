"""The ``Conduit`` TransferQueue backend through TransferQueue's own API, against SimpleStorage.

A fresh local Ray instance, TransferQueue 0.1.11's controller, and ``tq.kv_batch_put`` /
``kv_batch_get`` / ``kv_clear`` as verl's V1 trainer calls them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

pytestmark = [pytest.mark.requires("verl"), pytest.mark.slow]


def trajectories(n: int, seed: int, max_len: int = 9) -> TensorDict:
    """Rows shaped as verl's AgentLoopWorkerTQ writes them (jagged tokens, scalars, objects)."""
    g = torch.Generator().manual_seed(seed)
    resp = [torch.randint(3, 300, (int(torch.randint(1, max_len, (1,), generator=g)),), generator=g) for _ in range(n)]
    return TensorDict({
        "responses": torch.nested.as_nested_tensor(resp, layout=torch.jagged),
        "rollout_log_probs": torch.nested.as_nested_tensor([-torch.rand(len(r), generator=g) for r in resp],
                                                           layout=torch.jagged),
        "pair": torch.randn(n, 2, generator=g),
        "score": torch.rand(n, generator=g).to(torch.bfloat16),
        "uid": NonTensorStack(*[f"u{seed}-{i // 2}" for i in range(n)]),
    }, batch_size=[n])


def roundtrip(start: Any, backend: str, **cfg: Any) -> dict[str, Any]:
    import transfer_queue as tq
    import verl  # noqa: F401  (verl loads its plugins: conduit-verl registers the "Conduit" backend)

    start(backend, **cfg)
    out: dict[str, Any] = {}
    keys = [f"k{i}" for i in range(8)]
    tq.kv_batch_put(keys=keys, partition_id="train", fields=trajectories(8, 0), tags=[{"i": i} for i in range(8)])
    # results written back later, for a reordered subset (as _compute_old_log_prob / _compute_advantage do)
    sub = keys[::-1][:5]
    tq.kv_batch_put(keys=sub, partition_id="train",
                    fields=TensorDict({"advantages": torch.nested.as_nested_tensor(
                        [torch.full((i + 1,), float(i)) for i in range(5)], layout=torch.jagged)}, batch_size=[5]))
    got = tq.kv_batch_get(keys=sub, partition_id="train",
                          select_fields=["responses", "rollout_log_probs", "pair", "score", "uid", "advantages"])
    out["rows"] = {k: [r.tolist() for r in got[k].unbind()] for k in ("responses", "rollout_log_probs", "advantages")}
    # verl pads whole TensorDicts (DataProto(batch=td.to_padded_tensor())): row lengths must be right
    out["padded"] = {k: tuple(v.shape) for k, v in got.select(*out["rows"]).to_padded_tensor().items()}
    out["pair"], out["score"], out["uid"] = got["pair"], got["score"], list(got["uid"])
    out["types"] = {k: (type(v).__name__, getattr(v, "is_nested", None)) for k, v in got.items()}
    tq.kv_clear(keys=keys[:4], partition_id="train")
    left = tq.kv_batch_get(keys=keys[4:], partition_id="train", select_fields=["responses"])
    out["left"] = [r.tolist() for r in left["responses"].unbind()]
    if backend == "Conduit":
        out["stats"] = tq.get_client().storage_manager.stats()
    return out


def test_same_columns_as_simple_storage_and_a_checkpoint_through_transfer_queue(tq_session: Any,
                                                                               tmp_path: Any) -> None:
    """Every column comes back as SimpleStorage returns it (types, values, padding), before and after clears.

    Then, on the same Conduit units (a TransferQueue start fewer): tq.save_checkpoint / tq.load_checkpoint (what
    verl's async trainers call) keep Conduit's samples."""
    import transfer_queue as tq

    ref = roundtrip(tq_session, "SimpleStorage")
    tq.close()
    got = roundtrip(tq_session, "Conduit", num_units=2, capacity=4, mean_length=2)  # forces routing + migration
    assert got["types"] == ref["types"]
    assert got["rows"] == ref["rows"] and got["padded"] == ref["padded"]
    assert [r.tolist() for r in got["pair"].unbind()] == [r.tolist() for r in ref["pair"].unbind()]  # rows, nested
    assert torch.equal(got["score"], ref["score"])  # scalars: dense, bf16 kept
    assert got["uid"] == ref["uid"] and got["left"] == ref["left"]
    stats = got["stats"]
    assert len(stats) == 2 and all(s["fields"]["responses"]["samples"] == 2 for s in stats)  # 4 of 8 left, 2 units
    assert any(s["migrations"] for s in stats), "tiny first placements should have migrated"

    keys = [f"c{i}" for i in range(6)]
    tq.kv_batch_put(keys=keys, partition_id="train", fields=trajectories(6, 3), tags=[{}] * 6)
    before = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["responses", "uid"])
    tq.save_checkpoint(str(tmp_path / "ckpt"))
    tq.kv_clear(keys=keys, partition_id="train")
    tq.load_checkpoint(str(tmp_path / "ckpt"))
    after = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["responses", "uid"])
    assert [r.tolist() for r in after["responses"].unbind()] == [r.tolist() for r in before["responses"].unbind()]
    assert list(after["uid"]) == list(before["uid"])


def test_a_put_one_unit_refuses_stores_nothing_on_the_others(tq_session: Any, monkeypatch: Any) -> None:
    """A put split over two units, one of them at ``max_items``: the typed error must leave the other unit
    as it was. It used to store its share, so half of the put landed."""
    import transfer_queue as tq
    import verl  # noqa: F401
    from conduit_verl.tq_storage import ConduitStorageManager

    routes: list[dict[int, list[int]]] = []
    route = ConduitStorageManager._route

    def recorded(self: Any, gis: list[int]) -> dict[int, list[int]]:
        routes.append(route(self, gis))
        return routes[-1]

    monkeypatch.setattr(ConduitStorageManager, "_route", recorded)
    tq_session("Conduit", num_units=2, capacity=4, max_items=2)
    keys = [f"a{i}" for i in range(4)]
    tq.kv_batch_put(keys=keys, partition_id="train", fields=trajectories(4, 5), tags=[{}] * 4)
    manager = tq.get_client().storage_manager
    assert [s["fields"]["responses"]["samples"] for s in manager.stats()] == [2, 2]
    tq.kv_clear(keys=keys[1:2], partition_id="train")  # unit 1 has room for one more sample, unit 0 none
    held = [s["fields"]["responses"]["samples"] for s in manager.stats()]
    assert held == [2, 1]
    with pytest.raises(Exception, match="max_items"):
        tq.kv_batch_put(keys=["b0", "b1"], partition_id="train", fields=trajectories(2, 6), tags=[{}] * 2)
    assert len(routes[-1]) == 2, f"the refused put should span both units: {routes[-1]}"
    after = [s["fields"]["responses"]["samples"] for s in manager.stats()]
    assert after == held, f"a refused put stored part of its samples: {held} -> {after}"
    left = tq.kv_batch_get(keys=[keys[0], *keys[2:]], partition_id="train", select_fields=["responses"])
    assert len(left["responses"].unbind()) == 3
