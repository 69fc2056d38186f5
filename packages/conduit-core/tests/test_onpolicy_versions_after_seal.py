"""On-policy versions never go backwards, also after a rollout was sealed, delivered, dropped or checkpointed.

A rollout is sealed by ``seal()`` or by items of a newer version. A later batch of a LOWER version
than a sealed rollout's is refused (typed ``ConfigurationError``) and changes nothing, under every
scheduler; the same version is fine (it starts a new rollout after a seal).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conduit import (
    ConfigurationError,
    EmptyBufferError,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    OnPolicy,
    Overlapped,
    Synchronous,
)

SCHEMA = ExperienceSchema(x=Field((), torch.int64))
SCHEDULERS: dict[str, Callable[[], Any]] = {
    "sync": Synchronous,
    "sequential": lambda: Overlapped(overlap=False),
    "sequential-background-ingest": lambda: Overlapped(overlap=False, background_ingest=True),
    "overlapped": lambda: Overlapped(g_del=1),
}


def _items(start: int, n: int) -> dict[str, torch.Tensor]:
    return {"x": torch.arange(start, start + n)}


def _buffer(sched: str, *, capacity: int = 32, **kwargs: Any) -> ExperienceDataPlane:
    sem = OnPolicy(num_minibatches=2, num_epochs=2, seed=7, **kwargs)
    return ExperienceDataPlane(SCHEMA, capacity=capacity, semantics=sem, scheduler=SCHEDULERS[sched]())


def _same(a: Any, b: Any, where: str = "state") -> None:
    """Assert two state_dict()s are equal, tensors by value."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{where}: {a!r} != {b!r}"
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: tensors differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _drain(edp: ExperienceDataPlane) -> list[tuple[int, int, int, list[int]]]:
    """Every delivery left: (version, epoch, minibatch, items)."""
    out = []
    while True:
        try:
            batch, info = edp.deliver()
        except EmptyBufferError:
            return out
        out.append((info.version, info.epoch, info.minibatch, batch["x"].tolist()))


def _refused_unchanged(edp: ExperienceDataPlane, twin: ExperienceDataPlane, version: int, newer: int) -> None:
    """Ingesting ``version`` into ``edp`` is refused, naming both versions, and ``edp`` stays as ``twin``."""
    before = edp.state_dict()
    with pytest.raises(ConfigurationError, match="must not go backwards") as e:
        edp.ingest(_items(900, 3), version=version)
    assert str(version) in str(e.value) and str(newer) in str(e.value), (
        f"the refusal should name version {version} and version {newer}: {e.value}")
    _same(edp.state_dict(), before, "state after the refused ingest")
    _same(edp.state_dict(), twin.state_dict(), "state vs a buffer that never saw the refused batch")
    edp.seal()
    twin.seal()
    got, want = _drain(edp), _drain(twin)
    assert got == want, f"deliveries after the refused ingest differ:\n{got}\nexpected\n{want}"
    assert all(900 not in items for *_, items in got), f"the refused batch's items were delivered: {got}"


@pytest.mark.parametrize("sched", list(SCHEDULERS))
def test_a_lower_version_after_seal_is_refused_and_changes_nothing(sched: str) -> None:
    with _buffer(sched) as edp, _buffer(sched) as twin:
        for b in (edp, twin):
            b.ingest(_items(0, 4), version=5)
            b.seal()
        _refused_unchanged(edp, twin, 3, 5)


@pytest.mark.parametrize("sched", list(SCHEDULERS))
def test_an_empty_batch_of_a_newer_version_opens_no_rollout_under_every_scheduler(sched: str) -> None:
    """A batch of no items changes nothing, so the open rollout's version still rules: Synchronous took version 1
    after an empty version-2 batch, a queueing scheduler refused it while the empty batch waited in its queue."""
    with _buffer(sched) as edp:
        edp.ingest(_items(0, 2), version=1)
        edp.ingest(_items(0, 0), version=2)
        edp.ingest(_items(2, 2), version=1)
        edp.seal()
        got = _drain(edp)
    assert [(v, e, m) for v, e, m, _ in got] == [(1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)], got
    for epoch in (0, 1):
        assert sorted(x for _, e, _, items in got if e == epoch for x in items) == [0, 1, 2, 3], got


@pytest.mark.parametrize("sched", list(SCHEDULERS))
def test_a_version_between_two_sealed_ones_is_refused(sched: str) -> None:
    """Version 2 sealed by version 6's items, then version 6 sealed: 4 is above 2 but below 6."""
    with _buffer(sched) as edp, _buffer(sched) as twin:
        for b in (edp, twin):
            b.ingest(_items(0, 4), version=2)
            b.ingest(_items(10, 4), version=6)  # seals version 2
            b.seal()
        _refused_unchanged(edp, twin, 4, 6)


@pytest.mark.parametrize("sched", list(SCHEDULERS))
def test_a_lower_version_after_the_sealed_rollout_was_delivered_is_refused(sched: str) -> None:
    with _buffer(sched) as edp, _buffer(sched) as twin:
        for b in (edp, twin):
            b.ingest(_items(0, 4), version=5)
            b.seal()
            assert len(_drain(b)) == 4  # 2 epochs x 2 minibatches: the rollout is consumed, its storage freed
            assert len(b) == 0 and b.semantics.pending_rollouts == 0  # type: ignore[attr-defined]
        _refused_unchanged(edp, twin, 4, 5)


