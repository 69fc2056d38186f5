"""Checkpoints are portable: saved under one scheduler, placement or tier, loaded under another.

``state_dict()``/``load_state_dict()`` round-trip a buffer exactly, sampler RNG included, through
``torch.save``/``torch.load`` with its default ``weights_only=True``. After a load, the next deliveries
(batches and their SampleInfo) are what the saved buffer would deliver next under ``Synchronous``: a batch
a prefetching scheduler drew ahead but had not delivered is drawn again, neither skipped nor delivered
twice. A damaged checkpoint is refused with a typed error and leaves the target buffer unchanged.
"""

from __future__ import annotations

import copy
import io
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from conduit import (
    Automatic,
    ConfigurationError,
    ExperienceDataPlane,
    OnPolicy,
    Overlapped,
    PrioritizedSampler,
    Replay,
    Synchronous,
)
from conduit.placement import AdaptivePlacement, DiskPlacement, HostPlacement, PlacementSpec, Workload
from conduit.placement.placement_map import MapRange, PlacementMap
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch

SCHEDULERS: dict[str, Callable[[], Any]] = {
    "sync": Synchronous,
    "sequential-chunks": lambda: Overlapped(g_del=2, overlap=False),
    "overlapped": lambda: Overlapped(g_del=1),
    "overlapped-chunks": lambda: Overlapped(g_del=3, g_ing=2),
    "automatic": Automatic,
    # on-policy: one minibatch per delivery; ingestion stored a half rollout per write in the background
    "sequential": lambda: Overlapped(overlap=False),
    "overlapped-parts": lambda: Overlapped(g_ing=0.5),
}


