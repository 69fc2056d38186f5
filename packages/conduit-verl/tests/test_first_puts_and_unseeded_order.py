"""Two gaps of the verl adapter, closed.

* Racing *first* puts of one field in different kinds, dtypes or ranks, from two puts whose checks pass before
  either stores (two clients, or one client's concurrent puts): each unit checked only what was held, so both were
  stored on different units and only a later get reported the mismatch. Unit 0 (whose calls Ray serialises) now
  claims each field's kind before any unit stores it: the second put in another kind or dtype is refused, typed,
  and stores nothing. Of two puts in different ranks the second is refused only when it brings the higher rank; a
  lower-rank one after a higher-rank claim is stored, padded to the claimed rank limit (as on one unit). Which claim
  unit 0 answers first is not fixed (two units' replies), so either outcome is legal: both orders are checked.
* ``seed=None``: verl's loader draws an epoch's order from torch's global RNG when the consumer asks for the
  epoch's first minibatch; Conduit drew it when the previous epoch's last minibatch was selected (before that
  minibatch trained; with prefetch, in a background thread), so the order and the global RNG stream differed.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

sys.path.insert(0, str(Path(__file__).parent))
from test_put_all_or_nothing import _Gate, _gated, _key_on_unit, _Put, _reach, _state  # noqa: E402, I001  (forced interleavings)

pytestmark = pytest.mark.requires("verl")


# -- seed=None: the epoch order is drawn when verl's loader draws it ---------------------------------
def _rows(n: int = 12) -> TensorDict:
    return TensorDict({"row": torch.arange(n, dtype=torch.float32).reshape(n, 1),
                       "ids": torch.nested.as_nested_tensor([torch.arange(i % 3 + 1) for i in range(n)],
                                                            layout=torch.jagged)}, batch_size=[n])


def _consume(it: Any) -> tuple[list[list[int]], list[float]]:
    """Each minibatch's rows, and what "training" draws from the global RNG after each (as dropout would)."""
    order, draws = [], []
    for mb in it:
        order.append([int(x) for x in mb["row"][:, 0].tolist()])
        draws.append(float(torch.rand(()).item()))
    return order, draws


@pytest.mark.parametrize("mode", ["sync", "prefetch"])
@pytest.mark.parametrize(("mini_batch", "shuffle"), [(4, True), (4, False), (12, True)],
                         ids=["3-per-epoch-shuffled", "3-per-epoch-in-order", "1-per-epoch-shuffled"])
def test_unseeded_epoch_orders_and_global_rng_match_verl(mode: str, mini_batch: int, shuffle: bool) -> None:
    """Same global seed, seed=None, training that draws from the global RNG between minibatches: Conduit's
    minibatches and the training's draws are verl's, epoch for epoch."""
    from conduit_verl import delivery

    delivery.install()
    td, kw = _rows(), {"shuffle": shuffle}
    torch.manual_seed(1234)
    ref = _consume(delivery._verl_iterator()(td, mini_batch, 3, seed=None, dataloader_kwargs=kw))
    after_ref = float(torch.rand(()).item())
    torch.manual_seed(1234)
    with delivery.forced(mode):  # type: ignore[arg-type]
        got = _consume(delivery.conduit_make_iterator(td, mini_batch, 3, seed=None, dataloader_kwargs=kw))
    after_got = float(torch.rand(()).item())
    assert got[0] == ref[0], f"minibatch rows differ from verl's with seed=None:\nconduit {got[0]}\nverl    {ref[0]}"
    assert got[1] == ref[1], "the training's global-RNG draws differ from verl's: Conduit drew at another moment"
    assert after_got == after_ref, "Conduit's iteration left the global RNG elsewhere than verl's"


