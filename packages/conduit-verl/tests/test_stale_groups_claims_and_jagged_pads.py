"""Unit 0's claims across a put, and jagged columns padded as verl pads them. (The per-step ``stale_groups`` test
of this round runs on a shared live TransferQueue in ``test_replay_raise_names_and_drops_stale_groups.py``.)

* A put over several storage units sent unit 0 the message to keep its claims without waiting for it, then its
  commits. Ray orders no calls to different actors, so a client killed with a commit stored could leave the keep
  undelivered, and unit 0 then gave back the claim of a field a unit holds (a racing put could then store the field
  in another dtype, and reads across units fail). The put now waits until unit 0 kept its claims before it commits.
* A jagged minibatch column whose samples have a trailing dimension padded (``to_padded_tensor``) to its longest
  row, verl's own iterator's to the minibatch's total length (verl builds those without cached row lengths): the
  shapes a loss pads to differed. Conduit now builds them as verl does.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

sys.path.insert(0, str(Path(__file__).parent))
from test_put_all_or_nothing import _metas  # noqa: E402  (metadata of new keys)

pytestmark = pytest.mark.requires("verl")

#: how long a test waits for Ray to report a killed client (a hang fails the test instead of blocking it)
WAIT_S = 120.0


# -- 1. a killed client's claim stays with the part it stored ---------------------------------------------------
@pytest.mark.slow
def test_a_client_killed_after_a_commit_leaves_unit_0s_claim_with_the_stored_part(tq_session: Any) -> None:
    """A client process (a Ray actor) puts a new float32 field over two units: its first commit (unit 1's) stores,
    then the process is killed (SIGKILL) before its other commit. Its message telling unit 0 to keep the claim is
    sent through a handle that delivers a call only when it is awaited: a schedule Ray allows, since it orders no
    calls to different actors. Unit 0 used to give the claim back once Ray reported the client dead, so a racing
    first put could claim the field as float64 while unit 1 holds it as float32; the claim must stay. The dead put
    is invisible to readers: TransferQueue's controller lists no field of it."""
    import ray
    import transfer_queue as tq
    import verl  # noqa: F401  (verl loads its plugins: conduit-verl registers the "Conduit" backend)
    from conduit import SchemaError

    tq_session("Conduit", num_units=2, capacity=2, mean_length=2)
    client = tq.get_client()
    unit0, unit1 = client.storage_manager.units
    created = _metas(client, "dead", ["k0", "k1"])
    unit_of = {int(g) % 2: key for key, g in zip(["k0", "k1"], created.global_indexes, strict=True)}
    first, second = unit_of[1], unit_of[0]
    meta = _metas(client, "dead", [first, second])  # the first sample routes to unit 1: its commit is sent first
    gis = [int(g) for g in meta.global_indexes]
    assert [g % 2 for g in gis] == [1, 0], f"keys not routed to units 1 then 0: {gis}"

    @ray.remote(num_cpus=0)
    class Putter:
        def put(self, meta: Any) -> None:
            """``put_data`` of two float32 rows, killed right after its first commit stored (runs in another
            process: no test helpers)."""
            import asyncio
            import os
            import signal

            import ray as r
            import torch as t
            import transfer_queue as here
            import verl as plugins  # noqa: F401  (registers the "Conduit" backend in this process)
            from tensordict import TensorDict as TD

            class Method:
                """A unit method: ``keep`` is delivered only when awaited, the first ``commit`` kills this process
                once it ran."""

                def __init__(self, real: Any, name: str) -> None:
                    self.real, self.name = real, name

                def remote(self, *args: Any) -> Any:
                    if self.name == "commit":
                        r.get(self.real.remote(*args))  # the unit stored its part
                        os.kill(os.getpid(), signal.SIGKILL)
                    if self.name == "keep":
                        async def when_awaited() -> Any:
                            return await self.real.remote(*args)

                        return when_awaited()
                    return self.real.remote(*args)

            class Handle:
                def __init__(self, real: Any) -> None:
                    self.real = real

                def __getattr__(self, name: str) -> Any:
                    return Method(getattr(self.real, name), name)

            here.init()  # attaches to the running TransferQueue
            manager = here.get_client().storage_manager
            manager.units = [Handle(u) for u in manager.units]
            asyncio.run(manager.put_data(TD({"f": t.ones(2, 2)}, batch_size=[2]), meta))

    putter = Putter.remote()  # type: ignore[attr-defined]  # (ray.remote wraps the class)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(putter.put.remote(meta), timeout=WAIT_S)
    assert ray.get(unit1.get.remote([gis[0]], ["f"]))["f"], "the killed client's first commit did not store"

    deadline = time.monotonic() + WAIT_S
    while ray.get(unit0.stats.remote())["prepared_puts"]:  # unit 0 drops the dead put's part once Ray reports it
        assert time.monotonic() < deadline, "unit 0 never saw the killed client's lease lost"
        time.sleep(0.5)
        ray.get(unit0.put.remote([], {}))  # (a put of nothing: unit 0 looks at the leases of prepared parts)
    with pytest.raises(ray.exceptions.RayTaskError) as refused:
        ray.get(unit0.claim.remote({"f": ("float64", 1)}))
    assert isinstance(refused.value.cause, SchemaError) and "float32" in str(refused.value.cause), refused.value
    assert "f" not in client.kv_retrieve_meta(keys=[first, second], partition_id="dead").field_names


# -- 2. padded shapes of jagged minibatch columns are verl's -----------------------------------------------------
def _shard(n: int = 8) -> TensorDict:
    g = torch.Generator().manual_seed(3)
    lengths = [int(x) for x in torch.randint(1, 7, (n,), generator=g)]
    return TensorDict({
        "input_ids": torch.nested.as_nested_tensor([torch.arange(k) + i for i, k in enumerate(lengths)],
                                                   layout=torch.jagged),
        "topk": torch.nested.as_nested_tensor([torch.randn(k, 3, generator=g) for k in lengths], layout=torch.jagged),
        "advantages": torch.randn(n, generator=g),
        "uid": NonTensorStack(*[f"u{i}" for i in range(n)]),
    }, batch_size=[n])


def _shapes(td: TensorDict) -> dict[str, Any]:
    """Each jagged column's padded shape, cached row lengths and padded values."""
    out: dict[str, Any] = {}
    for key in ("input_ids", "topk"):
        v = td.get(key)
        padded = v.to_padded_tensor(0)
        out[key] = (tuple(padded.shape), sorted(v._metadata_cache), padded.tolist(),
                    tuple(td.select(key).to_padded_tensor()[key].shape))
    return out


@pytest.mark.parametrize("mode", ["sync", "prefetch"])
def test_jagged_columns_pad_to_verls_shapes(mode: str) -> None:
    """A ``(rows, 3)`` jagged column beside a 1-D one: every minibatch's padded shapes (tensor and TensorDict
    ``to_padded_tensor``), cached row lengths and values equal verl's iterator's. The ``(rows, 3)`` column used to pad
    to its longest row where verl's pads to the minibatch's total length."""
    import verl.utils.tensordict_utils as tu
    from conduit_verl import delivery

    delivery.install()
    td = _shard()
    kw = {"shuffle": True}
    ref = [_shapes(m) for m in delivery._verl_iterator()(td, 4, 2, seed=5, dataloader_kwargs=kw)]
    with delivery.forced(mode):  # type: ignore[arg-type]
        got = [_shapes(m) for m in tu.make_iterator(td, 4, 2, seed=5, dataloader_kwargs=kw)]
    assert len(got) == len(ref) == 4
    for k, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert g == r, f"minibatch {k}: padded shapes {({c: v[0] for c, v in g.items()})}, verl's " \
                       f"{({c: v[0] for c, v in r.items()})}"
