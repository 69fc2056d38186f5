"""conduit-verl's delivery and replay side: packing edge cases, minibatch iteration against
verl's own iterator (uneven sequence lengths, empty and length-1 rows, epochs, seeds, dp ranks)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

pytestmark = pytest.mark.requires("verl")


def _rows(v: Any) -> list[Any]:
    """A column's samples as plain lists (tensors, nested tensors and NonTensorStacks alike)."""
    items = v.unbind() if isinstance(v, torch.Tensor) else v.tolist()
    return [x.tolist() if isinstance(x, torch.Tensor) else x for x in items]


def test_samples_of_rank_zero_beside_higher_ranks_read_back_as_simple_storage_returns_them() -> None:
    """A field keeps its first put's rank limit and pads lower-rank samples, so one read can hold scalars beside
    vectors; rebuilding them used to call ``view()`` with no shape (a raw TypeError). SimpleStorage returns such a
    column as a NonTensorStack of the samples."""
    from conduit_verl.packing import concat_rows, pack_column, unpack_column
    from transfer_queue.storage.managers.simple_storage_manager import AsyncSimpleStorageManager

    col = concat_rows([pack_column(torch.ones(1, 2), 1), pack_column(torch.tensor([3.0, 4.0]), 2)])
    got = unpack_column(col)
    want = AsyncSimpleStorageManager._pack_field_values([torch.ones(2), torch.tensor(3.0), torch.tensor(4.0)])
    assert type(got) is type(want), f"got a {type(got).__name__}, SimpleStorage returns a {type(want).__name__}"
    assert _rows(got) == _rows(want) == [[1.0, 1.0], 3.0, 4.0]


def test_a_jagged_column_of_another_length_than_the_batch_is_refused() -> None:
    """``pack_column`` checks that a column has ``n`` samples; a jagged one of fewer components used to come back
    as a column whose shape rows claim ``n`` samples while its lengths hold fewer (a corrupt column)."""
    from conduit_verl.packing import pack_column

    nt = torch.nested.as_nested_tensor([torch.ones(1), torch.ones(3)], layout=torch.jagged)
    with pytest.raises(ValueError, match="3 samples has 2 components"):
        pack_column(nt, 3, "x")
    with pytest.raises(ValueError, match="2 samples has 1 components"):  # was silently broadcast to 2 shape rows
        pack_column(torch.nested.as_nested_tensor([torch.ones(3)], layout=torch.jagged), 2, "x")
    ok = pack_column(nt, 2, "x")
    assert not isinstance(ok, list) and ok.lengths.tolist() == [1, 3] and ok.shapes[:, 1].tolist() == [1, 3]


def _shard(lens: list[int]) -> TensorDict:
    n = len(lens)
    g = torch.Generator().manual_seed(0)
    return TensorDict({
        "input_ids": torch.nested.as_nested_tensor([torch.randint(0, 100, (k,), generator=g) for k in lens],
                                                   layout=torch.jagged),
        "hidden": torch.nested.as_nested_tensor([torch.randn(k, 3, generator=g) for k in lens], layout=torch.jagged),
        "advantages": torch.randn(n, generator=g),
        "rows": torch.arange(n * 2, dtype=torch.float32).reshape(n, 2),
        "uid": NonTensorStack(*[f"u{i}" for i in range(n)]),
        "temperature": NonTensorData(0.7),
    }, batch_size=[n])


def _as_lists(td: TensorDict) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in td.keys():
        v = td.get(k)
        out[k] = v.data if isinstance(v, NonTensorData) else _rows(v) if isinstance(v, NonTensorStack) or (
            isinstance(v, torch.Tensor) and v.is_nested) else v.tolist()
    return out


_LENS = {"mixed": [0, 1, 5, 0, 2, 1, 8, 8], "all-empty": [0] * 8, "all-one": [1] * 8}
_SEEDS = {"rank0": 0, "rank3": 3, "unseeded": None}
#: every pair of (mode, lens, seed) values, in 9 cases rather than all 18 triples: the mode picks the loader,
#: the lengths the packing, the seed the order; each pair meets in some case (the mode alternates over the grid)
_PAIRWISE = [pytest.param(mode, _LENS[ln], _SEEDS[sd], id=f"{sd}-{ln}-{mode}")
             for i, ln in enumerate(_LENS) for j, sd in enumerate(_SEEDS)
             for mode in [("sync", "prefetch")[(i + j) % 2]]]