def test_seeded_prefetch_still_stages_across_epochs() -> None:
    """With a seed (verl's practice) the order comes from the loader's own generator: prefetch keeps staging the
    next epoch's first minibatch while the previous epoch's last one trains."""
    from conduit_verl import delivery

    d = delivery.MinibatchDelivery(num_minibatches=3, epochs=2, seed=7, dataloader_kwargs={"shuffle": True},
                                   prefetch=True, device="cpu")
    try:
        d.ingest(_rows(), version=0)
        d.seal()
        n = sum(1 for _ in d.minibatches())
        assert n == 6
        assert d.scheduler.staged == 5, f"prefetch staged {d.scheduler.staged} of the 5 minibatches after the first"
    finally:
        d.close()


def test_a_stale_rollout_draws_no_deferred_epoch_order() -> None:
    """seed=None and a rollout gone stale between its epochs (the policy moved on, on_stale="raise"): the delivery is
    refused with StaleExperienceError and leaves the global RNG alone (no order is drawn for an epoch never
    delivered), and it is refused again, unchanged, on the next try."""
    from conduit import StaleExperienceError
    from conduit_verl import delivery

    d = delivery.MinibatchDelivery(num_minibatches=1, epochs=2, seed=None, dataloader_kwargs={"shuffle": True},
                                   on_stale="raise", prefetch=False, device="cpu")
    try:
        d.ingest(_rows(), version=0)
        d.seal()
        d.next_minibatch()  # epoch 0; epoch 1 starts on its own delivery
        d.semantics.policy_version = 1  # the policy moved on (set on the semantics: the delivery refuses mid-rollout)
        torch.manual_seed(5)
        for _ in range(2):
            with pytest.raises(StaleExperienceError):
                d.next_minibatch()
        drawn = float(torch.rand(()).item())
        torch.manual_seed(5)
        assert drawn == float(torch.rand(()).item()), "a refused stale delivery drew from the global RNG"
    finally:
        d.close()


# -- racing first puts ---------------------------------------------------------------------------------
def _row(value: Any, name: str = "f") -> TensorDict:
    return TensorDict({name: value}, batch_size=[1])


def _held(manager: Any, name: str) -> list[int]:
    out = []
    for s in manager.stats():
        out.append(s["fields"][name]["samples"] if name in s["fields"] else s["objects"].get(name, 0))
    return out


