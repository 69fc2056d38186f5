"""What the conformance suites drive: a buffer seen through an adapter's own interface.

An adapter implements these over its framework's buffer calls (for RLlib: episodes in,
episodes out; for verl: DataProto through the storage backend; for SRL: ``put``/``get``).
Items are tagged with integer ids so the suite can check what comes out. Errors must be
Conduit's typed errors (or subclasses), raised through the framework's call path.

The docstrings below are the contract the suites check; each suite test's docstring says what it
checks and, under "Troubleshooting", the usual cause of its failure. An endpoint need not subclass
these classes (the suites call only the methods named here), but the base classes' defaults say
which capability a method belongs to when it is missing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "ReplayEndpoint",
    "OnPolicyEndpoint",
    "EndpointFactory",
    "discover_endpoints",
    "Draw",
    "Minibatch",
    "CAP_PRIORITIZED",
    "CAP_CHECKPOINT",
    "CAP_CHECKPOINT_BETWEEN_ROLLOUTS",
    "CAP_CONCURRENT_INGEST",
]

#: the endpoint supports prioritized sampling (``prioritized=True``) and priority updates
CAP_PRIORITIZED = "prioritized"
#: the endpoint round-trips ``state_dict``/``load_state_dict`` (on-policy: also while rollouts wait for delivery, the
#: open one included)
CAP_CHECKPOINT = "checkpoint"
#: on-policy only: ``state_dict``/``load_state_dict`` round-trip between rollouts, with nothing waiting for delivery;
#: while something waits, ``state_dict`` raises a Conduit error (a state that left it out would lose it)
CAP_CHECKPOINT_BETWEEN_ROLLOUTS = "checkpoint_between_rollouts"
#: ``insert`` may be called from many threads at once, also while another thread samples and updates priorities
CAP_CONCURRENT_INGEST = "concurrent_ingest"


@dataclass
class Draw:
    """One replay sample as the learner sees it."""

    #: the ids of the drawn items, in draw order
    ids: np.ndarray
    #: what the adapter's ``update_priorities`` takes to name these items, one per drawn row;
    #: it must support indexing with an integer NumPy array (a NumPy array or a torch tensor)
    handles: Any = None
    #: importance weights, for prioritized endpoints
    weights: np.ndarray | None = None


@dataclass
class Minibatch:
    """One on-policy minibatch as the learner sees it."""

    #: the ids of the minibatch's items
    ids: np.ndarray
    #: the policy version that produced the minibatch's items: the ``version`` they were ingested with (the
    #: rollout's), not the learner's policy version at delivery
    version: int
    #: the epoch the minibatch belongs to, counted from 0 within its rollout
    epoch: int


class ReplayEndpoint(ABC):
    """A replay buffer reached through an adapter. ``make_replay`` returns an EMPTY one.

    ``make_replay(capacity=..., prioritized=..., alpha=..., beta=..., seed=...)`` takes: ``capacity``, in items
    (transitions); ``prioritized``, proportional prioritized sampling instead of uniform; ``alpha``, the priority
    exponent; ``beta``, the exponent of the importance weights :meth:`sample` returns; ``seed``, from which every
    draw follows (the same seed and calls give the same draws, also with two endpoints used in turn: no global RNG).
    An endpoint that prefetches (``priority_staleness > 0``) promises that only where nothing is inserted and no
    priority is updated between its draws: a prefetch drawn while the caller inserts or updates depends on timing
    (within the staleness it declares), and the suites' determinism checks update no priority for it.
    """

    #: capabilities this endpoint declares (CAP_* constants); the suites read them
    capabilities: frozenset[str] = frozenset()
    #: prioritized only: how many ``update_priorities`` calls a draw may precede (a prefetching
    #: adapter declares its delivery granularity g_del here; 0 means every draw sees every update)
    priority_staleness: int = 0

    @abstractmethod
    def insert(self, ids: np.ndarray) -> None:
        """Store one item per id, in order (the adapter may use any number of framework calls).

        A full buffer evicts its oldest items first (FIFO). Prioritized: a new item gets the largest priority ever
        set (1.0 before any update): a running maximum that every update may raise and nothing lowers (not the
        eviction of the item that held it, nor a lower priority set for that item later).
        """

    @abstractmethod
    def sample(self, n: int) -> Draw:
        """Draw ``n`` items with replacement, raising ``AssertionError`` when a drawn item's payload
        does not match its id.

        Each of the ``n`` items is drawn independently from the live items: uniformly, or prioritized with
        probability ``P(i) = p_i^alpha / sum_j p_j^alpha``. The :class:`Draw` holds exactly ``n`` ids, ``n``
        handles and, prioritized, ``n`` importance weights ``(N P(i))^-beta / (N min_j P(j))^-beta``, with ``N``
        and ``min_j`` over the items live now (so the least likely live item has weight 1).

        Raises:
            conduit.EmptyBufferError: the buffer holds no item (uniform and prioritized alike).
        """

    @abstractmethod
    def __len__(self) -> int:
        """Number of live items."""

    @abstractmethod
    def contents(self) -> np.ndarray:
        """The ids of all live items, in any order."""

    def verified_contents(self) -> np.ndarray | None:
        """The ids of all live items, each read back with its payload and checked against its id.

        Raises ``AssertionError`` naming the ids whose stored payload does not match them. The
        default returns ``None`` (the endpoint cannot read payloads in place): the suites then
        check payloads through :meth:`sample`, which must check every item it draws.
        """
        return None

    def update_priorities(self, handles: Any, priorities: np.ndarray) -> None:
        """Give the items named by ``handles`` (a :attr:`Draw.handles`, or rows of it) the ``priorities`` (float64,
        one per handle, as the learner computes them: e.g. TD errors, not yet raised to ``alpha``; negative
        ones are left to the framework). Needed for
        :data:`CAP_PRIORITIZED`.

        A handle whose item was evicted since its draw is ignored (never applied to the slot's new occupant); a
        handle whose item is still live is applied, however many other items were evicted since. The largest
        priority set is kept for new items (see :meth:`insert`).

        Raises:
            conduit.PriorityError: a priority is NaN or infinite, or there is not one per handle; no priority
                of the call is changed, not even those before the bad one.
        """
        raise NotImplementedError(
            f"{type(self).__name__}.update_priorities is not implemented, and the endpoint declares "
            f"CAP_PRIORITIZED: implement it (see ReplayEndpoint.update_priorities), or do not declare the capability")

    def state_dict(self) -> Any:
        """Everything a restore needs: the items and the write position (or live count), and the priorities, the
        largest priority set, the sampler's RNG state and whatever the handles refer to. Picklable (tensors and
        plain Python values, as ``torch.save``/``torch.load`` carry). Needed for :data:`CAP_CHECKPOINT`."""
        raise NotImplementedError(
            f"{type(self).__name__}.state_dict is not implemented, and the endpoint declares CAP_CHECKPOINT: "
            f"implement state_dict and load_state_dict, or do not declare the capability")

    def load_state_dict(self, state: Any) -> None:
        """Restore a :meth:`state_dict` into an endpoint built with the same ``capacity`` and kind, but any
        ``seed``: it then holds the same items, continues the same draws, evicts and gives new items the same
        priority as the saved endpoint would, and takes priority updates through handles drawn before the save.
        Needed for :data:`CAP_CHECKPOINT`."""
        raise NotImplementedError(
            f"{type(self).__name__}.load_state_dict is not implemented, and the endpoint declares CAP_CHECKPOINT: "
            f"implement state_dict and load_state_dict, or do not declare the capability")

    def close(self) -> None:  # noqa: B027
        """Release framework resources."""


class OnPolicyEndpoint(ABC):
    """An on-policy buffer reached through an adapter. ``make_on_policy`` returns an EMPTY one.

    ``make_on_policy(num_minibatches=M, num_epochs=E, max_staleness=..., on_stale=..., seed=...)`` takes: ``M``
    minibatches per epoch and ``E`` epochs per rollout; ``max_staleness``, in policy versions; ``on_stale``,
    ``"drop"`` or ``"raise"`` (see :meth:`set_policy_version`); ``seed``, from which every epoch's shuffle follows
    (no global RNG).
    """

    #: capabilities this endpoint declares: :data:`CAP_CHECKPOINT` or :data:`CAP_CHECKPOINT_BETWEEN_ROLLOUTS`
    capabilities: frozenset[str] = frozenset()

    @abstractmethod
    def ingest(self, ids: np.ndarray, version: int) -> None:
        """Add items produced by policy ``version`` to the current rollout.

        The calls of one version form one rollout; items of another version first close the open rollout (a
        minibatch never mixes versions). Versions do not go back: items of a version lower than the open rollout's
        or the last ended rollout's (a late producer) are refused with a Conduit error that changes nothing, or
        dropped; they never reach the learner after a newer version's."""

    @abstractmethod
    def end_rollout(self) -> None:
        """Close the current rollout: it can be delivered now (an open rollout never is). Rollouts are delivered
        oldest first. With nothing ingested since the last rollout closed (or ever), it closes nothing: no empty
        rollout is delivered."""

    @abstractmethod
    def set_policy_version(self, version: int) -> None:
        """The learner's policy is now at ``version``.

        Staleness is judged when a rollout is delivered: a rollout of version ``v`` is stale when
        ``version - v > max_staleness``. With ``on_stale="drop"`` it is dropped and the next one considered; with
        ``"raise"`` :meth:`consume` raises and the rollout stays, unchanged, until a policy version allows it.
        """

    @abstractmethod
    def consume(self) -> list[Minibatch]:
        """Deliver the next rollout completely: every minibatch of every epoch, in order.

        Each of the ``E`` epochs is a fresh seeded permutation of all the rollout's items (each exactly once), cut
        into ``M`` minibatches of ``N // M`` or ``N // M + 1`` items; all of an epoch's minibatches come before the
        next epoch's.

        Raises:
            conduit.EmptyBufferError: no rollout is waiting.
            conduit.StaleExperienceError: the next rollout is too stale and the policy is to raise.
        """

    def state_dict(self) -> Any:
        """Everything a restore needs: the rollouts waiting for delivery (ended, and the open one, which later
        ingests of its version join), the policy version, the version of the last ended rollout (versions do not go
        back across a restore) and the shuffle RNG's state. Picklable (tensors and plain Python values, as
        ``torch.save``/``torch.load`` carry); taking it changes nothing the endpoint delivers. Needed for
        :data:`CAP_CHECKPOINT`.

        With :data:`CAP_CHECKPOINT_BETWEEN_ROLLOUTS` instead, it is needed only with nothing waiting (every ended
        rollout delivered, none open); while something waits it raises a :class:`conduit.ConduitError` and changes
        nothing.
        """
        raise NotImplementedError(
            f"{type(self).__name__}.state_dict is not implemented, and the endpoint declares CAP_CHECKPOINT or "
            f"CAP_CHECKPOINT_BETWEEN_ROLLOUTS: implement state_dict and load_state_dict, or do not declare the "
            f"capability")

    def load_state_dict(self, state: Any) -> None:
        """Restore a :meth:`state_dict` into an endpoint built with the same ``num_minibatches``, ``num_epochs``,
        ``max_staleness`` and ``on_stale``, but any ``seed``: from there it delivers exactly what the saved endpoint
        delivers (the same minibatches, in the same order): each waiting rollout whole, its items exactly once per
        epoch, nothing delivered before the save again, staleness judged against the saved policy version. Needed
        for :data:`CAP_CHECKPOINT` and :data:`CAP_CHECKPOINT_BETWEEN_ROLLOUTS`."""
        raise NotImplementedError(
            f"{type(self).__name__}.load_state_dict is not implemented, and the endpoint declares CAP_CHECKPOINT or "
            f"CAP_CHECKPOINT_BETWEEN_ROLLOUTS: implement state_dict and load_state_dict, or do not declare the "
            f"capability")

    def close(self) -> None:  # noqa: B027
        """Release framework resources."""


