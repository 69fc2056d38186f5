"""What a ``tq.init`` that fails after the Conduit bootstrap leaves, and how ``tq.close()`` clears it.

TransferQueue 0.1.x's ``tq.init`` starts its controller, runs the backend's bootstrap (which starts the Conduit units,
Ray actors), stores its config on the controller, then, with ``metrics.enabled``, starts its metrics exporter (binding
``metrics.port`` only then), and last builds this process's client. An error in the steps after the bootstrap reaches
the caller with the controller running, its config stored, and the units running, recorded in TransferQueue's storage
record only: no client, so no Conduit storage manager whose ``close()`` stops them.

What stops them is ``tq.close()`` dropping that record: it holds the only handles the units' creator has, and Ray
stops an actor once those are gone. These tests hold that (the units must stay reachable from nowhere else in
Conduit, or they would outlive ``tq.close()``), and show why a retry needs ``tq.close()`` first: a ``tq.init`` without
it attaches to the failed start's controller and ignores the config it is given, the failed step skipped.

The failure is TransferQueue's own, from a real bad input: ``metrics.port`` names a port another socket listens on.
The run id ``bootstrap`` draws is pinned (its ``uuid4``, as a seed would), so that the test can find the units.
"""

from __future__ import annotations

import contextlib
import socket
import types
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from tensordict import TensorDict

pytestmark = [pytest.mark.requires("verl"), pytest.mark.slow]


def _tq_init(**metrics: Any) -> Any:
    import transfer_queue as tq
    from omegaconf import OmegaConf

    return tq.init(OmegaConf.create({"metrics": metrics, "backend": {
        "storage_backend": "Conduit", "Conduit": {"num_units": 2, "capacity": 4, "mean_length": 2}}}))


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another socket listens on (no SO_REUSEADDR: the metrics exporter's bind of it is refused)."""
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    try:
        yield int(taken.getsockname()[1])
    finally:
        taken.close()


def _failed_init(port: int, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """A ``tq.init`` whose metrics exporter cannot bind ``port``; the units it had started (alive)."""
    import ray
    from conduit_verl import tq_storage

    pinned = uuid.uuid4()
    monkeypatch.setattr(tq_storage, "uuid", types.SimpleNamespace(uuid4=lambda: pinned))
    try:
        with pytest.raises(Exception, match="in use"):
            _tq_init(enabled=True, port=port)
    finally:
        monkeypatch.undo()  # the next start draws a run id of its own, as any tq.init does
    units = [ray.get_actor(tq_storage.unit_name(pinned.hex[:12], r), namespace=tq_storage.NAMESPACE) for r in (0, 1)]
    assert all(ray.get([u.stats.remote() for u in units], timeout=60)), "the bootstrap had not started the units"
    return units


def _stopped(units: list[Any]) -> None:
    import ray
    from ray.exceptions import RayActorError

    for unit in units:  # answering as a dead actor
        with pytest.raises(RayActorError):
            ray.get(unit.stats.remote(), timeout=60)


def _kill(units: list[Any]) -> None:
    """(Should a test fail with the units alive: stop them for the tests that follow.)"""
    import ray

    for u in units:
        with contextlib.suppress(Exception):
            ray.kill(u)


def _round_trip() -> None:
    import transfer_queue as tq

    tq.kv_batch_put(keys=["k0", "k1"], partition_id="p", tags=[{}, {}],
                    fields=TensorDict({"v": torch.arange(4.0).reshape(2, 2)}, batch_size=[2]))
    got = tq.kv_batch_get(keys=["k1", "k0"], partition_id="p", select_fields=["v"])["v"]
    assert [r.tolist() for r in got.unbind()] == [[2.0, 3.0], [0.0, 1.0]]


def test_close_after_a_tq_init_that_failed_past_the_bootstrap_stops_its_units(
        ray_local: Any, taken_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import transfer_queue as tq
    import verl  # noqa: F401  (verl loads its plugins: conduit-verl registers the "Conduit" backend)

    units = _failed_init(taken_port, monkeypatch)
    try:
        tq.close()  # as the caller's cleanup does (no client was built: the record is all it drops)
        _stopped(units)

        _tq_init(enabled=True, port=0)  # the corrected config starts afresh
        try:
            assert tq.get_metrics_endpoint() is not None
            _round_trip()
        finally:
            tq.close()
    finally:
        _kill(units)


def test_a_tq_init_again_without_close_attaches_to_the_failed_start(
        ray_local: Any, taken_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import transfer_queue as tq
    import verl  # noqa: F401  (verl loads its plugins: conduit-verl registers the "Conduit" backend)

    units = _failed_init(taken_port, monkeypatch)
    try:
        _tq_init(enabled=True, port=0)  # no tq.close() first: attaches, the corrected config ignored
        try:
            assert tq.get_metrics_endpoint() is None, "the failed step ran after all"
            served = tq.get_client().storage_manager.units
            assert [u._actor_id for u in served] == [u._actor_id for u in units]
            _round_trip()  # on the failed start's units
        finally:
            tq.close()
        _stopped(units)
    finally:
        _kill(units)