@pytest.mark.parametrize("sched", ["sync", "overlapped"])
def test_a_lower_version_after_the_sealed_rollout_was_dropped_as_stale_is_refused(sched: str) -> None:
    with _buffer(sched, on_stale="drop") as edp, _buffer(sched, on_stale="drop") as twin:
        for b in (edp, twin):
            b.ingest(_items(0, 4), version=5)
            b.seal()
            b.set_policy_version(9)
            assert _drain(b) == [] and b.semantics.dropped_items == 4  # type: ignore[attr-defined]
        _refused_unchanged(edp, twin, 1, 5)


@pytest.mark.parametrize("sched", list(SCHEDULERS))
def test_the_same_version_after_seal_starts_a_new_rollout(sched: str) -> None:
    with _buffer(sched) as edp:
        edp.ingest(_items(0, 4), version=5)
        edp.seal()
        edp.ingest(_items(10, 2), version=5)
        edp.ingest(_items(20, 2), version=7)  # seals the second version-5 rollout
        edp.seal()
        got = _drain(edp)
        rollouts = [sorted(sum((items for v, e, _, items in got[i:i + 4] if e == 0), [])) for i in (0, 4, 8)]
        assert [d[0] for d in got] == [5] * 8 + [7] * 4, f"versions delivered: {[d[0] for d in got]}"
        assert rollouts == [[0, 1, 2, 3], [10, 11], [20, 21]], f"rollouts delivered: {rollouts}"


@pytest.mark.parametrize("sched", ["sync", "overlapped"])
def test_the_rule_survives_a_checkpoint_round_trip(sched: str) -> None:
    with _buffer(sched) as edp, _buffer(sched) as restored, _buffer(sched) as twin:
        edp.ingest(_items(0, 4), version=5)
        edp.seal()
        _drain(edp)  # delivered: only the checkpoint's last sealed version remembers 5
        state = edp.state_dict()
        assert state["semantics"]["last_sealed"] == 5, f"the checkpoint lacks the last sealed version: {state}"
        restored.load_state_dict(state)
        twin.load_state_dict(state)
        _same(restored.state_dict(), state, "round-tripped state")
        _refused_unchanged(restored, twin, 4, 5)


@pytest.mark.parametrize("sched", ["sync", "overlapped"])
def test_an_old_checkpoint_without_the_key_takes_its_newest_sealed_rollout(sched: str) -> None:
    with _buffer(sched) as edp, _buffer(sched) as restored:
        edp.ingest(_items(0, 4), version=5)
        edp.seal()
        state = edp.state_dict()
        del state["semantics"]["last_sealed"]  # written before the key existed
        restored.load_state_dict(state)
        assert restored.state_dict()["semantics"]["last_sealed"] == 5, "the sealed rollout it holds sets the order"
        with pytest.raises(ConfigurationError, match="must not go backwards"):
            restored.ingest(_items(20, 2), version=3)
        restored.ingest(_items(10, 2), version=6)
        restored.seal()
        assert restored.state_dict()["semantics"]["last_sealed"] == 6
        versions = [d[0] for d in _drain(restored)]
        assert versions == [5] * 4 + [6] * 4, f"versions delivered after loading an old checkpoint: {versions}"


@pytest.mark.parametrize("bad", ["x", 2.5, True, [5]])
def test_a_damaged_last_sealed_version_is_refused_and_changes_nothing(bad: object) -> None:
    with _buffer("sync") as edp, _buffer("sync") as target:
        edp.ingest(_items(0, 4), version=5)
        edp.seal()
        state = edp.state_dict()
        state["semantics"]["last_sealed"] = bad
        target.ingest(_items(50, 2), version=1)
        before = target.state_dict()
        with pytest.raises(ConfigurationError, match="last_sealed"):
            target.load_state_dict(state)
        _same(target.state_dict(), before, "state after a refused load")


class _CheckThenStore(OnPolicy):
    """On-policy semantics whose ingest check, once armed, has the background worker store everything handed
    over right after checking: the worker finishing between the check and the hand-over, deterministically."""

    edp: ExperienceDataPlane | None = None

    def check_ingest(self, n: int, *, version: int | None, priorities: torch.Tensor | None) -> None:
        super().check_ingest(n, version=version, priorities=priorities)
        if self.edp is not None:
            self.edp.flush()


def test_background_ingestion_refuses_a_lower_version_stored_between_check_and_handover() -> None:
    sem = _CheckThenStore(num_minibatches=1, seed=7)
    # rollout_size=100: a 4-item batch is an incomplete group, so it waits in the queue until a flush
    with ExperienceDataPlane(SCHEMA, capacity=32, semantics=sem,
                             scheduler=Overlapped(overlap=False, background_ingest=True, rollout_size=100)) as edp:
        edp.ingest(_items(0, 4), version=3)
        edp.seal()
        edp.ingest(_items(10, 4), version=5)
        assert len(edp.scheduler.pending()) == 1, "the version-5 batch should still wait in the ingestion queue"
        sem.edp = edp
        with pytest.raises(ConfigurationError, match="must not go backwards") as e:
            edp.ingest(_items(900, 4), version=4)  # checked while 5 is queued, handed over once 5 is stored
        sem.edp = None
        assert "4" in str(e.value) and "5" in str(e.value), f"the refusal should name versions 4 and 5: {e.value}"
        edp.seal()
        got = [(info.version, sorted(batch["x"].tolist())) for batch, info in _all(edp)]
        assert got == [(3, [0, 1, 2, 3]), (5, [10, 11, 12, 13])], f"a version-4 batch got in after version 5: {got}"


def _all(edp: ExperienceDataPlane) -> list[Any]:
    out = []
    while True:
        try:
            out.append(edp.deliver())
        except EmptyBufferError:
            return out