class TestRacingFirstPuts:
    """The cases share one TransferQueue over two units (``tq_shared``); each uses its own partition and field."""

    TQ_BACKEND = ("Conduit", {"num_units": 2, "capacity": 4, "mean_length": 2})

    @pytest.mark.slow
    @pytest.mark.parametrize(("first", "second", "match"), [
        (torch.tensor([1.5]), NonTensorStack("text"), "tensor"),
        (NonTensorStack("text"), torch.tensor([1.5]), "tensor"),
        (torch.tensor([1.5]), torch.tensor([7]), "float32"),
    ], ids=["tensor-vs-object", "object-vs-tensor", "other-dtype"])
    def test_racing_first_puts_of_a_field_in_two_kinds_store_only_one(self, tq_shared: Any, first: Any, second: Any,
                                                                      match: str) -> None:
        """Two first puts of field ``f`` in different kinds or dtypes, each to its own unit, whose checks both run
        before either stores (submitted together on one event loop): whichever comes second must be refused with a
        SchemaError and store nothing; the field is then held in one kind only and reads back whole."""
        import transfer_queue as tq
        import verl  # noqa: F401  (verl loads its plugins: conduit-verl registers the "Conduit" backend)
        from conduit import SchemaError

        part, f = tq_shared("race"), tq_shared("f")  # this test's partition and field
        client = tq.get_client()
        manager = client.storage_manager
        meta_a = client.kv_retrieve_meta(keys=["a"], partition_id=part, create=True)
        meta_b = client.kv_retrieve_meta(keys=["b"], partition_id=part, create=True)
        gis = [int(meta_a.global_indexes[0]), int(meta_b.global_indexes[0])]
        assert gis[0] % 2 != gis[1] % 2, f"the two samples should route to different units: {gis}"

        async def race() -> list[Any]:
            return await asyncio.gather(manager.put_data(_row(first, f), meta_a),
                                        manager.put_data(_row(second, f), meta_b), return_exceptions=True)

        results = asyncio.run(race())
        errors = [r for r in results if isinstance(r, BaseException)]
        assert len(errors) == 1, f"exactly one of two racing first puts in different kinds must be refused: {results}"
        assert isinstance(errors[0], SchemaError), f"refused untyped: {errors[0]!r}"
        assert match in str(errors[0]) and "another field name" in str(errors[0]), f"unhelpful message: {errors[0]}"
        held = _held(manager, f)
        assert sorted(held) == [0, 1], f"the refused put stored its sample anyway: samples per unit {held}"
        winner = 0 if results[0] is None else 1
        key, value = ("a", first) if winner == 0 else ("b", second)
        got = tq.kv_batch_get(keys=[key], partition_id=part, select_fields=[f])[f]
        want = value.tolist()
        assert (got.tolist() if isinstance(got, torch.Tensor) else list(got)) == want, f"read back {got}, put {want}"

    @pytest.mark.slow
    @pytest.mark.parametrize("order", ["raced", "lower-claimed-first", "higher-claimed-first"])
    def test_racing_first_puts_of_a_field_in_two_ranks_refuse_only_the_higher_after_the_lower(
            self, tq_shared: Any, tmp_path: Path, order: str) -> None:
        """Two first puts of field ``f``, a rank-0 sample to unit 0 and a rank-1 sample (``(2,)``) to unit 1, whose
        checks both pass before either stores. Unit 0 answers their claims in either order. Rank-1 claimed after
        rank 0: the rank-1 put is refused (SchemaError naming the rank) and stores nothing; only the rank-0 sample is
        held, unpadded. Rank 0 claimed after rank 1: both store, the rank-0 sample padded to the claimed shape-row
        width (as a lower-rank put into a held field is) so the field keeps one rank limit on every unit, and both
        read back as put. ``raced`` submits both together on one event loop and checks whichever order unit 0 saw;
        the others force the order: the first put is held right after unit 0 answered its claim, the second runs
        whole, then the first goes on."""
        import transfer_queue as tq
        from conduit import SchemaError

        part, f = tq_shared("rank"), tq_shared("f")  # this test's partition and field
        client = tq.get_client()
        manager = client.storage_manager
        (key_lo, meta_lo), (key_hi, meta_hi) = _key_on_unit(client, part, "lo", 0), _key_on_unit(client, part, "hi", 1)
        lo, hi = _row(torch.tensor([1.5]), f), _row(torch.tensor([[1.0, 2.0]]), f)

        if order == "raced":
            async def race() -> list[Any]:
                return await asyncio.gather(manager.put_data(lo, meta_lo), manager.put_data(hi, meta_hi),
                                            return_exceptions=True)

            lo_error, hi_error = asyncio.run(race())
        else:
            lo_first = order == "lower-claimed-first"
            with _gated(manager) as gates:
                first = _Put(manager, *((lo, meta_lo) if lo_first else (hi, meta_hi)), gates, _Gate(after=True),
                             methods=("claim",))
                _reach(first)  # unit 0 answered the first put's claim; it waits before storing
                second = _Put(manager, *((hi, meta_hi) if lo_first else (lo, meta_lo)), gates)
                second.start()
                second_error = second.finish()
                assert first.gate is not None
                first.gate.open()
                first_error = first.finish()
            lo_error, hi_error = (first_error, second_error) if lo_first else (second_error, first_error)

        assert lo_error is None, f"the rank-0 put was refused ({order}): {lo_error!r}"
        g_lo, g_hi = int(meta_lo.global_indexes[0]), int(meta_hi.global_indexes[0])
        held = {rank: u["fields"].get(f) for rank, u in _state(manager, tmp_path).items()}
        if hi_error is not None:  # unit 0 claimed rank 0 first
            assert order != "higher-claimed-first", f"the rank-1 put, claimed first, was refused: {hi_error!r}"
            assert isinstance(hi_error, SchemaError), f"refused untyped: {hi_error!r}"
            assert "rank" in str(hi_error) and "another field name" in str(hi_error), f"unhelpful: {hi_error}"
            assert held == {0: {g_lo: ("float32", (0,), [1.5])}, 1: None}, \
                f"the refused rank-1 put stored something, or the rank-0 sample is not held as put: {held}"
            reads = {key_lo: [1.5]}
        else:  # unit 0 claimed rank 1 first
            assert order != "lower-claimed-first", "a rank-1 put after a rank-0 claim of its field was stored"
            assert held == {0: {g_lo: ("float32", (0, 0), [1.5])}, 1: {g_hi: ("float32", (1, 2), [1.0, 2.0])}}, \
                f"the rank-0 sample is not padded to the rank-1 claim's width, or a sample is not held as put: {held}"
            reads = {key_lo: [1.5], key_hi: [[1.0, 2.0]]}
        for key, want in reads.items():  # (by rows: a field of two ranks reads as nested, as in SimpleStorage)
            got = [r.tolist() for r in tq.kv_batch_get(keys=[key], partition_id=part, select_fields=[f])[f].unbind()]
            assert got == want, f"{key} read back {got}, put {want}"


