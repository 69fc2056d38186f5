"""Conformance endpoints: the suites drive a Conduit buffer through SRL's calls (``put``/``get``).

Items are samples of :func:`~conduit_srl.testing.records.make_sample` whose ``id`` field carries
the item id and whose ``obs`` repeats it (so corruption shows). A replay draw of ``n`` is one
``get`` of ``n`` samples; an on-policy rollout is ``put`` with its version in
``policy_version_steps`` and read back through the entry's sample (version) and ``reuses`` (epoch).
Checkpoints go through ``pickle``, as SRL saves buffers.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
from conduit.testing import (
    CAP_CHECKPOINT,
    CAP_CONCURRENT_INGEST,
    CAP_PRIORITIZED,
    Draw,
    EndpointFactory,
    Minibatch,
    OnPolicyEndpoint,
    ReplayEndpoint,
)

from conduit_srl.assembler import ReplayEntry
from conduit_srl.buffer import ConduitBuffer
from conduit_srl.testing.records import make_sample

__all__ = ["SrlReplayEndpoint", "SrlOnPolicyEndpoint", "ENDPOINTS", "entry_ids"]


def entry_ids(entry: ReplayEntry) -> np.ndarray:
    """The ids of an entry's samples, checking that every time step and the payload agree."""
    s = entry.sample
    ids = np.asarray(s.id)
    assert (ids == ids[:1]).all(), "a sample's id changed along its time axis"
    assert np.array_equal(np.asarray(s.obs)[..., 0], ids.astype(np.float32)), "payload does not match its id"
    return ids[0].copy()


class SrlReplayEndpoint(ReplayEndpoint):
    """A replay (or prioritized) Conduit buffer reached through SRL's buffer calls."""

    capabilities = frozenset({CAP_PRIORITIZED, CAP_CHECKPOINT, CAP_CONCURRENT_INGEST})

    def __init__(self, *, capacity: int, prioritized: bool = False, alpha: float = 0.6, beta: float = 0.4,
                 seed: int = 0, **buffer_args: Any) -> None:
        args: dict[str, Any] = {"semantics": "prioritized" if prioritized else "replay", "batch_size": 1,
                                "capacity": capacity, "warmup": 1, "seed": seed, **buffer_args}
        if prioritized:
            args.update(alpha=alpha, beta=beta)
        self.buffer = ConduitBuffer(**args)
        self.priority_staleness = self.buffer.priority_staleness

    def insert(self, ids: np.ndarray) -> None:
        self.buffer.put_batch(make_sample(ids, time_steps=1, batched=True))

    def sample(self, n: int) -> Draw:
        self.buffer.flush()
        entry = self.buffer.get(n)
        return Draw(entry_ids(entry), entry.sampling_indices, entry.weights)

    def update_priorities(self, handles: Any, priorities: np.ndarray) -> None:
        self.buffer.update_priorities(handles, priorities)

    def __len__(self) -> int:
        return len(self.buffer)

    def contents(self) -> np.ndarray:
        edp = self.buffer.edp
        if edp is None:
            return np.empty(0, dtype=np.int64)
        self.buffer.flush()
        return edp.storage.state_dict()["data"]["id"].numpy()[:, 0].copy()

    def state_dict(self) -> Any:
        return pickle.dumps(self.buffer)

    def load_state_dict(self, state: Any) -> None:
        self.buffer.close()
        self.buffer = pickle.loads(state)

    def close(self) -> None:
        self.buffer.close()


class SrlOnPolicyEndpoint(OnPolicyEndpoint):
    """An on-policy Conduit buffer reached through SRL's buffer calls (plus ``seal``/``set_policy_version``)."""

    capabilities = frozenset({CAP_CHECKPOINT})

    def __init__(self, *, num_minibatches: int, num_epochs: int, max_staleness: int = 0, on_stale: str = "drop",
                 seed: int = 0, capacity: int = 4096, **buffer_args: Any) -> None:
        self.buffer = ConduitBuffer(semantics="on_policy", capacity=capacity, num_minibatches=num_minibatches,
                                    num_epochs=num_epochs, max_staleness=max_staleness, on_stale=on_stale,
                                    seed=seed, **buffer_args)

    def ingest(self, ids: np.ndarray, version: int) -> None:
        self.buffer.put_batch(make_sample(ids, time_steps=1, version=version, batched=True))

    def end_rollout(self) -> None:
        self.buffer.seal()

    def set_policy_version(self, version: int) -> None:
        self.buffer.set_policy_version(version)

    def consume(self) -> list[Minibatch]:
        out: list[Minibatch] = []
        while True:
            entry = self.buffer.get()
            version = entry.sample.min_of("policy_version_steps")
            assert entry.sample.max_of("policy_version_steps") == version, "a minibatch mixes policy versions"
            out.append(Minibatch(entry_ids(entry), int(version), int(entry.reuses)))
            assert entry.info is not None
            if entry.info.last:
                return out

    def state_dict(self) -> Any:
        return pickle.dumps(self.buffer)

    def load_state_dict(self, state: Any) -> None:
        self.buffer.close()
        self.buffer = pickle.loads(state)

    def close(self) -> None:
        self.buffer.close()


#: conduit-srl's registration in the ``conduit.conformance`` entry-point group
ENDPOINTS = EndpointFactory("srl", make_replay=SrlReplayEndpoint, make_on_policy=SrlOnPolicyEndpoint)
