"""``tq.init`` starts the Conduit storage units (Ray actors) one by one; when one of them cannot be started, the units
it had already started are stopped before the error reaches the caller.

Before, only a unit that failed after all were started (not answering in time, or failing in its own process) stopped
the others: when Ray refused the start of unit ``k`` itself (its name taken by another actor), units ``0..k-1`` stayed
alive, each a process holding memory (and ``unit_num_cpus``), and nothing stopped them: the only handles to
them were in the error's traceback, so they lived as long as the caller held the error (an ``except`` block retrying
``tq.init``, a logger or REPL keeping it), and Ray stopped them only once it was dropped.

The refusal here is Ray's own: another actor already holds the name unit 2 of the run is started under. The run id
``bootstrap`` draws is pinned (its ``uuid4``, as a seed would), so that the test can take that name first.
"""

from __future__ import annotations

import types
import uuid
from typing import Any

import pytest
import torch
from tensordict import TensorDict

pytestmark = [pytest.mark.requires("verl"), pytest.mark.slow]


def test_the_units_started_before_a_refused_unit_are_stopped_and_a_new_start_works(
        tq_session: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray
    import transfer_queue as tq
    import verl  # noqa: F401  (verl loads its plugins: conduit-verl registers the "Conduit" backend)
    from conduit_verl import tq_storage
    from ray.exceptions import ActorAlreadyExistsError, RayActorError

    pinned = uuid.uuid4()
    run = pinned.hex[:12]

    @ray.remote(num_cpus=0)
    class Squatter:
        def ready(self) -> bool:
            return True

    # The failed start's error is held while its units are checked and TransferQueue is started again, as by an
    # ``except`` block that retries
    squatter = Squatter.options(name=tq_storage.unit_name(run, 2),  # type: ignore[attr-defined]
                                namespace=tq_storage.NAMESPACE).remote()
    ray.get(squatter.ready.remote())
    try:
        monkeypatch.setattr(tq_storage, "uuid", types.SimpleNamespace(uuid4=lambda: pinned))
        with pytest.raises(ActorAlreadyExistsError, match=tq_storage.unit_name(run, 2)) as refused:
            tq_session("Conduit", num_units=3, capacity=4, mean_length=2)
        monkeypatch.undo()  # a retry draws a run id of its own, as any tq.init does

        assert run not in tq_storage._OWNED_RUNS
        for rank in (0, 1):  # started before Ray refused unit 2: stopped (gone, or answering as a dead actor)
            try:
                unit = ray.get_actor(tq_storage.unit_name(run, rank), namespace=tq_storage.NAMESPACE)
            except ValueError:
                continue
            with pytest.raises(RayActorError):
                ray.get(unit.stats.remote(), timeout=60)
        assert ray.get(squatter.ready.remote()), "the actor holding the name is not the start's to stop"

        tq_session("Conduit", num_units=3, capacity=4, mean_length=2)
        tq.kv_batch_put(keys=["k0", "k1", "k2"], partition_id="p",
                        fields=TensorDict({"v": torch.arange(6.0).reshape(3, 2)}, batch_size=[3]), tags=[{}, {}, {}])
        got = tq.kv_batch_get(keys=["k2", "k0"], partition_id="p", select_fields=["v"])["v"]
        assert [r.tolist() for r in got.unbind()] == [[4.0, 5.0], [0.0, 1.0]]
        assert refused.value is not None  # (held to here, as by a caller that retries while handling it)
    finally:
        ray.kill(squatter)
        for rank in (0, 1):  # (left running before the fix: stop them for the tests that follow)
            try:
                ray.kill(ray.get_actor(tq_storage.unit_name(run, rank), namespace=tq_storage.NAMESPACE))
            except ValueError:
                pass
