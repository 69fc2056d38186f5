"""Prioritized n-step replay while the ring wraps, and how long a PPO minibatch stays valid.

Fixed: ``MinibatchFeed.minibatches()`` promises that a minibatch stays valid until the one after the next is asked
for; with ``prefetch`` (the default) the gather of minibatch k + 2 started as soon as k + 1 was handed over, into
k's delivery buffer (``test_a_minibatch_stays_valid_until_the_one_after_the_next_is_asked_for``).

Checked, no defect found: prioritized n-step replay while the ring wraps (each delivered row is the step its
handle names, n-step returns and next observations right, priority updates land on the items delivered, evicted
ones ignored), with the synchronous, prefetching and background-ingesting schedulers, in real DQN runs (one local
EnvRunner, and two EnvRunners with vector envs) and a real SAC run with truncated episodes; a restore over a
prepared draw; a SAC checkpoint round trip.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from collections.abc import Callable  # noqa: E402
from typing import Any, cast  # noqa: E402

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from conduit import Overlapped  # noqa: E402
from conduit_rllib import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer, MinibatchFeed  # noqa: E402
from conduit_rllib.testing import DQN_SAMPLE_KWARGS as DQN_KW  # noqa: E402
from ray.rllib.core.columns import Columns  # noqa: E402
from ray.rllib.env.single_agent_episode import SingleAgentEpisode  # noqa: E402
from ray.rllib.policy.sample_batch import SampleBatch  # noqa: E402

SPACE = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
ACTS: gym.spaces.Discrete = gym.spaces.Discrete(10 ** 6)


def step_chunk(eid: str, t: int, handle: int, *, done: bool) -> SingleAgentEpisode:
    """One env step of episode ``eid`` at timestep ``t`` whose observation, action and reward are ``handle``
    (the Conduit handle it gets when every add stores one step); its next observation is ``handle + 0.5``."""
    obs = [np.full(2, handle, np.float32), np.full(2, handle + 0.5, np.float32)]
    return SingleAgentEpisode(id_=eid, observations=obs, actions=[handle], rewards=[float(handle)],
                              terminated=done, observation_space=SPACE, action_space=ACTS, len_lookback_buffer=0,
                              t_started=t).to_numpy()


class Stream:
    """Adds one step at a time, episodes of 1..6 steps; remembers each handle's episode and position."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.next = 0
        self.episode: dict[int, tuple[int, int, int]] = {}  # handle -> (episode number, t, episode length)
        self._ep, self._t, self._len = 0, 0, int(self.rng.integers(1, 7))

    def add(self, buf: Any) -> None:
        h = self.next
        done = self._t == self._len - 1
        buf.add([step_chunk(f"e{self._ep}", self._t, h, done=done)])
        self.episode[h] = (self._ep, self._t, self._len)
        self.next += 1
        if done:
            self._ep, self._t, self._len = self._ep + 1, 0, int(self.rng.integers(1, 7))
        else:
            self._t += 1

    def expected(self, h: int, n: int, gamma: float, oldest: int) -> tuple[int, float, float]:
        """(steps summed, n-step return, next obs) of handle ``h`` with handles ``[oldest, next)`` stored."""
        ep, t, length = self.episode[h]
        k = min(n, length - t, self.next - h)
        ret = sum(gamma ** j * (h + j) for j in range(k))
        return k, ret, h + k - 1 + 0.5


def check_draw(stream: Stream, s: Any, n: int, gamma: float, cap: int) -> None:
    handles = s.handles.numpy()
    obs = s.columns[Columns.OBS][:, 0].numpy()
    assert np.array_equal(obs, handles.astype(np.float32)), "a delivered transition is not the item its handle names"
    oldest = stream.next - cap
    for i, h in enumerate(handles.tolist()):
        k, ret, nxt = stream.expected(h, n, gamma, oldest)
        if h < oldest:  # evicted since its draw was prepared: its one-step transition, as delivered
            k, ret, nxt = 1, float(h), h + 0.5
        assert int(s.columns["n_step"][i]) == k, (h, int(s.columns["n_step"][i]), k)
        assert float(s.columns[Columns.REWARDS][i]) == pytest.approx(ret), h
        assert float(s.columns[Columns.NEXT_OBS][i, 0]) == nxt, h


