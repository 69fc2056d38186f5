"""A Conduit storage unit's process starts without TransferQueue, tensordict or omegaconf.

Ray loads a unit's actor class from :mod:`conduit_verl.unit`; while it lived in :mod:`conduit_verl.tq_storage`, every
unit process imported TransferQueue and tensordict with it (about twice the CPU time of ``import torch, conduit``),
which every TransferQueue session's start waited for. A unit's read of a missing sample raises a light stand-in that
unpickles, on the caller's side, as :class:`conduit_verl.compat.MissingKeyError` (a TransferQueue
``StorageKeyNotFoundError``) or :class:`~conduit_verl.compat.MissingFieldError`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import pickle
import subprocess
import sys
import textwrap
from typing import Any

import pytest

pytestmark = pytest.mark.requires("verl")

#: modules a unit's process must not import (TransferQueue's side of the adapter, and what it imports)
HEAVY = ("transfer_queue", "tensordict", "omegaconf", "conduit_verl.compat", "conduit_verl.tq_storage")


def _fresh_python(code: str) -> str:
    """Run ``code`` in a new interpreter (this one's); returns its stdout, failing the test on a non-zero exit."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the fresh interpreter failed:\n{done.stderr[-3000:]}"
    return done.stdout


def test_importing_the_unit_module_imports_no_transfer_queue_tensordict_or_omegaconf() -> None:
    out = _fresh_python(f"""
        import json, sys
        import conduit_verl.unit
        print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))
    """)
    assert json.loads(out) == [], f"import conduit_verl.unit imported {out.strip()}: a unit's process pays for them"


def test_a_units_missing_key_and_field_errors_unpickle_as_compats_classes() -> None:
    """Raised where compat is not imported, the errors are stand-ins (a ConduitError and KeyError; a RuntimeError for
    a missing field); pickled there and unpickled here, they are compat's classes with the same messages."""
    import transfer_queue as tq
    from conduit_verl.compat import MissingFieldError, MissingKeyError

    out = _fresh_python("""
        import base64, pickle, sys
        from conduit import ConduitError
        from conduit_verl.unit_errors import missing_field, missing_key

        pickled = []
        for make, message in ((missing_key, "no sample 7"), (missing_field, "no field 'nope'")):
            try:
                raise make(message)
            except ConduitError as e:
                assert isinstance(e, KeyError) and str(e) == message, (type(e).__mro__, str(e))
                assert isinstance(e, RuntimeError) == (make is missing_field), type(e).__mro__
                pickled.append(pickle.dumps(e))
        assert "conduit_verl.compat" not in sys.modules and "transfer_queue" not in sys.modules, "compat was imported"
        print(base64.b64encode(pickle.dumps(pickled)).decode())
    """)
    key, field = (pickle.loads(b) for b in pickle.loads(base64.b64decode(out)))
    assert type(key) is MissingKeyError and str(key) == "no sample 7", (type(key), str(key))
    assert type(field) is MissingFieldError and str(field) == "no field 'nope'", (type(field), str(field))
    assert isinstance(key, tq.StorageKeyNotFoundError) and isinstance(field, tq.StorageKeyNotFoundError)
    assert isinstance(field, RuntimeError) and not isinstance(key, RuntimeError), "SimpleStorage's parity is lost"


def test_where_compat_is_imported_the_builders_return_compats_classes() -> None:
    """In-process users (a ``_UnitState`` built in a TransferQueue client, or a test) get compat's classes."""
    from conduit_verl.compat import MissingFieldError, MissingKeyError
    from conduit_verl.unit_errors import missing_field, missing_key

    assert type(missing_key("k")) is MissingKeyError
    assert type(missing_field("f")) is MissingFieldError


def test_a_unit_process_serves_puts_gets_and_missing_reads_without_transfer_queue(tq_session: Any) -> None:
    """A real unit stores and returns a tensor field and an object field of strings, and refuses a read of a sample it
    does not hold (the caller gets compat's MissingKeyError itself), all without importing any of :data:`HEAVY`."""
    import ray
    import torch
    import transfer_queue as tq
    import verl  # noqa: F401  (verl loads its plugins: conduit-verl registers the "Conduit" backend)
    from conduit_verl.compat import MissingKeyError
    from tensordict import NonTensorStack, TensorDict
    from transfer_queue.metadata import BatchMeta

    tq_session("Conduit", num_units=1, capacity=4, mean_length=2)
    manager = tq.get_client().storage_manager
    r = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    tq.kv_batch_put(keys=["a", "b"], partition_id="train",
                    fields=TensorDict({"r": r, "uid": NonTensorStack("x", "y")}, batch_size=[2]), tags=[{}, {}])
    got = tq.kv_batch_get(keys=["a", "b"], partition_id="train", select_fields=["r", "uid"])
    assert [row.tolist() for row in got["r"].unbind(0)] == r.tolist(), f"the unit returned {got['r']}"
    assert list(got["uid"]) == ["x", "y"], f"the unit returned {got['uid']}"

    meta = BatchMeta(global_indexes=[7], partition_ids=["train"], field_schema={"r": {}})
    with pytest.raises(MissingKeyError) as err:
        asyncio.run(manager.get_data(meta))
    assert type(err.value) is MissingKeyError, f"the caller got {type(err.value).__mro__}, not compat's class"
    assert str(err.value).startswith("Field 'r' holds no sample with global index 7"), str(err.value)

    def heavy_modules_here(_: Any) -> list[str]:  # (run inside the unit's actor; a local function, pickled by value)
        return sorted(m for m in HEAVY if m in sys.modules)

    loaded = ray.get(manager.units[0].__ray_call__.remote(heavy_modules_here))
    assert loaded == [], f"the unit's process imported {loaded} while serving a put, a get and a missing read"
