"""What the conformance suites drive: a buffer seen through an adapter's own interface.

An adapter implements these over its framework's buffer calls (for RLlib: episodes in,
episodes out; for verl: DataProto through the storage backend; for SRL: ``put``/``get``).
Items are tagged with integer ids so the suite can check what comes out. Errors must be
Conduit's typed errors (or subclasses), raised through the framework's call path.
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
    "CAP_CONCURRENT_INGEST",
]

#: the endpoint supports prioritized sampling (``prioritized=True``) and priority updates
CAP_PRIORITIZED = "prioritized"
#: the endpoint round-trips ``state_dict``/``load_state_dict``
CAP_CHECKPOINT = "checkpoint"
#: ``insert`` may be called from many threads at once
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

    ids: np.ndarray
    #: the policy version the adapter reports for this minibatch
    version: int
    epoch: int


class ReplayEndpoint(ABC):
    """A replay buffer reached through an adapter. ``make_replay`` returns an EMPTY one."""

    #: capabilities this endpoint declares (CAP_* constants); the suites read them
    capabilities: frozenset[str] = frozenset()
    #: prioritized only: how many ``update_priorities`` calls a draw may precede (a prefetching
    #: adapter declares its delivery granularity g_del here; 0 means every draw sees every update)
    priority_staleness: int = 0

    @abstractmethod
    def insert(self, ids: np.ndarray) -> None:
        """Store one item per id, in order (the adapter may use any number of framework calls)."""

    @abstractmethod
    def sample(self, n: int) -> Draw:
        """Draw ``n`` items with replacement, raising ``AssertionError`` when a drawn item's payload
        does not match its id."""

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
        raise NotImplementedError

    def state_dict(self) -> Any:
        raise NotImplementedError

    def load_state_dict(self, state: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:  # noqa: B027
        """Release framework resources."""


class OnPolicyEndpoint(ABC):
    """An on-policy buffer reached through an adapter. ``make_on_policy`` returns an EMPTY one."""

    capabilities: frozenset[str] = frozenset()

    @abstractmethod
    def ingest(self, ids: np.ndarray, version: int) -> None:
        """Add items produced by policy ``version`` to the current rollout."""

    @abstractmethod
    def end_rollout(self) -> None:
        """Close the current rollout."""

    @abstractmethod
    def set_policy_version(self, version: int) -> None:
        """The learner's policy is now at ``version``."""

    @abstractmethod
    def consume(self) -> list[Minibatch]:
        """Deliver the next rollout completely: every minibatch of every epoch, in order.

        Raises:
            conduit.EmptyBufferError: no rollout is waiting.
            conduit.StaleExperienceError: the next rollout is too stale and the policy is to raise.
        """

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
