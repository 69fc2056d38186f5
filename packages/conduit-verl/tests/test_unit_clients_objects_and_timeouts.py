"""Conduit's TransferQueue storage units beside more than one client, with NumPy object values, and when a unit
stops answering: only ``tq.close()`` stops the units, object values own their memory (nothing stays pinned in Ray's
object store, and they can be written, as SimpleStorage's), and every call to a unit is bounded."""

from __future__ import annotations

import asyncio
import gc
import os
import re
import signal
import time
from typing import Any

import numpy as np
import pytest
import torch
from conduit import ConfigurationError
from conduit.testing.lifecycle import process_running
from tensordict import NonTensorStack, TensorDict

pytestmark = [pytest.mark.requires("verl"), pytest.mark.slow]


def _put(keys: list[str], objects: Any = None) -> None:
    import transfer_queue as tq

    cols: dict[str, Any] = {"f": torch.arange(3.0 * len(keys)).reshape(len(keys), 3)}
    if objects is not None:
        cols["o"] = objects
    tq.kv_batch_put(keys=keys, partition_id="p", fields=TensorDict(cols, batch_size=[len(keys)]),
                    tags=[{}] * len(keys))


def _unit_pids(manager: Any) -> list[int]:
    import ray

    return [ray.get(u.__ray_call__.remote(lambda _: os.getpid()), timeout=60) for u in manager.units]


def test_other_clients_leave_the_units_serving_and_a_silent_unit_fails_calls_typed(tq_session: Any) -> None:
    """TransferQueue builds more clients than ``tq.init``'s (a ``StreamingDataset`` does), each with a storage
    manager. Closing one, or letting one be collected, leaves the units serving ``tq.init``'s client.

    A unit process that stops answering (stopped here; a wedged host alike) is not dead to Ray: a read, a clear and
    ``stats()`` routed to it raise ``UnitTimeoutError`` naming it after ``call_timeout_s``, instead of waiting
    forever; once it answers again the buffer works on. ``tq.close()`` then stops the units.

    (One TransferQueue serves the three checks, each a start fewer: the other clients come first, as the timed-out
    clear below takes the samples they read.)"""
    import transfer_queue as tq
    import verl  # noqa: F401  (verl loads its plugins: conduit-verl registers the "Conduit" backend)
    from conduit_verl.compat import UnitTimeoutError
    from conduit_verl.tq_storage import ConduitStorageManager
    from transfer_queue.metadata import BatchMeta

    tq_session("Conduit", num_units=2, call_timeout_s=3)
    main = tq.get_client().storage_manager
    _put(["a", "b"])
    pids = _unit_pids(main)

    def another_client(how: str) -> None:
        extra = ConduitStorageManager(main.controller_info, main.config)
        if how == "closed":
            extra.close()

    for how in ("closed", "collected"):
        another_client(how)
        gc.collect()
        time.sleep(2)  # (ray.kill is asynchronous)
        assert all(process_running(p) for p in pids), f"another client, {how}, stopped the units"
        got = tq.kv_batch_get(keys=["b", "a"], partition_id="p", select_fields=["f"])["f"]
        assert [r.tolist() for r in got.unbind()] == [[3.0, 4.0, 5.0], [0.0, 1.0, 2.0]], how

    meta = BatchMeta(global_indexes=[0, 1], partition_ids=["p", "p"], field_schema={"f": {}})
    os.kill(pids[1], signal.SIGSTOP)
    try:
        for call in (main.get_data(meta), main.clear_data(meta)):
            t0 = time.monotonic()
            with pytest.raises(UnitTimeoutError, match=r"unit\(s\) \[1\] .* call_timeout_s=3 s"):
                asyncio.run(asyncio.wait_for(call, 60))
            assert time.monotonic() - t0 < 30
        with pytest.raises(UnitTimeoutError, match=r"\[1\]"):
            main.stats()
    finally:
        os.kill(pids[1], signal.SIGCONT)
    assert len(main.stats()) == 2

    tq.close()  # (closing again, as the fixture does, is a no-op)
    deadline = time.monotonic() + 60
    while any(process_running(p) for p in pids):
        assert time.monotonic() < deadline, "tq.close() did not stop the units"
        time.sleep(0.2)


def _plasma_mib() -> int:
    """MiB of Ray's shared-memory object store in use (objects referenced or pinned), on this test's cluster (another
    test process may run a local Ray of its own)."""
    import ray
    from ray._private.internal_api import memory_summary

    text = memory_summary(ray.get_runtime_context().gcs_address, stats_only=True)
    m = re.search(r"Plasma memory usage (\d+) MiB", text)
    assert m is not None
    return int(m.group(1))


def test_numpy_object_values_own_their_memory_as_simple_storages_do(tq_session: Any) -> None:
    """Ray hands NumPy arrays over zero-copy, as read-only views of the call's object: kept by a unit they would pin
    every put (its 32 MB of tensors too) in Ray's object store, and read back they could not be written. Object
    columns cross the calls pickled in band: three such puts leave nothing pinned, and the values come back
    writable, as from SimpleStorage."""
    import transfer_queue as tq
    import verl  # noqa: F401  (verl loads its plugins: conduit-verl registers the "Conduit" backend)

    writable = {}
    for backend in ("SimpleStorage", "Conduit"):
        tq_session(backend, num_units=2)
        _put(["a", "b"], NonTensorStack(np.arange(3.0), {"ids": np.arange(2)}))
        got = tq.kv_batch_get(keys=["a", "b"], partition_id="p", select_fields=["o"]).get("o").tolist()
        writable[backend] = [bool(got[0].flags.writeable), bool(got[1]["ids"].flags.writeable)]
        np.testing.assert_array_equal(got[0], np.arange(3.0))
        if backend == "SimpleStorage":
            tq.close()
    assert writable == {"SimpleStorage": [True, True], "Conduit": [True, True]}, writable

    # the Conduit units above (a start fewer than a TransferQueue of its own): each put spans both of them
    for b in range(3):
        keys = [f"k{b}_{i}" for i in range(4)]
        tq.kv_batch_put(keys=keys, partition_id="p", tags=[{}] * 4, fields=TensorDict(
            {"big": torch.zeros(4, 2_000_000), "o": NonTensorStack(*[{"ids": np.arange(3)} for _ in range(4)])},
            batch_size=[4]))
    time.sleep(1)
    assert _plasma_mib() < 8, "the units' object values pin the puts that carried them in Ray's object store"


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "10"])
def test_call_timeout_s_must_be_a_finite_positive_number_of_seconds(bad: Any) -> None:
    from conduit_verl.tq_storage import _validated, _with_defaults

    with pytest.raises(ConfigurationError, match="call_timeout_s"):
        _validated(_with_defaults({"call_timeout_s": bad}))
    assert _validated(_with_defaults({"call_timeout_s": 5}))["call_timeout_s"] == 5