@pytest.mark.parametrize("overlapped", [False, True], ids=["synchronous", "overlapped"])
def test_prioritized_n_step_replay_while_the_ring_wraps_updates_the_items_it_delivered(overlapped: bool) -> None:
    cap, n, gamma, alpha = 16, 3, 0.5, 0.6
    sched = Overlapped(g_del=2, background_ingest=False) if overlapped else None
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=cap, alpha=alpha, seed=3, scheduler=sched)
    stream = Stream(0)
    rng = np.random.default_rng(1)
    try:
        for step in range(200):
            stream.add(buf)
            if step < 8:
                continue
            s = buf.sample(num_items=8, n_step=n, gamma=gamma, beta=0.4, **DQN_KW)
            check_draw(stream, s, n, gamma, cap)
            p = rng.uniform(0.1, 5.0, size=len(s))
            buf.update_priorities(p)
            sampler: Any = cast(Any, buf.edp).semantics.sampler
            live = {}
            for h, pr in zip(s.handles.numpy().tolist(), p.tolist(), strict=True):
                if h >= stream.next - cap:
                    live[h] = pr  # the last of duplicates wins, as in RLlib
            for h, pr in live.items():
                assert sampler._tree.get(np.array([h % cap]))[0] == pytest.approx(pr ** alpha), h
    finally:
        buf.close()


# -- a real DQN run: every draw checked while the ring wraps, with the scheduler the README advertises ----------


class _Log:
    """Every chunk a buffer's add receives (handle range, episode, timesteps, done, observations), and a check of
    every ``sample()`` against them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, n: int, gamma: float, cap: int) -> None:
        from conduit_rllib.replay import _ConduitReplay
        from ray.rllib.utils import force_list

        self.n, self.gamma, self.cap = n, gamma, cap
        self.next = 0
        self.where: list[tuple[str, int]] = []  # handle -> (episode id, timestep)
        self.obs: dict[tuple[str, int], np.ndarray] = {}  # (episode id, t) -> obs_t (t = len: the last next obs)
        self.end: dict[str, int] = {}  # episode id -> timestep after its newest added step
        self.reward: dict[tuple[str, int], float] = {}  # (episode id, t) -> r_t
        self.terminated: set[str] = set()
        self.truncated: set[str] = set()
        self.draws = 0
        add, sample = _ConduitReplay.add, _ConduitReplay.sample

        def logged_add(buf: Any, episodes: Any, weight: float | None = None) -> None:
            add(buf, episodes, weight)
            for e in force_list(episodes):
                o, r = np.asarray(e.get_observations()), np.asarray(e.get_rewards(), dtype=np.float64)
                for k in range(len(e)):
                    self.where.append((e.id_, e.t_started + k))
                    self.reward[(e.id_, e.t_started + k)] = float(r[k])
                for k in range(len(e) + 1):
                    self.obs[(e.id_, e.t_started + k)] = o[k]
                self.end[e.id_] = e.t_started + len(e)
                if e.is_terminated:
                    self.terminated.add(e.id_)
                if e.is_truncated:
                    self.truncated.add(e.id_)
                self.next += len(e)

        def checked_sample(buf: Any, *args: Any, **kwargs: Any) -> Any:
            s = sample(buf, *args, **kwargs)
            self.check(s)
            return s

        monkeypatch.setattr(_ConduitReplay, "add", logged_add)
        monkeypatch.setattr(_ConduitReplay, "sample", checked_sample)

    def check(self, s: Any) -> None:
        self.draws += 1
        oldest = self.next - self.cap
        for i, h in enumerate(s.handles.numpy().tolist()):
            eid, t = self.where[h]
            obs = s.columns[Columns.OBS][i].cpu().numpy()
            assert np.array_equal(obs, self.obs[(eid, t)]), f"draw {self.draws}: row {i} is not handle {h}'s step"
            k = min(self.n, self.end[eid] - t) if h >= oldest else 1
            # (a run of the episode's steps stored: its steps from t on are stored while t is)
            assert int(s.columns["n_step"][i]) == k, (self.draws, h, int(s.columns["n_step"][i]), k)
            ret = sum(self.gamma ** j * self.reward[(eid, t + j)] for j in range(k))
            assert float(s.columns[Columns.REWARDS][i]) == pytest.approx(ret, rel=1e-5, abs=1e-5), (self.draws, h)
            assert np.array_equal(s.columns[Columns.NEXT_OBS][i].cpu().numpy(), self.obs[(eid, t + k)])
            last = t + k == self.end[eid]
            assert bool(s.columns[Columns.TERMINATEDS][i]) == (last and eid in self.terminated), (self.draws, h)
            assert bool(s.columns[Columns.TRUNCATEDS][i]) == (last and eid in self.truncated), (self.draws, h)


SCHEDULERS: dict[str, Any] = {
    "synchronous": None,
    "prefetch": lambda: Overlapped(g_del=2, background_ingest=False),
    "background": lambda: Overlapped(g_ing=4, g_del=2),
}


def _train_until(algo: Any, enough: Callable[[], bool], most: int = 20) -> None:
    """Train until ``enough()`` (at most ``most`` iterations): how many draws an iteration makes depends on the
    machine's speed (RLlib balances sampling and learning by time), what each draw must satisfy does not."""
    for _ in range(most):
        algo.train()
        if enough():
            return


