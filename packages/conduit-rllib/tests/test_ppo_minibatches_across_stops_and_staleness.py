"""RLlib's cyclic minibatches through Conduit when an iteration is interrupted between the pieces of a
minibatch that spans an epoch boundary, and core ``OnPolicy.epoch_sizes`` refusals (no Ray cluster)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conduit import ConfigurationError, ExperienceDataPlane, ExperienceSchema, Field, OnPolicy, StaleExperienceError
from conduit_rllib import MinibatchFeed
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils.minibatch_utils import MiniBatchCyclicIterator


def rows(lo: int, hi: int) -> dict[str, torch.Tensor]:
    ids = torch.arange(lo, hi)
    return {"row": ids, "twice": ids * 2}


def ids(mab: MultiAgentBatch) -> list[int]:
    b = mab.policy_batches["m"]
    assert torch.equal(b["twice"], b["row"] * 2), "the columns of a minibatch were mixed up"
    return b["row"].tolist()


def rllib(n: int, minibatch_size: int, num_epochs: int) -> list[list[int]]:
    """RLlib's own unshuffled cyclic minibatches of rows 0..n-1."""
    mab = MultiAgentBatch({"m": SampleBatch(rows(0, n))}, env_steps=n)
    return [mb.policy_batches["m"]["row"].tolist() for mb in MiniBatchCyclicIterator(
        mab, num_epochs=num_epochs, minibatch_size=minibatch_size, shuffle_batch_per_epoch=False)]


def settle(f: MinibatchFeed) -> None:
    """Wait until the prefetch thread has made the delivery it was asked for (the head of the next minibatch)."""
    if f._pool is not None:
        f._pool.submit(lambda: None).wait()


def feed(prefetch: bool, **kwargs: Any) -> MinibatchFeed:
    f = MinibatchFeed(minibatch_size=4, num_epochs=2, shuffle=False, prefetch=prefetch, **kwargs)
    f.ingest("m", rows(0, 10), version=0)  # pieces 4, 4, 2 | 2, 4, 4: the third minibatch spans the epochs
    f.seal()
    return f


@pytest.mark.parametrize("prefetch", [False, True])
def test_resuming_an_abandoned_iteration_delivers_rllibs_minibatches_with_or_without_prefetch(prefetch: bool) -> None:
    want = rllib(10, 4, 2)
    assert want == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1], [2, 3, 4, 5], [6, 7, 8, 9]]
    f = feed(prefetch, max_staleness=5)
    it = f.minibatches()
    got = [ids(next(it)), ids(next(it))]
    it.close()  # the caller's training raised: with prefetch, the head of [8, 9, 0, 1] was already delivered
    got += [ids(mab) for mab in f.minibatches()]
    assert got == want, f"resumed iteration lost or split rows (prefetch={prefetch}): {got}, RLlib: {want}"
    f.close()


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_minibatch_whose_rollout_goes_stale_between_its_pieces_never_joins_another_rollout(prefetch: bool) -> None:
    f = feed(prefetch, max_staleness=1)
    it = f.minibatches()
    got = [ids(next(it)), ids(next(it))]
    settle(f)
    f.ingest("m", rows(100, 110), version=2)
    f.seal()
    f.set_policy_version(2)  # rollout 0 is now 2 versions behind: dropped, even mid-minibatch
    got += [ids(mab) for mab in it]
    assert all(len(mb) == 4 for mb in got), f"every minibatch has minibatch_size rows: {got}"
    assert all(len({r >= 100 for r in mb}) == 1 for mb in got), f"a minibatch mixed two rollouts: {got}"
    assert got[2:] == [[100 + r for r in mb] for mb in rllib(10, 4, 2)], f"the fresh rollout, RLlib's cuts: {got}"
    f.close()


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_stale_continuation_is_refused_and_never_handed_over_as_half_a_minibatch(prefetch: bool) -> None:
    f = feed(prefetch, on_stale="raise")
    it = f.minibatches()
    got = [ids(next(it)), ids(next(it))]
    settle(f)  # with prefetch the head [8, 9] is delivered before the policy moves on
    f.set_policy_version(1)
    with pytest.raises(StaleExperienceError):
        next(it)
    with pytest.raises(StaleExperienceError):  # still refused: not the tail [0, 1] joined with [2, 3, 4, 5]
        f.minibatches()
    f.semantics.max_staleness = 1  # the user lets it through after all
    got += [ids(mab) for mab in f.minibatches()]
    assert got == rllib(10, 4, 2), f"lost or split rows across the refusal: {got}"
    f.close()


class _BadFromEpoch1(OnPolicy):
    refuse = True

    def epoch_sizes(self, n: int, epoch: int) -> list[int]:
        return [n + 1] if self.refuse and epoch == 1 else super().epoch_sizes(n, epoch)


