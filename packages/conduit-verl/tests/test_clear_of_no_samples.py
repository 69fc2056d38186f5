"""A clear of no samples (an empty ``BatchMeta``) is a no-op, as on SimpleStorage.

``clear_data`` sent one call per unit the global indexes route to and waited for the answers with
``asyncio.wait``, which refuses an empty set: a clear of nothing raised ``ValueError: Set of Tasks/Futures is
empty.``, while SimpleStorage's manager returns (``get_data`` and ``put_data`` of no samples returned here too).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from tensordict import TensorDict

pytestmark = [pytest.mark.requires("verl"), pytest.mark.slow]


def test_a_clear_of_no_samples_changes_nothing_and_raises_nothing(tq_session: Any) -> None:
    import transfer_queue as tq
    import verl  # noqa: F401  (verl loads its plugins: conduit-verl registers the "Conduit" backend)
    from transfer_queue.metadata import BatchMeta

    tq_session("Conduit", num_units=2, capacity=4, mean_length=2)
    tq.kv_batch_put(keys=["a", "b"], partition_id="train",
                    fields=TensorDict({"f": torch.tensor([1.0, 2.0])}, batch_size=[2]), tags=[{}, {}])
    manager = tq.get_client().storage_manager
    asyncio.run(manager.clear_data(BatchMeta.empty()))
    got = tq.kv_batch_get(keys=["b", "a"], partition_id="train", select_fields=["f"])
    assert got["f"].tolist() == [2.0, 1.0]
