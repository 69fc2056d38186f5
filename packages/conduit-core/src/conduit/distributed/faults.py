"""What a shard loss did: which items were lost, which were recovered from replicas."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["LossReport"]


@dataclass(frozen=True)
class LossReport:
    """One lost shard, as detected by a :class:`~conduit.distributed.DistributedDataPlane`.

    ``lost`` names exactly the items that can no longer be delivered (global handles, the
    ones ``ingest`` returned); items that had a replica elsewhere are counted in
    ``recovered`` and stay deliverable. ``re_replicated`` of those got a fresh replica on
    another node (replication restored); the rest run with fewer copies from then on (counted in
    the plane's ``under_replicated``). The
    oldest items that the ingestion which found the loss evicts are evicted, neither lost nor
    recovered, and left out of both (counted after all when that ingestion fails and evicts
    nothing).
    Each item is counted once: when copying an item finds its other replica lost too, that
    shard's report (recorded just before this one) names it lost, and this one does not
    count it recovered.
    """

    #: shard number in the buffer
    shard: int
    #: Ray node id the shard lived on
    node_id: str
    #: why the shard counts as lost ("actor died: ...", "no answer within 5.0 s")
    reason: str
    #: ``time.time()`` at detection
    detected_at: float
    #: handles of the items lost (sorted)
    lost: np.ndarray = field(repr=False)
    #: items whose other replica survived
    recovered: int = 0
    #: of those, items copied to a new replica; the others stay with one copy fewer (counted in the plane's
    #: ``under_replicated``) once re-replication gave up (see :data:`~conduit.distributed.recovery.COPY_ROUNDS`)
    re_replicated: int = 0

    @property
    def num_lost(self) -> int:
        return int(self.lost.shape[0])

    def __str__(self) -> str:
        return (f"shard {self.shard} on node {self.node_id[:8]} lost ({self.reason}): {self.num_lost} items lost, "
                f"{self.recovered} recovered from replicas ({self.re_replicated} re-replicated)")