def test_a_refused_epoch_sizes_mid_rollout_loses_no_minibatch_and_stays_typed() -> None:
    schema = ExperienceSchema({"x": Field((), torch.float32)})
    sem = _BadFromEpoch1(num_minibatches=1, num_epochs=2, shuffle=False)
    edp = ExperienceDataPlane(schema, capacity=16, semantics=sem)
    edp.ingest({"x": torch.arange(4.0)}, version=0)
    edp.seal()
    states = []
    for _ in range(2):  # epoch 1 is cut as epoch 0's last minibatch goes: refused, and refused again alike
        with pytest.raises(ConfigurationError, match=r"epoch_sizes returned \[5\] for epoch 1 of 2 over 4 items"):
            edp.deliver()
        states.append(sem.state_dict())
    assert {k: v for k, v in states[0].items() if k not in ("rng", "perm")} == \
        {k: v for k, v in states[1].items() if k not in ("rng", "perm")}, "a refused delivery changed the state"
    assert torch.equal(states[0]["rng"], states[1]["rng"]) and torch.equal(states[0]["perm"], states[1]["perm"])
    sem.refuse = False
    got = []
    for _ in range(2):
        batch, info = edp.deliver()
        got.append((int(info.epoch), batch.tensor("x").tolist(), bool(info.last)))
    assert got == [(0, [0.0, 1.0, 2.0, 3.0], False), (1, [0.0, 1.0, 2.0, 3.0], True)], \
        f"the refused minibatch was lost or the epochs went wrong: {got}"
    edp.close()


class _Refusing(OnPolicy):
    refuse = True

    def epoch_sizes(self, n: int, epoch: int) -> list[int]:
        return [n + 1] if self.refuse else super().epoch_sizes(n, epoch)


def test_a_refused_epoch_sizes_leaves_the_permutation_rng_alone() -> None:
    schema = ExperienceSchema({"x": Field((), torch.float32)})
    sem, ref = _Refusing(num_minibatches=1, seed=3), OnPolicy(num_minibatches=1, seed=3)
    got = []
    for s in (sem, ref):
        edp = ExperienceDataPlane(schema, capacity=16, semantics=s)
        edp.ingest({"x": torch.arange(8.0)}, version=0)
        edp.seal()
        if s is sem:
            with pytest.raises(ConfigurationError, match="epoch_sizes returned"):
                edp.deliver()
            sem.refuse = False
        got.append(edp.deliver()[0].tensor("x").tolist())
        edp.close()
    assert got[0] == got[1], f"the refusal consumed a permutation: {got[0]} vs {got[1]}"


class _Returns(OnPolicy):
    sizes: Any = None

    def epoch_sizes(self, n: int, epoch: int) -> Any:
        return self.sizes


@pytest.mark.parametrize("sizes", [None, 8, iter([8]), [True] * 8, [8.0]])
def test_an_epoch_sizes_that_is_no_list_of_ints_is_refused_typed_and_changes_nothing(sizes: Any) -> None:
    sem = _Returns(num_minibatches=1, seed=1)
    sem.sizes = sizes
    edp = ExperienceDataPlane(ExperienceSchema({"x": Field((), torch.float32)}), capacity=16, semantics=sem)
    edp.ingest({"x": torch.arange(8.0)}, version=0)
    edp.seal()
    with pytest.raises(ConfigurationError, match=r"epoch_sizes returned .* a list of positive ints summing to 8"):
        edp.deliver()
    assert sem.pending_rollouts == 1, "the refused rollout must stay pending"
    sem.sizes = [5, 3]
    got = [edp.deliver()[0].batch_size for _ in range(2)]
    assert got == [5, 3]
    edp.close()


@pytest.mark.parametrize("prefetch", [False, True])
def test_the_last_minibatch_of_an_abandoned_iteration_still_waits_with_or_without_prefetch(prefetch: bool) -> None:
    f = feed(prefetch, max_staleness=5)
    it = f.minibatches()
    got = [ids(next(it)) for _ in range(4)]
    it.close()  # with prefetch the last minibatch [6, 7, 8, 9] was already delivered
    with pytest.raises(ConfigurationError, match="waiting for delivery"):
        f.configure(minibatch_size=5, num_epochs=2, shuffle=False)
    got += [ids(mab) for mab in f.minibatches()]
    assert got == rllib(10, 4, 2), f"the last minibatch was lost (prefetch={prefetch}): {got}"
    f.close()


def test_loading_a_state_discards_a_held_minibatch_like_the_rollout_it_belongs_to() -> None:
    f = feed(True, max_staleness=5)
    it = f.minibatches()
    next(it)
    it.close()  # the prefetched [4, 5, 6, 7] is held
    f.load_state_dict(f.state_dict(drop_pending=True))  # discards what was waiting (plain state_dict() refuses)
    f.configure(minibatch_size=5, num_epochs=1, shuffle=False)  # idle: accepted
    f.ingest("m", rows(20, 30), version=0)
    f.seal()
    assert [ids(mab) for mab in f.minibatches()] == [list(range(20, 25)), list(range(25, 30))]
    f.close()
