"""Conduit core's own endpoints: the reference the suites are proven against."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from conduit.edp import ExperienceDataPlane
from conduit.schema import ExperienceSchema, Field
from conduit.semantics import OnPolicy, PrioritizedSampler, Replay, Semantics, UniformSampler
from conduit.testing.endpoints import (
    CAP_CHECKPOINT,
    CAP_CONCURRENT_INGEST,
    CAP_PRIORITIZED,
    Draw,
    EndpointFactory,
    Minibatch,
    OnPolicyEndpoint,
    ReplayEndpoint,
)

__all__ = ["CoreReplayEndpoint", "CoreOnPolicyEndpoint", "ID_SCHEMA", "ENDPOINTS"]

#: items carry their id and a payload derived from it, so corruption is visible too
ID_SCHEMA = ExperienceSchema(id=Field((), torch.int64), obs=Field((3,), torch.float32))


def id_batch(ids: np.ndarray) -> dict[str, torch.Tensor]:
    t = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    return {"id": t, "obs": t.to(torch.float32)[:, None].expand(-1, 3).contiguous()}


def check_payload(batch: Any) -> np.ndarray:
    """The ids of ``batch``; ``AssertionError`` naming the ids whose ``obs`` payload is not derived from them."""
    ids = batch["id"].cpu().numpy().copy()  # the batch may sit on a GPU tier's device
    expected = batch["id"].to(torch.float32)[:, None].expand(-1, ID_SCHEMA["obs"].shape[0])
    bad = (batch["obs"] != expected).any(dim=1).cpu()
    assert not bad.any(), (f"payload does not match its id for {int(bad.sum())} of {len(ids)} items, "
                           f"e.g. ids {ids[bad.numpy()][:5].tolist()} carry obs {batch['obs'][bad][:5, 0].tolist()}")
    return ids


class CoreReplayEndpoint(ReplayEndpoint):
    """An :class:`~conduit.ExperienceDataPlane` with replay semantics, driven directly.

    Another buffer with the data plane's methods (``ingest``, ``deliver``, ``flush``, ...)
    reuses these endpoints by overriding :meth:`_build`.
    """

    capabilities = frozenset({CAP_PRIORITIZED, CAP_CHECKPOINT, CAP_CONCURRENT_INGEST})

    def __init__(self, *, capacity: int, prioritized: bool = False, alpha: float = 0.6, beta: float = 0.4,
                 seed: int = 0, **edp_kwargs: Any) -> None:
        sampler = PrioritizedSampler(alpha=alpha, beta=beta) if prioritized else UniformSampler()
        self.edp = self._build(capacity, Replay(sampler, seed=seed), **edp_kwargs)
        self.priority_staleness = int(getattr(self.edp.scheduler, "priority_staleness", 0))

    def _build(self, capacity: int, semantics: Semantics, **kwargs: Any) -> Any:
        """The buffer under test, holding :data:`ID_SCHEMA` items."""
        return ExperienceDataPlane(ID_SCHEMA, capacity=capacity, semantics=semantics, **kwargs)

    def insert(self, ids: np.ndarray) -> None:
        self.edp.ingest(id_batch(ids))

    def sample(self, n: int) -> Draw:
        self.edp.flush()
        batch, info = self.edp.deliver(n)
        w = None if info.weights is None else info.weights.cpu().numpy().copy()
        return Draw(check_payload(batch), info.handles.clone(), w)

    def update_priorities(self, handles: Any, priorities: np.ndarray) -> None:
        self.edp.update_priorities(handles, torch.as_tensor(priorities))

    def __len__(self) -> int:
        self.edp.flush()
        return len(self.edp)

    def contents(self) -> np.ndarray:
        st = self.edp.state_dict()["storage"]
        return st["data"]["id"].numpy()

    def verified_contents(self) -> np.ndarray:
        self.edp.flush()
        return check_payload(self.edp.state_dict()["storage"]["data"])

    def state_dict(self) -> Any:
        return self.edp.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.edp.load_state_dict(state)

    def close(self) -> None:
        self.edp.close()


class CoreOnPolicyEndpoint(OnPolicyEndpoint):
    """An :class:`~conduit.ExperienceDataPlane` with on-policy semantics, driven directly
    (another buffer with its methods: override :meth:`_build`)."""

    capabilities = frozenset({CAP_CHECKPOINT})

    def __init__(self, *, num_minibatches: int, num_epochs: int, max_staleness: int = 0, on_stale: str = "drop",
                 seed: int = 0, capacity: int = 4096, **edp_kwargs: Any) -> None:
        sem = OnPolicy(num_minibatches=num_minibatches, num_epochs=num_epochs, max_staleness=max_staleness,
                       on_stale=on_stale, seed=seed)  # type: ignore[arg-type]
        self.edp = self._build(capacity, sem, **edp_kwargs)

    def _build(self, capacity: int, semantics: Semantics, **kwargs: Any) -> Any:
        return ExperienceDataPlane(ID_SCHEMA, capacity=capacity, semantics=semantics, **kwargs)

    def ingest(self, ids: np.ndarray, version: int) -> None:
        self.edp.ingest(id_batch(ids), version=version)

    def end_rollout(self) -> None:
        self.edp.seal()

    def set_policy_version(self, version: int) -> None:
        self.edp.set_policy_version(version)

    def consume(self) -> list[Minibatch]:
        out: list[Minibatch] = []
        while True:
            batch, info = self.edp.deliver()
            assert info.version is not None and info.epoch is not None
            out.append(Minibatch(check_payload(batch), info.version, info.epoch))
            if info.last:
                return out

    def state_dict(self) -> Any:
        return self.edp.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.edp.load_state_dict(state)

    def close(self) -> None:
        self.edp.close()


#: core's registration in the ``conduit.conformance`` entry-point group
ENDPOINTS = EndpointFactory("core", make_replay=CoreReplayEndpoint, make_on_policy=CoreOnPolicyEndpoint)