@pytest.mark.parametrize("kind", ["PrioritizedEpisodeReplayBuffer", "EpisodeReplayBuffer"])
@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_a_real_dqn_run_draws_right_n_step_transitions_while_its_buffer_wraps(
        ray_local: None, monkeypatch: pytest.MonkeyPatch, scheduler: str, kind: str) -> None:
    import conduit_rllib
    from ray.rllib.algorithms.dqn import DQNConfig

    cap = 48
    log = _Log(monkeypatch, n=3, gamma=0.5, cap=cap)
    config = (DQNConfig().environment("CartPole-v1")
              .env_runners(num_env_runners=0, rollout_fragment_length=4)
              .training(n_step=3, gamma=0.5, train_batch_size=16, num_steps_sampled_before_learning_starts=16,
                        replay_buffer_config={"type": kind, "capacity": cap, "alpha": 0.6, "beta": 0.4})
              .reporting(min_sample_timesteps_per_iteration=80)
              .debugging(seed=1, log_level="ERROR"))
    algo = conduit_rllib.enable(config, scheduler=SCHEDULERS[scheduler]).build_algo()
    try:
        _train_until(algo, lambda: log.next > 3 * cap and log.draws >= 20)
        assert log.next > 3 * cap and log.draws >= 20, (log.next, log.draws)
        assert len(cast(Any, algo.local_replay_buffer)) == cap
    finally:
        algo.stop()


# -- checkpoints with prepared draws ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer])
def test_a_restore_over_a_prepared_draw_delivers_only_the_restored_contents(kind: type[Any]) -> None:
    """The overlapped scheduler prepares the next draw after each sample(); a set_state() then replaces the
    contents it was drawn from (handles 30.. are issued again, to other steps): no item of the replaced contents
    may be delivered, and every delivered row is the step its handle names."""
    buf = kind(capacity=64, seed=0, scheduler=Overlapped(g_del=2, background_ingest=False))
    try:
        for h in range(30):
            buf.add([step_chunk(f"e{h}", 0, h, done=True)])
        state = buf.get_state()
        for h in range(30, 60):  # contents the restore drops: observation 1000 + handle
            buf.add([step_chunk(f"x{h}", 0, 1000 + h, done=True)])
        for _ in range(2):
            buf.sample(num_items=32, **DQN_KW)  # the second leaves a draw prepared over handles up to 59
        buf.set_state(state)
        for h in range(30, 32):
            buf.add([step_chunk(f"y{h}", 0, h, done=True)])
        s = buf.sample(num_items=32, **DQN_KW)
        obs = s.columns[Columns.OBS][:, 0].numpy()
        assert obs.max() < 32 and np.array_equal(obs, s.handles.numpy().astype(np.float32))
    finally:
        buf.close()


