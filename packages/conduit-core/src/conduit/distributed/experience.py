"""Experience staged on the producer's node, to be ingested without passing through the driver.

A producer (a Ray actor on any node) validates its batch and puts it into its own node's
object store with :func:`stage`; it sends the small :class:`ExperienceRef` to whoever
holds the buffer, which ingests it: the shard that stores the items reads them straight
from the producer's node (from shared memory when it is on that node).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from conduit.batch import ExperienceBatch
from conduit.distributed._ray import current_node_id, ray_module
from conduit.distributed.wire import to_wire
from conduit.schema import ExperienceSchema

__all__ = ["ExperienceRef", "stage"]


@dataclass(frozen=True)
class ExperienceRef:
    """A validated batch in a node's object store (picklable: send it to the buffer's owner)."""

    #: ObjectRef of the batch's NumPy columns
    ref: Any
    #: the node whose object store holds it
    node_id: str
    batch_size: int
    nbytes: int
    #: the schema it was validated against (``ExperienceSchema.to_dict()``)
    schema: dict[str, Any]


def stage(batch: Mapping[str, Any] | ExperienceBatch, schema: ExperienceSchema) -> ExperienceRef:
    """Validate ``batch`` against ``schema`` here and put it into this node's object store.

    Raises:
        SchemaError: the batch does not match the schema (nothing is staged).
    """
    b = ExperienceBatch.checked(batch, schema)
    ray = ray_module()
    ref = ray.put(to_wire(b, schema))
    return ExperienceRef(ref, current_node_id(), b.batch_size, b.nbytes(), schema.to_dict())