@dataclass(frozen=True)
class EndpointFactory:
    """What an adapter registers under the ``conduit.conformance`` entry-point group.

    ``integration-tests/`` loads every registered factory and runs the suites over it.
    A factory that cannot build one kind of endpoint leaves it ``None`` (and the tests of
    that kind are skipped with that reason).
    """

    name: str
    make_replay: Callable[..., ReplayEndpoint] | None = None
    make_on_policy: Callable[..., OnPolicyEndpoint] | None = None


def discover_endpoints() -> list[EndpointFactory]:
    """Every factory registered under ``conduit.conformance``, by name.

    A registration that fails to load raises: a broken adapter is an error, not a skip. So do two
    factories with one name (:class:`~conduit.errors.ConfigurationError`): the tests generated for
    one would replace the other's, and that adapter would go untested.
    """
    from importlib.metadata import entry_points

    from conduit.errors import ConfigurationError

    found: dict[str, tuple[EndpointFactory, str]] = {}
    for ep in sorted(entry_points(group="conduit.conformance"), key=lambda e: e.name):
        factory = ep.load()
        if not isinstance(factory, EndpointFactory):
            raise TypeError(f"entry point {ep.name!r} ({ep.value}) is not a conduit.testing.EndpointFactory")
        if factory.name in found:
            raise ConfigurationError(
                f"entry points {found[factory.name][1]} and {ep.name!r} ({ep.value}) both register an "
                f"EndpointFactory named {factory.name!r}; the conformance tests of one would replace the other's: "
                f"give each adapter's factory its own name")
        found[factory.name] = (factory, f"{ep.name!r} ({ep.value})")
    return [f for f, _ in found.values()]