@pytest.mark.parametrize(("mode", "lens", "seed"), _PAIRWISE)
def test_every_minibatch_size_and_epoch_count_matches_verls_iterator(mode: str, lens: list[int],
                                                                     seed: int | None) -> None:
    """Row for row against verl's own iterator on the same TensorDict, for minibatches of 1 row up to the whole
    shard, 1 and 3 epochs, shuffled or not, seeded as verl seeds dp ranks (``seed + rank``) or from the global RNG
    (which both must leave in the same state, training drawing from it between minibatches)."""
    import verl.utils.tensordict_utils as tu
    from conduit_verl import delivery

    delivery.install()
    td = _shard(lens)
    for mb in (1, 2, 4, 8):
        for epochs in (1, 3):
            for shuffle in (False, True):
                kw = {"shuffle": shuffle}
                runs = []
                for make in (delivery._verl_iterator(), tu.make_iterator):
                    torch.manual_seed(5)
                    with delivery.forced(mode):  # type: ignore[arg-type]
                        got = []
                        for m in make(td, mb, epochs, seed=seed, dataloader_kwargs=kw):
                            got.append(_as_lists(m))
                            torch.rand(2)  # training draws from the global RNG between minibatches
                    runs.append((got, torch.get_rng_state()))
                (ref, ref_rng), (got, got_rng) = runs
                where = f"mini_batch_size={mb}, epochs={epochs}, shuffle={shuffle}"
                assert len(got) == len(ref) == epochs * 8 // mb, where
                assert got == ref, f"{where}: Conduit's minibatches differ from verl's"
                assert torch.equal(got_rng, ref_rng), f"{where}: the global RNG ends elsewhere than verl's"


def test_a_loader_state_past_the_saved_epoch_is_refused_not_replayed() -> None:
    """A checkpoint's ``orders_drawn`` is replayed pass by pass on load; a damaged, huge count used to be replayed
    (a load that spins through that many DataLoader passes: a hang) and then served a pass the saved buffer never
    would. Seeded progress at epoch ``e`` has drawn ``e + 1`` passes; more than one beyond that is refused."""
    import numpy as np
    from conduit import ConfigurationError, ExperienceDataPlane
    from conduit.testing.reference import ID_SCHEMA, id_batch
    from conduit_verl.delivery import VerlOnPolicy

    def buffer() -> ExperienceDataPlane:
        sem = VerlOnPolicy(num_minibatches=2, num_epochs=3, seed=7, dataloader_kwargs={"shuffle": True})
        return ExperienceDataPlane(ID_SCHEMA, capacity=16, semantics=sem)

    edp = buffer()
    edp.ingest(id_batch(np.arange(10)), version=0)
    edp.seal()
    for _ in range(3):
        edp.deliver()
    state = edp.state_dict()
    assert state["semantics"]["orders_drawn"] == state["semantics"]["epoch"] + 1 == 2
    target = buffer()
    with pytest.raises(ConfigurationError, match="loader state"):
        target.load_state_dict({**state, "semantics": {**state["semantics"], "orders_drawn": 20_000}})
    assert len(target) == 0, "a refused checkpoint changed the buffer"
    target.load_state_dict(state)
    assert [target.deliver()[0]["id"].tolist() for _ in range(3)] == [edp.deliver()[0]["id"].tolist()
                                                                      for _ in range(3)]


def _scalar_after_vector(start: Any, backend: str, **cfg: Any) -> list[Any]:
    """Put field ``f`` as a vector (key ``a``), then as a scalar (key ``b``); read both back as plain lists."""
    import transfer_queue as tq
    import verl  # noqa: F401  (verl loads its plugins: conduit-verl registers the "Conduit" backend)

    start(backend, **cfg)
    try:
        tq.kv_batch_put(keys=["a"], partition_id="train", fields=TensorDict({"f": torch.tensor([[1.0, 2.0]])},
                                                                            batch_size=[1]), tags=[{}])
        tq.kv_batch_put(keys=["b"], partition_id="train", fields=TensorDict({"f": torch.tensor([3.0])},
                                                                            batch_size=[1]), tags=[{}])
        got = tq.kv_batch_get(keys=["a", "b"], partition_id="train", select_fields=["f"]).get("f")
        return [type(got).__name__, _rows(got)]
    finally:
        tq.close()


@pytest.mark.slow
def test_a_scalar_put_after_a_vector_put_reads_back_like_simple_storage(tq_session: Any) -> None:
    """Through the TransferQueue backend: a rank-0 put into a field whose first put had rank 1 is accepted (padded)
    and its read used to fail with a raw TypeError from ``view()``."""
    want = _scalar_after_vector(tq_session, "SimpleStorage")
    got = _scalar_after_vector(tq_session, "Conduit", num_units=1, capacity=4, mean_length=2)
    assert got == want == ["NonTensorStack", [[1.0, 2.0], 3.0]], f"Conduit returned {got}, SimpleStorage {want}"
