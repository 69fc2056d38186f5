"""An outside adapter author's journey: prove one's own replay and on-policy buffers conformant, from the docs.

The author maintains a small dict-of-deques buffer (:class:`DequeReplay`: one deque per column, each item
numbered by a serial that is its handle; priorities in a slot array of ``capacity`` leaves, as a sum tree has)
and an on-policy buffer of their own (:class:`DequeOnPolicy`), writes the endpoints ``conduit.testing``
describes, subclasses the suites, and registers an :class:`~conduit.testing.EndpointFactory` under the
``conduit.conformance`` entry-point group. The correct buffers pass; each mutant is one mistake such an author
makes, and the suite must fail it naming the problem (not pass, skip, or fail deep inside a check).
"""

from __future__ import annotations

import sys
import threading
import types
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conduit.errors import ConfigurationError, EmptyBufferError, PriorityError, StaleExperienceError
from conduit.testing import (
    CAP_CHECKPOINT,
    CAP_CHECKPOINT_BETWEEN_ROLLOUTS,
    CAP_CONCURRENT_INGEST,
    CAP_PRIORITIZED,
    ConcurrencySuite,
    Draw,
    EndpointFactory,
    FreshnessSuite,
    Minibatch,
    OnPolicyEndpoint,
    ReplayEndpoint,
    ReplaySuite,
)

sys.path.insert(0, str(Path(__file__).parent))
from _suite_mutants import concurrency_suite, freshness_suite, replay_suite  # noqa: E402, I001  (shared binders)

ROOT = Path(__file__).resolve().parents[3]