def test_a_sac_checkpoint_restores_the_buffer_and_training_goes_on(ray_local: None, tmp_path: Any) -> None:
    import conduit_rllib
    from conduit_rllib.workloads import sac_pendulum
    from ray.rllib.algorithms.algorithm import Algorithm

    config = sac_pendulum(steps=40, batch=16, learning_starts=20)
    config.training(replay_buffer_config={"type": "PrioritizedEpisodeReplayBuffer", "capacity": 60,
                                          "alpha": 0.6, "beta": 0.4}, store_buffer_in_checkpoints=True)
    algo = conduit_rllib.enable(config).build_algo()
    try:
        algo.train()
        algo.train()
        buf: Any = algo.local_replay_buffer
        path = algo.save_to_path(tmp_path / "sac")
        before = buf.get_state()
    finally:
        algo.stop()
    restored = Algorithm.from_checkpoint(path)
    try:
        rb = restored.local_replay_buffer
        assert isinstance(rb, ConduitPrioritizedEpisodeReplayBuffer) and rb is not buf
        after = rb.get_state()
        assert after["next"] == before["next"] >= 80 and len(rb) == 60
        for k, v in before["edp"]["storage"]["data"].items():
            assert torch.equal(after["edp"]["storage"]["data"][k], v), k
        assert torch.equal(after["edp"]["semantics"]["sampler"]["leaves"],
                           before["edp"]["semantics"]["sampler"]["leaves"])
        restored.train()
        assert rb.get_state()["next"] >= before["next"] + 40 and len(rb) == 60
    finally:
        restored.stop()


def test_a_real_dqn_run_with_vector_envs_on_two_runners_draws_right_n_step_transitions(
        ray_local: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import conduit_rllib
    from ray.rllib.algorithms.dqn import DQNConfig

    cap = 64
    log = _Log(monkeypatch, n=3, gamma=0.5, cap=cap)
    config = (DQNConfig().environment("CartPole-v1")
              .env_runners(num_env_runners=2, num_envs_per_env_runner=2, rollout_fragment_length=3)
              .training(n_step=3, gamma=0.5, train_batch_size=16, num_steps_sampled_before_learning_starts=16,
                        replay_buffer_config={"type": "PrioritizedEpisodeReplayBuffer", "capacity": cap,
                                              "alpha": 0.6, "beta": 0.4})
              .reporting(min_sample_timesteps_per_iteration=120)
              .debugging(seed=1, log_level="ERROR"))
    algo = conduit_rllib.enable(config, scheduler=SCHEDULERS["prefetch"]).build_algo()
    try:
        _train_until(algo, lambda: log.next > 2 * cap and log.draws >= 5)
        assert log.next > 2 * cap and log.draws >= 5, (log.next, log.draws)
    finally:
        algo.stop()


# -- MinibatchFeed: prefetching does not shorten how long a minibatch stays valid -----------------------------


@pytest.mark.parametrize("prefetch", [False, True], ids=["no-prefetch", "prefetch"])
def test_a_minibatch_stays_valid_until_the_one_after_the_next_is_asked_for(prefetch: bool) -> None:
    """``minibatches()`` promises (M minibatches per epoch): "a minibatch is valid until the caller asks for the
    one after the next". With ``prefetch`` (the default) the gather of minibatch k + 2 started as soon as k + 1
    was handed over, into minibatch k's buffer: k changed under a caller still within the promise."""
    feed = MinibatchFeed(num_minibatches=4, num_epochs=3, shuffle=True, seed=0, prefetch=prefetch)
    try:
        feed.ingest("p", SampleBatch({"x": torch.arange(16, dtype=torch.float32)}), version=0)
        feed.seal()
        previous: tuple[torch.Tensor, torch.Tensor] | None = None
        seen = 0
        for mb in feed.minibatches():
            x = cast(torch.Tensor, mb.policy_batches["p"]["x"])
            if feed._inflight is not None:  # let the prefetch of the one after this one land
                feed._inflight.wait()
            if previous is not None:
                assert torch.equal(previous[0], previous[1]), f"minibatch {seen - 1} changed while {seen} was held"
            previous = (x, x.clone())
            seen += 1
        assert seen == 12
    finally:
        feed.close()


def test_a_real_sac_run_with_truncated_episodes_draws_right_n_step_transitions(
        ray_local: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pendulum truncates every episode at 200 steps: n-step returns stop there, truncated and not terminated."""
    import conduit_rllib
    from conduit_rllib.workloads import sac_pendulum

    cap = 100
    log = _Log(monkeypatch, n=3, gamma=0.5, cap=cap)
    config = sac_pendulum(steps=240, batch=16, learning_starts=180)
    config.training(n_step=3, gamma=0.5, replay_buffer_config={"type": "PrioritizedEpisodeReplayBuffer",
                                                               "capacity": cap, "alpha": 0.6, "beta": 0.4})
    algo = conduit_rllib.enable(config).build_algo()
    try:
        _train_until(algo, lambda: bool(log.truncated) and log.draws >= 40)
        assert log.truncated and log.draws >= 40, (log.truncated, log.draws)
    finally:
        algo.stop()