def _through_file(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` after ``torch.save`` and ``torch.load`` with its default ``weights_only=True``."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _replay(sched: str, *, prioritized: bool, capacity: int = 128, placement: Any = None) -> ExperienceDataPlane:
    sampler = PrioritizedSampler(alpha=0.7, beta=0.5) if prioritized else None
    return ExperienceDataPlane(ID_SCHEMA, capacity=capacity, semantics=Replay(sampler, seed=3),
                               scheduler=SCHEDULERS[sched](), placement=placement)


def _draw(edp: ExperienceDataPlane, n: int = 8) -> tuple[list[int], list[int], np.ndarray | None]:
    batch, info = edp.deliver(n)
    ids = check_payload(batch).tolist()
    w = None if info.weights is None else info.weights.numpy().copy()
    return ids, info.handles.tolist(), w


def _same_draws(got: list[Any], want: list[Any], what: str) -> None:
    for k, ((ids, h, w), (ids2, h2, w2)) in enumerate(zip(got, want, strict=True)):
        assert (ids, h) == (ids2, h2), f"{what}: delivery {k} after the checkpoint drew items {ids}, expected {ids2}"
        if w2 is not None:
            assert w is not None, f"{what}: delivery {k} has no importance weights"
            np.testing.assert_allclose(w, w2, rtol=1e-5, err_msg=f"{what}: delivery {k}'s weights differ")


# -- replay: draws prepared ahead are given back, not skipped -----------------------------------------------------
#: deliveries before the checkpoint, so that a drawn batch waits undelivered when it is taken (sequential chunks of
#: 2: the third delivery draws the fourth; Automatic's probe draws the third with the second)
_DELIVERED_BEFORE = {"sequential-chunks": 3, "overlapped": 2, "overlapped-chunks": 2, "automatic": 2}


@pytest.mark.parametrize("prioritized", [False, True], ids=["uniform", "prioritized"])
@pytest.mark.parametrize("saved_under", list(_DELIVERED_BEFORE))
def test_a_checkpoint_taken_with_prefetched_replay_draws_continues_the_synchronous_draws(
        saved_under: str, prioritized: bool) -> None:
    def run_until_checkpoint(edp: ExperienceDataPlane) -> list[Any]:
        edp.ingest(id_batch(np.arange(100)))
        edp.flush()
        before = [_draw(edp) for _ in range(_DELIVERED_BEFORE[saved_under])]
        if prioritized:  # after the prefetch of the next batch: a synchronous buffer draws with these
            edp.update_priorities(torch.tensor(before[-1][1]), torch.arange(1.0, 9.0, dtype=torch.float64))
        return before

    reference = _replay("sync", prioritized=prioritized)
    expected_before = run_until_checkpoint(reference)
    expected = [_draw(reference) for _ in range(3)]
    saved = _replay(saved_under, prioritized=prioritized)
    _same_draws(run_until_checkpoint(saved), expected_before, f"{saved_under} before the checkpoint")
    state = _through_file(saved.state_dict())
    for target in ("sync", "overlapped-chunks", "automatic"):
        loaded = _replay(target, prioritized=prioritized)
        loaded.load_state_dict(state)
        _same_draws([_draw(loaded) for _ in range(3)], expected,
                    f"saved under {saved_under}, loaded under {target} (a prefetched draw was skipped)")
        loaded.close()
    _same_draws([_draw(saved) for _ in range(2)], expected[:2],
                f"the {saved_under} buffer itself after its checkpoint (taking it skipped a prefetched draw)")
    saved.close()


# -- on-policy: mid-epoch, a sealed rollout waiting, an open one filling, a stale one -----------------------------
def _on_policy(sched: str, capacity: int = 256, placement: Any = None) -> ExperienceDataPlane:
    sem = OnPolicy(num_minibatches=3, num_epochs=2, max_staleness=1, seed=5)
    return ExperienceDataPlane(ID_SCHEMA, capacity=capacity, semantics=sem, scheduler=SCHEDULERS[sched](),
                               placement=placement)


def _minibatch(edp: ExperienceDataPlane) -> tuple[Any, ...]:
    batch, i = edp.deliver()
    return (check_payload(batch).tolist(), i.handles.tolist(), i.version, i.epoch, i.minibatch, i.num_minibatches,
            i.staleness, i.last)


def _fill_on_policy(edp: ExperienceDataPlane) -> None:
    for v in range(3):
        for part in range(2):
            edp.ingest(id_batch(np.arange(100 * v + 15 * part, 100 * v + 15 * part + 15)), version=v)
        edp.seal()
    edp.ingest(id_batch(np.arange(300, 310)), version=3)  # the open rollout, filling


@pytest.mark.parametrize("saved_under", ["sync", "sequential", "overlapped", "overlapped-parts", "automatic"])
def test_an_on_policy_checkpoint_mid_epoch_continues_under_every_scheduler(saved_under: str) -> None:
    reference = _on_policy("sync")
    _fill_on_policy(reference)
    expected_before = [_minibatch(reference) for _ in range(4)]  # mid-way through epoch 2 of rollout 0
    reference.set_policy_version(2)  # rollout 0 is now stale: the next delivery drops it
    expected = [_minibatch(reference) for _ in range(6)]
    saved = _on_policy(saved_under)
    _fill_on_policy(saved)
    assert [_minibatch(saved) for _ in range(4)] == expected_before
    saved.set_policy_version(2)
    state = _through_file(saved.state_dict())
    for target in ("sync", "overlapped-parts", "automatic"):
        loaded = _on_policy(target)
        loaded.load_state_dict(state)
        got = [_minibatch(loaded) for _ in range(6)]
        assert got == expected, f"saved under {saved_under}, loaded under {target}: deliveries differ"
        loaded.ingest(id_batch(np.arange(310, 315)), version=3)  # joins the open rollout of the checkpoint
        loaded.seal()
        sealed = loaded.state_dict()["semantics"]["sealed"]
        assert list(sealed[-1]) == [3, 90, 15], f"the open rollout did not keep filling after the load: {sealed}"
        loaded.close()
    assert [_minibatch(saved) for _ in range(6)] == expected, "the saved buffer changed course after its checkpoint"
    saved.close()


# -- placements and tiers, capacity ---------------------------------------------------------------------------------
def _adaptive(boundary: float, directory: Any) -> AdaptivePlacement:
    """An AdaptivePlacement whose map puts ID_SCHEMA's 20 B items on the host below ``boundary`` B, else on disk
    (planned for 256 items: the replay buffers of 128 and the on-policy ones of 256)."""
    workload = Workload.from_schema(ID_SCHEMA, capacity=256, batch=8)
    ranges = [MapRange(1.0, boundary, PlacementSpec("host", ("cpu",))),
              MapRange(boundary, float("inf"), PlacementSpec("disk", ("disk",)))]
    return AdaptivePlacement(PlacementMap(ranges, workload, "test", max_item_bytes=10_000), directory=directory)


@pytest.mark.parametrize("route", [("disk", "host"), ("host", "disk"), ("disk", "disk"), ("host", "adaptive-disk"),
                                   ("adaptive-disk", "adaptive-host"), ("adaptive-host", "disk")])
def test_a_checkpoint_moves_between_host_disk_and_adaptive_placements_exactly(route: tuple[str, str],
                                                                               tmp_path: Any) -> None:
    def placement(tier: str) -> Any:
        if tier.startswith("adaptive"):
            return _adaptive(100.0 if tier.endswith("host") else 10.0, tmp_path)
        return DiskPlacement(directory=tmp_path) if tier == "disk" else HostPlacement()

    src = _replay("sync", prioritized=True, placement=placement(route[0]))
    for start in (0, 100):  # wraps the ring of 128
        src.ingest(id_batch(np.arange(start, start + 100)))
    _, h, _ = _draw(src)
    src.update_priorities(torch.tensor(h), torch.arange(1.0, 9.0, dtype=torch.float64))
    state = _through_file(src.state_dict())
    dst = _replay("overlapped", prioritized=True, placement=placement(route[1]))
    dst.load_state_dict(state)
    assert dst.storage.tier == route[1].split("-")[-1]
    _same_draws([_draw(dst) for _ in range(3)], [_draw(src) for _ in range(3)], f"{route[0]} -> {route[1]}")
    dst.close()

    onp = _on_policy("sync", placement=placement(route[0]))
    _fill_on_policy(onp)
    _minibatch(onp)
    state = _through_file(onp.state_dict())
    other = _on_policy("overlapped", placement=placement(route[1]))
    other.load_state_dict(state)
    assert [_minibatch(other) for _ in range(5)] == [_minibatch(onp) for _ in range(5)]
    other.close()


@pytest.mark.parametrize("prioritized", [False, True], ids=["uniform", "prioritized"])
def test_a_checkpoint_of_another_capacity_is_refused_typed_and_changes_nothing(prioritized: bool) -> None:
    src = _replay("sync", prioritized=prioritized, capacity=128)
    src.ingest(id_batch(np.arange(100)))
    state = _through_file(src.state_dict())
    for capacity in (64, 256):
        dst = _replay("overlapped-chunks", prioritized=prioritized, capacity=capacity)
        dst.ingest(id_batch(np.arange(1000, 1040)))
        dst.flush()
        _assert_refused(dst, state, "capacity", f"a refused load into capacity {capacity}")
        dst.close()


# -- a consistent cut under concurrent producers ---------------------------------------------------------------------
@pytest.mark.parametrize("sched", ["sync", "overlapped-chunks", "sequential-chunks"])
def test_a_checkpoint_taken_while_producers_ingest_holds_each_item_once_in_order(sched: str) -> None:
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=10_000, semantics=Replay(seed=1), scheduler=SCHEDULERS[sched]())
    producers, calls, rows = 3, 150, 5
    started = threading.Barrier(producers + 1)

    def produce(p: int) -> None:
        started.wait()
        for i in range(calls):
            edp.ingest(id_batch(np.arange(rows) + rows * i + 100_000 * p))

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    for t in threads:
        t.start()
    started.wait()
    cuts = []
    while any(t.is_alive() for t in threads) or not cuts:
        cuts.append(_through_file(edp.state_dict()))
    for t in threads:
        t.join()
    cuts.append(_through_file(edp.state_dict()))
    for c, state in enumerate(cuts):
        ids = state["storage"]["data"]["id"].numpy()
        assert len(np.unique(ids)) == len(ids), f"checkpoint {c} holds an item twice"
        for p in range(producers):
            mine = ids[(ids >= 100_000 * p) & (ids < 100_000 * (p + 1))] - 100_000 * p
            assert np.array_equal(mine, np.arange(len(mine))), (
                f"checkpoint {c} holds producer {p}'s items {mine[:10].tolist()}..., not a prefix of what it ingested")
        loaded = ExperienceDataPlane(ID_SCHEMA, capacity=10_000, semantics=Replay(seed=1), scheduler=Overlapped())
        loaded.load_state_dict(state)
        assert len(loaded) == len(ids)
        loaded.close()
    assert len(cuts[-1]["storage"]["data"]["id"]) == producers * calls * rows, "the last checkpoint misses items"
    edp.close()


# -- damaged checkpoints: refused, typed, the target unchanged -------------------------------------------------------
def _assert_same_state(after: dict[str, Any], before: dict[str, Any], what: str) -> None:
    def flat(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ("tensor", x.dtype, tuple(x.shape), x.tolist())
        if isinstance(x, dict):
            return {k: flat(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [flat(v) for v in x]
        return x
    assert flat(after) == flat(before), f"{what} changed the buffer"


def _assert_refused(dst: ExperienceDataPlane, state: dict[str, Any], match: str, what: str) -> None:
    """Loading ``state`` into ``dst`` raises ConfigurationError (``match``) and changes nothing."""
    before = dst.state_dict()
    with pytest.raises(ConfigurationError, match=match):
        dst.load_state_dict(state)
    _assert_same_state(dst.state_dict(), before, what)


def _on_policy_checkpoint() -> dict[str, Any]:
    src = _on_policy("sync")
    _fill_on_policy(src)
    _minibatch(src)  # rollout 0 (handles 0..29) is being delivered: epoch 0, minibatch 1 next
    return src.state_dict()


def _sem(s: dict[str, Any]) -> dict[str, Any]:
    return s["semantics"]


ON_POLICY_DAMAGE: dict[str, Callable[[dict[str, Any]], None]] = {
    "sealed rollout beyond the live handles": lambda s: _sem(s).__setitem__("sealed", [(1, 500, 30)]),
    "sealed rollout of no items": lambda s: _sem(s).__setitem__("sealed", [(1, 30, 0)]),
    "open rollout past the newest item": lambda s: _sem(s).__setitem__("open", (3, 90, 50)),
    "current rollout longer than its order": lambda s: _sem(s).__setitem__("cur", (0, 0, 90)),
    "order of another length": lambda s: _sem(s).__setitem__("perm", _sem(s)["perm"][:5]),
    "order of float dtype": lambda s: _sem(s).__setitem__("perm", _sem(s)["perm"].float()),
    "order that repeats an item": lambda s: _sem(s).__setitem__("perm", torch.zeros(30, dtype=torch.int64)),
    "minibatch index past the cuts": lambda s: _sem(s).__setitem__("k", 7),
    "negative minibatch index": lambda s: _sem(s).__setitem__("k", -1),
    "negative epoch": lambda s: _sem(s).__setitem__("epoch", -1),
    "minibatch index at the end of the cuts": lambda s: _sem(s).__setitem__("k", 3),
    "cuts past the rollout": lambda s: _sem(s).__setitem__("bounds", [0, 100]),
    "finished rollout end past the newest item": lambda s: _sem(s).__setitem__("finished_end", 10**6),
}


@pytest.mark.parametrize("damage", list(ON_POLICY_DAMAGE))
@pytest.mark.parametrize("target", ["sync", "overlapped"])
def test_a_damaged_on_policy_checkpoint_is_refused_typed_and_changes_nothing(damage: str, target: str) -> None:
    state = copy.deepcopy(_on_policy_checkpoint())
    ON_POLICY_DAMAGE[damage](state)
    state = _through_file(state)
    dst = _on_policy(target)
    dst.ingest(id_batch(np.arange(1000, 1012)), version=0)
    dst.seal()
    dst.flush()
    _assert_refused(dst, state, "checkpoint", f"a refused load ({damage})")
    assert len(_minibatch(dst)[0]) == 4, "the target does not deliver its own rollout after the refused load"
    dst.close()


def _prioritized_checkpoint() -> dict[str, Any]:
    src = _replay("sync", prioritized=True)
    src.ingest(id_batch(np.arange(100)))  # slots 100..127 hold no item
    return src.state_dict()


def _leaves(s: dict[str, Any]) -> torch.Tensor:
    return s["semantics"]["sampler"]["leaves"]


PRIORITY_DAMAGE: dict[str, Callable[[dict[str, Any]], None]] = {
    "float32 priorities": lambda s: s["semantics"]["sampler"].__setitem__("leaves", _leaves(s).float()),
    "a priority on an empty slot": lambda s: _leaves(s).__setitem__(120, 5.0),
    "fewer priorities than slots": lambda s: s["semantics"]["sampler"].__setitem__("leaves", _leaves(s)[:5]),
    "item of another dtype": lambda s: s["storage"]["data"].__setitem__("id", s["storage"]["data"]["id"].float()),
    "item of another shape": lambda s: s["storage"]["data"].__setitem__("obs", s["storage"]["data"]["obs"][:, :2]),
    "a handle range past the capacity": lambda s: s["storage"].__setitem__("next", 10**6),
    "a float handle": lambda s: s["storage"].__setitem__("oldest", 0.0),
    "no RNG state": lambda s: s["semantics"]["sampler"].pop("rng"),
    "no storage data": lambda s: s["storage"].pop("data"),
}


@pytest.mark.parametrize("damage", list(PRIORITY_DAMAGE))
def test_a_damaged_prioritized_checkpoint_is_refused_typed_and_changes_nothing(damage: str) -> None:
    state = copy.deepcopy(_prioritized_checkpoint())
    PRIORITY_DAMAGE[damage](state)
    state = _through_file(state)
    dst = _replay("overlapped-chunks", prioritized=True)
    dst.ingest(id_batch(np.arange(1000, 1020)))
    dst.flush()
    _assert_refused(dst, state, "checkpoint", f"a refused load ({damage})")
    ids, _, _ = _draw(dst)
    assert all(1000 <= i < 1020 for i in ids), f"the target drew {ids} after the refused load"
    dst.close()