# -- the author's own buffers -------------------------------------------------------------------------------------
class DequeReplay:
    """Columns ``id`` and ``obs`` in deques of ``maxlen=capacity``; item number ``s`` (its serial, the handle)
    has its priority ``p ** alpha`` in leaf ``s % capacity`` (0 for a leaf that holds no item)."""

    def __init__(self, capacity: int, *, prioritized: bool, alpha: float, beta: float, seed: int) -> None:
        self.capacity, self.prioritized, self.alpha, self.beta = capacity, prioritized, alpha, beta
        self.cols: dict[str, deque[Any]] = {"id": deque(maxlen=capacity), "obs": deque(maxlen=capacity)}
        self.leaves = np.zeros(capacity)
        self.serial = 0  # the next item's serial
        self.max_p = 1.0
        self.rng = np.random.default_rng(seed)
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.cols["id"])

    @property
    def oldest(self) -> int:
        return self.serial - len(self)

    def add(self, ids: np.ndarray) -> None:
        with self.lock:
            for i in np.asarray(ids, dtype=np.int64).tolist():
                self.cols["id"].append(i)
                self.cols["obs"].append(np.full(3, float(i), np.float32))
                self.leaves[self.serial % self.capacity] = self.max_p ** self.alpha
                self.serial += 1

    def check_not_empty(self) -> None:
        if len(self) == 0:
            raise EmptyBufferError("the buffer is empty: add items before sampling")

    def smallest_live_leaf(self) -> float:
        return float(self.leaves[np.arange(self.oldest, self.serial) % self.capacity].min())

    def weights(self, leaf: np.ndarray) -> np.ndarray:
        """(N P(i))^-beta over the largest possible weight, (N min_j P(j))^-beta: (min_j p_j / p_i)^beta."""
        return (self.smallest_live_leaf() / leaf) ** self.beta

    def sample_prioritized(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        self.check_not_empty()
        slots = self.rng.choice(self.capacity, n, p=self.leaves / self.leaves.sum())
        return self.oldest + (slots - self.oldest) % self.capacity, self.weights(self.leaves[slots])

    def sample(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        with self.lock:
            if self.prioritized:
                serials, w = self.sample_prioritized(n)
            else:
                self.check_not_empty()
                serials, w = self.oldest + self.rng.integers(0, len(self), n), None
            pos = (serials - self.oldest).tolist()
            ids = np.array([self.cols["id"][p] for p in pos], dtype=np.int64)
            obs = np.stack([self.cols["obs"][p] for p in pos])
            return ids, obs, serials, w

    def update_priorities(self, serials: Any, priorities: Any) -> None:
        h, p = np.asarray(serials, dtype=np.int64), np.asarray(priorities, dtype=np.float64)
        if h.shape != p.shape or not np.isfinite(p).all() or (p < 0).any():
            raise PriorityError("pass one finite priority >= 0 per handle")
        with self.lock:
            live = (h >= self.oldest) & (h < self.serial)
            self.leaves[h[live] % self.capacity] = p[live] ** self.alpha
            self.max_p = max(self.max_p, float(p.max(initial=0.0)))

    def state(self) -> dict[str, Any]:
        with self.lock:
            return {"id": list(self.cols["id"]), "obs": [o.copy() for o in self.cols["obs"]],
                    "leaves": self.leaves.copy(), "serial": self.serial, "max_p": self.max_p,
                    "rng": self.rng.bit_generator.state}

    def load(self, s: dict[str, Any]) -> None:
        with self.lock:
            self.cols = {k: deque(s[k], maxlen=self.capacity) for k in ("id", "obs")}
            self.leaves, self.serial, self.max_p = s["leaves"].copy(), s["serial"], s["max_p"]
            self.rng.bit_generator.state = s["rng"]


class DequeOnPolicy:
    """Rollouts sealed on ``end_rollout`` or a new version; each delivered whole, M minibatches x E epochs; a version
    below the open or the last sealed rollout's is refused."""

    def __init__(self, m: int, e: int, max_staleness: int, on_stale: str, seed: int) -> None:
        self.m, self.e, self.max_staleness, self.on_stale = m, e, max_staleness, on_stale
        self.rng = np.random.default_rng(seed)
        self.sealed: deque[tuple[int, np.ndarray]] = deque()
        self.open: list[int] = []
        self.open_version: int | None = None
        self.last_sealed: int | None = None
        self.policy = 0

    def add(self, ids: np.ndarray, version: int) -> None:
        newest = max((v for v in (self.open_version, self.last_sealed) if v is not None), default=None)
        if newest is not None and version < newest:
            raise ConfigurationError(f"version {version} arrived after version {newest}: versions do not go back")
        if self.open_version is not None and version != self.open_version:
            self.seal()
        self.open += np.asarray(ids).tolist()
        self.open_version = version

    def seal(self) -> None:
        if self.open:
            assert self.open_version is not None
            self.sealed.append((self.open_version, np.array(self.open, dtype=np.int64)))
            self.last_sealed = self.open_version
        self.open, self.open_version = [], None

    def next_rollout(self) -> list[Minibatch]:
        while self.sealed:
            version, ids = self.sealed[0]
            if self.policy - version > self.max_staleness:
                if self.on_stale == "raise":
                    raise StaleExperienceError(f"the rollout of version {version} is more than {self.max_staleness} "
                                               f"versions behind policy {self.policy}")
                self.sealed.popleft()
                continue
            self.sealed.popleft()
            return [Minibatch(part, version, epoch) for epoch in range(self.e)
                    for part in np.array_split(ids[self.rng.permutation(len(ids))], self.m)]
        raise EmptyBufferError("no ended rollout is waiting")

    def state(self) -> dict[str, Any]:
        return {"sealed": [(v, ids.copy()) for v, ids in self.sealed], "open": list(self.open),
                "open_version": self.open_version, "last_sealed": self.last_sealed, "policy": self.policy,
                "rng": self.rng.bit_generator.state}

    def load(self, s: dict[str, Any]) -> None:
        self.sealed = deque((v, ids.copy()) for v, ids in s["sealed"])
        self.open, self.open_version, self.policy = list(s["open"]), s["open_version"], s["policy"]
        self.last_sealed = s["last_sealed"]
        self.rng.bit_generator.state = s["rng"]


# -- the endpoints, written from conduit.testing's docstrings ------------------------------------------------------
class DequeReplayEndpoint(ReplayEndpoint):
    capabilities = frozenset({CAP_PRIORITIZED, CAP_CHECKPOINT, CAP_CONCURRENT_INGEST})
    buffer_type: type[DequeReplay] = DequeReplay

    def __init__(self, *, capacity: int, prioritized: bool = False, alpha: float = 0.6, beta: float = 0.4,
                 seed: int = 0) -> None:
        self.buf = self.buffer_type(capacity, prioritized=prioritized, alpha=alpha, beta=beta, seed=seed)

    def insert(self, ids: np.ndarray) -> None:
        self.buf.add(ids)

    def sample(self, n: int) -> Draw:
        ids, obs, handles, w = self.buf.sample(n)
        bad = (obs != ids[:, None].astype(np.float32)).any(axis=1)
        assert not bad.any(), f"payload does not match the id of items {ids[bad][:5].tolist()}"
        return Draw(ids, handles, w)

    def __len__(self) -> int:
        return len(self.buf)

    def contents(self) -> np.ndarray:
        return np.array(self.buf.cols["id"], dtype=np.int64)

    def update_priorities(self, handles: Any, priorities: np.ndarray) -> None:
        self.buf.update_priorities(handles, priorities)

    def state_dict(self) -> Any:
        return self.buf.state()

    def load_state_dict(self, state: Any) -> None:
        self.buf.load(state)


class DequeOnPolicyEndpoint(OnPolicyEndpoint):
    capabilities = frozenset({CAP_CHECKPOINT})
    buffer_type: type[DequeOnPolicy] = DequeOnPolicy

    def __init__(self, *, num_minibatches: int, num_epochs: int, max_staleness: int = 0, on_stale: str = "drop",
                 seed: int = 0) -> None:
        self.buf = self.buffer_type(num_minibatches, num_epochs, max_staleness, on_stale, seed)

    def ingest(self, ids: np.ndarray, version: int) -> None:
        self.buf.add(ids, version)

    def end_rollout(self) -> None:
        self.buf.seal()

    def set_policy_version(self, version: int) -> None:
        self.buf.policy = version

    def consume(self) -> list[Minibatch]:
        return self.buf.next_rollout()

    def state_dict(self) -> Any:
        return self.buf.state()

    def load_state_dict(self, state: Any) -> None:
        self.buf.load(state)


#: what the author registers under ``conduit.conformance`` (see test_an_installed_adapter_is_discovered)
ENDPOINTS = EndpointFactory("deque-journey", make_replay=DequeReplayEndpoint, make_on_policy=DequeOnPolicyEndpoint)


def _tests(suite: type) -> list[str]:
    return sorted(n for n in dir(suite) if n.startswith("test_"))


# -- the correct buffers conform -----------------------------------------------------------------------------------
@pytest.mark.parametrize("check", _tests(ReplaySuite))
def test_the_authors_replay_buffer_conforms(check: str) -> None:
    getattr(replay_suite(DequeReplayEndpoint), check)()


@pytest.mark.parametrize("check", _tests(FreshnessSuite))
def test_the_authors_on_policy_buffer_conforms(check: str) -> None:
    getattr(freshness_suite(DequeOnPolicyEndpoint), check)()


def test_the_authors_replay_buffer_conforms_under_concurrent_producers() -> None:
    # called directly, below the guard, with 10,000 items per thread: the full size is the suite's own business
    concurrency_suite(DequeReplayEndpoint, per_thread=10_000).test_concurrent_producers_lose_and_duplicate_nothing()


def test_an_installed_adapter_is_discovered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Registered as the docs say (an ``EndpointFactory`` under ``conduit.conformance`` in the package's metadata),
    the adapter is found by ``discover_endpoints`` and integration-tests/ builds its suites from it."""
    dist = tmp_path / "deque_journey-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: deque-journey\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[conduit.conformance]\ndeque-journey = deque_journey:ENDPOINTS\n")
    package = types.ModuleType("deque_journey")  # the author's installed package
    package.ENDPOINTS = ENDPOINTS  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deque_journey", package)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib.util

    spec = importlib.util.spec_from_file_location("_journey_integration",
                                                  ROOT / "integration-tests/test_conformance_all_adapters.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # discovers the registered factories, as a pytest run of integration-tests/ does
    found = {f.name: f for f in mod.FACTORIES}
    assert found.get("deque-journey") is ENDPOINTS, sorted(found)
    for kind, suite in (("Replay", ReplaySuite), ("Concurrency", ConcurrencySuite), ("Freshness", FreshnessSuite)):
        cls = getattr(mod, f"Test{kind}_deque-journey", None)
        assert isinstance(cls, type) and issubclass(cls, suite), f"integration-tests/ builds no {kind} suite for it"
    assert mod.untested(ENDPOINTS) == set(), "the author's adapter declares every capability"


# -- the mistakes ----------------------------------------------------------------------------------------------------
class WeightsOverEveryLeaf(DequeReplay):
    """Normalises importance weights by the smallest leaf of the whole slot array, empty leaves (0) included: right
    once the buffer is full, but before that every weight is 0 (the learner's loss vanishes)."""

    def smallest_live_leaf(self) -> float:
        return float(self.leaves.min())


class WeightsOverEveryLeafEndpoint(DequeReplayEndpoint):
    buffer_type = WeightsOverEveryLeaf


class PrioritizedEmptyUnguarded(DequeReplay):
    """Guards the uniform path against an empty buffer (the one the suite exercised), not the prioritized one:
    sampling an empty prioritized buffer raises NumPy's ValueError, not a Conduit error."""

    def sample_prioritized(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        with np.errstate(invalid="ignore"):  # 0 / 0: NaN probabilities, which rng.choice refuses
            slots = self.rng.choice(self.capacity, n, p=self.leaves / self.leaves.sum())
        return self.oldest + (slots - self.oldest) % self.capacity, self.weights(self.leaves[slots])


class PrioritizedEmptyUnguardedEndpoint(DequeReplayEndpoint):
    buffer_type = PrioritizedEmptyUnguarded


def test_weights_normalised_over_empty_leaves_fail_the_suite() -> None:
    """The mutant passes every check that looks at weights (they all fill the buffer first); the partly filled
    check fails it, saying what is wrong."""
    suite = replay_suite(WeightsOverEveryLeafEndpoint)
    suite.test_importance_weights()
    suite.test_prefetched_priorities_at_most_declared_staleness()
    with pytest.raises(AssertionError, match="partly filled"):
        suite.test_importance_weights_of_a_partly_filled_buffer()


def test_prioritized_empty_sample_with_a_foreign_error_fails_the_suite() -> None:
    with pytest.raises(AssertionError, match=r"prioritized=True.*ValueError.*conduit.ConduitError"):
        replay_suite(PrioritizedEmptyUnguardedEndpoint).test_sampling_empty_buffer_raises()


class SealsEmptyRollouts(DequeOnPolicy):
    """``end_rollout`` seals the open rollout even when it holds nothing: a second ``end_rollout`` (or one before
    any ingest) queues an empty rollout, delivered as M x E empty minibatches."""

    def seal(self) -> None:
        self.sealed.append((self.policy if self.open_version is None else self.open_version,
                            np.array(self.open, dtype=np.int64)))
        self.open, self.open_version = [], None


class SealsEmptyRolloutsEndpoint(DequeOnPolicyEndpoint):
    def __init__(self, *, num_minibatches: int, num_epochs: int, max_staleness: int = 0, on_stale: str = "drop",
                 seed: int = 0) -> None:
        self.buf = SealsEmptyRollouts(num_minibatches, num_epochs, max_staleness, on_stale, seed)


def test_an_empty_rollout_sealed_by_end_rollout_fails_the_suite() -> None:
    """No older check calls ``end_rollout`` with nothing open: the mutant passes them (a new endpoint's consume()
    still raises EmptyBufferError, and version purity holds)."""
    suite = freshness_suite(SealsEmptyRolloutsEndpoint)
    suite.test_endpoint_is_fresh()
    suite.test_version_purity()
    with pytest.raises(pytest.fail.Exception, match="made a rollout"):
        suite.test_ending_an_empty_rollout_delivers_nothing()


class SavesOnlyEndedRollouts(DequeOnPolicy):
    """The checkpoint keeps the ended rollouts and forgets the open one (still being collected at the save): its
    items from before the save are lost, and the restored buffer delivers only those ingested after it."""

    def state(self) -> dict[str, Any]:
        return dict(super().state(), open=[], open_version=None)


class RestoresWithoutThePolicy(DequeOnPolicy):
    """The checkpoint keeps the rollouts and the RNG but not the policy version: the restored buffer judges staleness
    against version 0 and delivers a rollout the saved one drops as stale."""

    def load(self, s: dict[str, Any]) -> None:
        super().load(dict(s, policy=0))


@pytest.mark.parametrize(("buffer", "check", "match"), [
    (SavesOnlyEndedRollouts, "test_checkpoint_with_rollouts_waiting", r"restored: the delivered rollouts .*lost"),
    (RestoresWithoutThePolicy, "test_checkpoint_between_rollouts", r"restored: the delivered rollouts .*stale"),
])
def test_an_on_policy_checkpoint_that_loses_state_fails_the_suite(buffer: type, check: str, match: str) -> None:
    """Each mistake passes the other checkpoint check (the open rollout matters only with rollouts waiting, the
    policy version only where a restored rollout is stale) and fails its own, saying what the restore delivered."""
    ep = type(f"{buffer.__name__}Endpoint", (DequeOnPolicyEndpoint,), {"buffer_type": buffer})
    other = ({"test_checkpoint_between_rollouts", "test_checkpoint_with_rollouts_waiting"} - {check}).pop()
    getattr(freshness_suite(ep), other)()
    with pytest.raises(AssertionError, match=match):
        getattr(freshness_suite(ep), check)()


class SavesBetweenRollouts(DequeOnPolicy):
    """Checkpoints only with nothing waiting for delivery, refusing (a Conduit error) while a rollout waits."""

    def state(self) -> dict[str, Any]:
        if self.sealed or self.open:
            raise ConfigurationError("a rollout is waiting for delivery: checkpoint between rollouts")
        return super().state()


class RefusesAndDrops(SavesBetweenRollouts):
    """Refuses the checkpoint while rollouts wait, but drops them while at it."""

    def state(self) -> dict[str, Any]:
        if self.sealed or self.open:
            self.sealed.clear()
        return super().state()


def test_an_endpoint_that_checkpoints_between_rollouts_only_must_refuse_with_rollouts_waiting() -> None:
    """Declaring CAP_CHECKPOINT_BETWEEN_ROLLOUTS, the buffer that refuses a save while rollouts wait passes both
    checkpoint checks; one whose refusal drops what waits fails, and so does the correct one declaring the full
    CAP_CHECKPOINT."""
    def endpoint(buffer: type[DequeOnPolicy], caps: frozenset[str]) -> type:
        return type(f"{buffer.__name__}Endpoint", (DequeOnPolicyEndpoint,), {"buffer_type": buffer,
                                                                             "capabilities": caps})
    between = frozenset({CAP_CHECKPOINT_BETWEEN_ROLLOUTS})
    for check in ("test_checkpoint_between_rollouts", "test_checkpoint_with_rollouts_waiting"):
        getattr(freshness_suite(endpoint(SavesBetweenRollouts, between)), check)()
    with pytest.raises(AssertionError, match="refused state_dict.* changes nothing"):
        freshness_suite(endpoint(RefusesAndDrops, between)).test_checkpoint_with_rollouts_waiting()
    with pytest.raises(AssertionError, match="declares 'checkpoint'"):
        freshness_suite(endpoint(SavesBetweenRollouts, frozenset({CAP_CHECKPOINT}))
                        ).test_checkpoint_with_rollouts_waiting()


class DeclaresButLacksUpdates(DequeReplayEndpoint):
    """Half implemented: declares CAP_PRIORITIZED and CAP_CHECKPOINT but implements neither's methods."""

    update_priorities = ReplayEndpoint.update_priorities  # type: ignore[assignment]
    state_dict = ReplayEndpoint.state_dict  # type: ignore[assignment]


@pytest.mark.parametrize(("check", "method", "cap"), [
    ("test_prioritized_frequency_proportional_to_priority_alpha", "update_priorities", "CAP_PRIORITIZED"),
    ("test_checkpoint_round_trip", "state_dict", "CAP_CHECKPOINT"),
])
def test_a_declared_capability_without_its_method_says_so(check: str, method: str, cap: str) -> None:
    """A bare NotImplementedError from the base class named neither the method nor the capability declared."""
    with pytest.raises(NotImplementedError) as info:
        getattr(replay_suite(DeclaresButLacksUpdates), check)()
    assert f"DeclaresButLacksUpdates.{method}" in str(info.value) and cap in str(info.value), str(info.value)


# -- the docs an outsider reads ----------------------------------------------------------------------------------
def test_the_endpoint_contract_is_written_where_the_author_reads_it() -> None:
    """The endpoint methods said only what to implement, not what the suites require of them: ``update_priorities``,
    ``state_dict`` and ``load_state_dict`` had no docstring (which errors, evicted handles, what to save, units), nor
    did the make_* arguments; ``Minibatch.version`` was "the policy version the adapter reports" (the learner's?); no
    README said how to register an adapter. The author read the suites' source to find out."""
    import inspect

    from conduit.testing import Minibatch

    facts: dict[str, tuple[str | None, tuple[str, ...]]] = {
        "ReplayEndpoint": (ReplayEndpoint.__doc__, ("capacity", "in items", "alpha", "beta", "seed", "global RNG")),
        "ReplayEndpoint.insert": (ReplayEndpoint.insert.__doc__, ("oldest", "largest priority ever set")),
        "ReplayEndpoint.sample": (ReplayEndpoint.sample.__doc__, ("EmptyBufferError", "min_j", "live", "prioritized")),
        "ReplayEndpoint.update_priorities": (ReplayEndpoint.update_priorities.__doc__,
                                             ("PriorityError", "evicted", "alpha", "CAP_PRIORITIZED")),
        "ReplayEndpoint.state_dict": (ReplayEndpoint.state_dict.__doc__, ("RNG", "torch.save", "CAP_CHECKPOINT")),
        "ReplayEndpoint.load_state_dict": (ReplayEndpoint.load_state_dict.__doc__, ("seed", "handles drawn before")),
        "OnPolicyEndpoint": (OnPolicyEndpoint.__doc__, ("max_staleness", "on_stale", "seed")),
        "OnPolicyEndpoint.ingest": (OnPolicyEndpoint.ingest.__doc__, ("another version",)),
        "OnPolicyEndpoint.set_policy_version": (OnPolicyEndpoint.set_policy_version.__doc__,
                                                ("version - v > max_staleness", '"drop"', '"raise"')),
        "OnPolicyEndpoint.consume": (OnPolicyEndpoint.consume.__doc__, ("permutation", "N // M")),
        "OnPolicyEndpoint.state_dict": (OnPolicyEndpoint.state_dict.__doc__,
                                        ("the open one", "policy version", "CAP_CHECKPOINT_BETWEEN_ROLLOUTS")),
        "OnPolicyEndpoint.load_state_dict": (OnPolicyEndpoint.load_state_dict.__doc__,
                                             ("any ``seed``", "exactly once per epoch")),
        "Minibatch": (inspect.getsource(Minibatch), ("ingested with", "not the learner's", "counted from 0")),
    }
    missing = {name: [f for f in want if f not in " ".join((doc or "").split())] for name, (doc, want) in facts.items()}
    assert not any(missing.values()), f"the endpoint docs do not say: { {k: v for k, v in missing.items() if v} }"
    readme = (ROOT / "packages/conduit-core/README.md").read_text()
    section = readme.split("## The conformance suite", 1)[-1] if "## The conformance suite" in readme else ""
    want = ('[project.entry-points."conduit.conformance"]', "EndpointFactory", "make_replay", "make_on_policy",
            "update_priorities", "load_state_dict", "end_rollout", "set_policy_version", "CAP_CONCURRENT_INGEST",
            "KNOWN_GAPS", "xfail")
    assert section and all(w in section for w in want), (
        f"packages/conduit-core/README.md has no conformance-suite section naming "
        f"{[w for w in want if w not in section]}")
