"""RLlib-adapter regressions: chunks past an episode's end, metrics defaults, the feed's bound (no Ray cluster).

1. A chunk of a finished episode that starts at or after the episode's end (same id, ``t_started`` >= its end)
   was stored as a new run, while RLlib 2.60's own episode buffers refuse it (``concat_episode`` asserts the
   stored episode is not done, after the add already counted the steps). Now Conduit refuses it, typed, with
   what to do, and the buffer is unchanged, while a step of the episode is still stored (as before for a
   chunk inside the episode's steps).
2. The replay buffers' class default ``metrics_every`` was 16, so a buffer built directly (or by RLlib from
   ``replay_buffer_config["type"]`` without ``enable``) returned ``{}`` from 15 of 16 ``get_metrics`` calls
   and reported its counts late. The default is 1 now, as ``enable`` builds it: every call logs RLlib's counts.
3. ``MinibatchFeed`` refused a rollout with ``CapacityError`` once about three were waiting, a bound nobody
   stated. It is stated now (rows waiting <= ``feed.capacity``: ``max(capacity, the smallest power of two >=
   2 x the rows of the rollout that sized the storage)``, not grown while something waits) and the refusal
   says what to do and changes nothing.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from conduit import CapacityError, ConfigurationError, EmptyBufferError  # noqa: E402
from conduit_rllib import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer, MinibatchFeed  # noqa: E402
from conduit_rllib.testing import DQN_SAMPLE_KWARGS as DQN_KW  # noqa: E402
from conduit_rllib.testing import id_episode
from ray.rllib.core.columns import Columns  # noqa: E402
from ray.rllib.policy.sample_batch import SampleBatch  # noqa: E402
from ray.rllib.utils.metrics.metrics_logger import MetricsLogger  # noqa: E402
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer  # noqa: E402
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer  # noqa: E402

Buffer = ConduitEpisodeReplayBuffer | ConduitPrioritizedEpisodeReplayBuffer
#: (Conduit's buffer, RLlib's buffer of the same kind)
PAIRS = [(ConduitEpisodeReplayBuffer, EpisodeReplayBuffer),
         (ConduitPrioritizedEpisodeReplayBuffer, PrioritizedEpisodeReplayBuffer)]
#: the state entries an add changes (the stored contents are compared through stored_ids)
STATE_KEYS = ("next", "tail", "tail_t", "ended", "lifetime", "unlogged")


def stored_ids(buf: Buffer) -> list[int]:
    """The observation ids of every stored transition, in storage order."""
    data = buf.get_state()["edp"]["storage"]["data"][Columns.OBS]
    return data[:len(buf), 0].numpy().astype(np.int64).tolist()


def book(buf: Buffer) -> dict[str, Any]:
    """What an add would change, besides the stored transitions."""
    state = buf.get_state()
    return {k: state[k] for k in STATE_KEYS}


# -- 1. a chunk starting at or after a finished episode's end ---------------------------------------------------


@pytest.mark.parametrize(("kind", "native"), PAIRS)
@pytest.mark.parametrize("t0", [5, 7])
def test_a_chunk_at_or_after_a_finished_episodes_end_is_refused_as_rllib_refuses_it(
        kind: type[Buffer], native: type[EpisodeReplayBuffer], t0: int) -> None:
    """Episode "e" ends at timestep 5; a chunk of it starting at 5 (right at its end) or at 7 (after a gap)."""
    finished = id_episode(np.arange(5), episode_id="e", terminated=True)
    late = id_episode(np.arange(10, 12), episode_id="e", t_started=t0)
    rllib = native(capacity=20)
    rllib.add([finished])
    with pytest.raises(AssertionError):  # RLlib 2.60: concat_episode asserts the stored episode is not done
        rllib.add([late])

    buf = kind(capacity=20, seed=0)
    buf.add([finished])
    before = book(buf)
    other = id_episode(np.arange(20, 22), episode_id="f")
    for add in ([late], [other, late]):  # alone, and after a good chunk of the same add
        with pytest.raises(ConfigurationError, match=rf"'e' ended at timestep 5(.|\n)*starting at timestep {t0}"
                                                     r"(.|\n)*new episode id(.|\n)*Nothing of this add was stored"):
            buf.add(add)
        assert stored_ids(buf) == [0, 1, 2, 3, 4]
        assert book(buf) == before
    buf.add([id_episode(np.arange(10, 12), episode_id="e2")])  # what the error says: a new episode id
    assert stored_ids(buf) == [0, 1, 2, 3, 4, 10, 11] and buf.get_num_episodes() == 2


@pytest.mark.parametrize(("kind", "native"), PAIRS)
def test_a_finished_episodes_later_chunk_is_accepted_once_the_episode_is_evicted(
        kind: type[Buffer], native: type[EpisodeReplayBuffer]) -> None:
    """RLlib forgets an evicted episode, so a chunk with its id is a new episode then; so does Conduit."""
    late = id_episode(np.arange(10, 12), episode_id="e", t_started=3)
    rllib = native(capacity=4)
    rllib.add([id_episode(np.arange(3), episode_id="e", terminated=True)])
    rllib.add([id_episode(np.arange(5, 9), episode_id="g")])  # evicts all of "e"
    rllib.add([late])  # accepted: a new episode
    assert rllib.episodes[-1].id_ == "e" and len(rllib.episodes[-1]) == 2

    buf = kind(capacity=4, seed=0)
    buf.add([id_episode(np.arange(3), episode_id="e", terminated=True)])
    buf.add([id_episode(np.arange(5, 9), episode_id="g")])  # evicts all of "e"
    buf.add([late])
    assert sorted(stored_ids(buf)) == [7, 8, 10, 11]


# -- 2. metrics_every's default ---------------------------------------------------------------------------------


COUNTS = ("num_env_steps_added", "num_env_steps_added_lifetime", "num_env_steps_sampled",
          "num_env_steps_sampled_lifetime", "num_episodes_added", "num_episodes_added_lifetime")


def _reports(buf: Any) -> list[dict[str, float | None]]:
    """Three rounds of four (add an episode of 3 steps, sample 5, fold get_metrics() into the round's results),
    as a caller without an algorithm iteration (no ``iteration_of``) drives a buffer."""
    out = []
    step = 0
    for _ in range(3):
        results = MetricsLogger(root=True)
        for _ in range(4):
            buf.add([id_episode(np.arange(3) + 10 * step, terminated=True)])
            step += 1
            buf.sample(num_items=5, n_step=1, gamma=0.99, **DQN_KW)
            results.aggregate([buf.get_metrics()], key="replay_buffer")
        replay = results.compile().get("replay_buffer", {})
        out.append({k: (None if replay.get(k) is None else float(replay[k])) for k in COUNTS})
    return out


@pytest.mark.parametrize(("kind", "native"), PAIRS)
def test_a_directly_built_buffer_logs_on_every_call_and_reports_rllibs_counts(
        kind: type[Buffer], native: type[EpisodeReplayBuffer]) -> None:
    buf = kind(capacity=1000, seed=0)
    assert buf.metrics_every == 1
    assert buf.iteration_of is None  # no algorithm: only metrics_every decides when to log
    ours, theirs = _reports(buf), _reports(native(capacity=1000))
    assert theirs[0]["num_env_steps_added"] == 12 and theirs[0]["num_env_steps_sampled"] == 20, theirs
    assert ours == theirs, f"per-round counts\n conduit {ours}\n rllib   {theirs}"


# -- 3. the rollouts a MinibatchFeed holds ----------------------------------------------------------------------


def rollout(lo: int, n: int) -> SampleBatch:
    ids = torch.arange(lo, lo + n)
    return SampleBatch({Columns.OBS: ids.float()[:, None].repeat(1, 3), Columns.ACTIONS: ids})


def add(feed: MinibatchFeed, lo: int, n: int) -> None:
    feed.ingest("default_policy", rollout(lo, n), version=0)
    feed.seal()


def deliver_one(feed: MinibatchFeed) -> list[int]:
    """Every row of the oldest waiting rollout (one epoch), in delivery order."""
    rows: list[int] = []
    for mab in feed.minibatches():
        rows += mab.policy_batches["default_policy"][Columns.ACTIONS].tolist()
    return rows


@pytest.mark.parametrize(("n", "capacity", "storage", "fit"),
                         [(64, 0, 128, 2), (100, 0, 256, 2), (129, 0, 512, 3), (300, 0, 1024, 3),
                          (1000, 0, 2048, 2), (1000, 4096, 4096, 4)])
def test_rollouts_wait_up_to_the_stated_rows_and_the_next_is_refused_changing_nothing(
        n: int, capacity: int, storage: int, fit: int) -> None:
    feed = MinibatchFeed(num_minibatches=2, num_epochs=1, prefetch=False, capacity=capacity)
    for i in range(fit):
        add(feed, 10_000 * i, n)
    assert feed.capacity == storage == max(capacity, 1 << int(np.ceil(np.log2(2 * n))))
    assert fit == storage // n
    with pytest.raises(CapacityError, match=rf"{fit * n} rows waiting(.|\n)*{fit} sealed rollout\(s\)(.|\n)*capacity "
                                            rf"{storage} rows(.|\n)*nothing of it was ingested(.|\n)*"
                                            r"MinibatchFeed\(capacity="):
        add(feed, 10_000 * fit, n)
    assert feed.semantics.pending_rollouts == fit and feed.dropped_items == 0
    for i in range(fit):  # the waiting ones, whole and in order; the refused one is not there
        assert sorted(deliver_one(feed)) == list(range(10_000 * i, 10_000 * i + n))
    with pytest.raises(EmptyBufferError):
        deliver_one(feed)


def test_a_rollout_being_delivered_counts_whole_until_its_last_minibatch() -> None:
    feed = MinibatchFeed(num_minibatches=2, num_epochs=2, prefetch=False)
    add(feed, 0, 64)
    add(feed, 1000, 64)  # 128 rows: the storage (128) is full
    it = feed.minibatches()
    next(it)  # one of the first rollout's four minibatches
    with pytest.raises(CapacityError):
        add(feed, 2000, 64)
    rest = [r for mab in it for r in mab.policy_batches["default_policy"][Columns.ACTIONS].tolist()]
    assert len(rest) == 3 * 32
    add(feed, 2000, 64)  # the first rollout is delivered: its rows are free
    assert sorted(deliver_one(feed)) == sorted(list(range(1000, 1064)) * 2)
    assert sorted(deliver_one(feed)) == sorted(list(range(2000, 2064)) * 2)


def test_rows_ingested_but_not_sealed_wait_too() -> None:
    feed = MinibatchFeed(num_minibatches=2, num_epochs=1, prefetch=False)
    feed.ingest("default_policy", rollout(0, 64), version=0)  # sizes the storage: 128 rows
    feed.ingest("default_policy", rollout(64, 64), version=0)  # the same open rollout
    assert feed.capacity == 128
    with pytest.raises(CapacityError, match=r"128 rows waiting(.|\n)*0 sealed rollout\(s\)"):
        feed.ingest("default_policy", rollout(128, 1), version=0)
    feed.seal()
    assert sorted(deliver_one(feed)) == list(range(128))  # one rollout of 128 rows, the refused row not in it