@pytest.mark.slow
def test_a_refused_claim_claims_nothing_and_a_failed_put_gives_its_claims_back(tq_session: Any) -> None:
    """Unit 0's claim is check-and-set over all of a put's fields: one refused field claims none of the others. And
    of two racing puts to one full unit (both pass the checks, the second fails with CapacityError), the failed one
    gives back the field it alone claimed: that field is free for another kind, the winner's is not."""
    import ray
    import transfer_queue as tq
    import verl  # noqa: F401
    from conduit import CapacityError, SchemaError

    tq_session("Conduit", num_units=2, capacity=1, mean_length=2, max_items=1)
    client = tq.get_client()
    manager = client.storage_manager
    unit0 = manager.units[0]
    new, kinds = ray.get(unit0.claim.remote({"x": ("float32", 2)}))
    assert new == ["x"] and kinds == {"x": ("float32", 2)}
    with pytest.raises(ray.exceptions.RayTaskError) as err:
        ray.get(unit0.claim.remote({"y": (None, 0), "x": (None, 0)}))
    assert isinstance(err.value.cause, SchemaError), f"untyped refusal: {err.value!r}"
    new, kinds = ray.get(unit0.claim.remote({"y": ("int64", 3)}))
    assert new == ["y"], f"a refused claim claimed 'y' anyway: {kinds}"

    metas = []
    i = 0
    while len(metas) < 2:  # two samples routed to unit 0
        meta = client.kv_retrieve_meta(keys=[f"k{i}"], partition_id="cap", create=True)
        i += 1
        if int(meta.global_indexes[0]) % 2 == 0:
            metas.append(meta)
    puts = [TensorDict({"z": torch.tensor([1.0]), own: torch.tensor([2.0])}, batch_size=[1]) for own in ("na", "nb")]

    async def race() -> list[Any]:
        return await asyncio.gather(*[manager.put_data(td, m) for td, m in zip(puts, metas, strict=True)],
                                    return_exceptions=True)

    results = asyncio.run(race())
    assert [type(r) for r in results].count(CapacityError) == 1 and results.count(None) == 1, results
    lost, won = ("na", "nb") if results[0] is not None else ("nb", "na")
    tq.kv_batch_put(keys=["o1"], partition_id="cap", fields=_row(NonTensorStack("text")).rename_key_("f", lost),
                    tags=[{}])  # the failed put's claim was given back: accepted
    with pytest.raises(SchemaError, match="tensor"):
        tq.kv_batch_put(keys=["o2"], partition_id="cap", fields=_row(NonTensorStack("text")).rename_key_("f", won),
                        tags=[{}])
