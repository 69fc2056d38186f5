"""Test and benchmark support for conduit-srl.

* :mod:`~conduit_srl.testing.records`: a record type with the array-of-fields behaviour SRL relies on;
* :mod:`~conduit_srl.testing.driver`: SRL's call pattern with real threads and ZMQ sockets (needs pyzmq);
* :mod:`~conduit_srl.testing.fifo`: a plain FIFO buffer with the queue semantics, the baseline;
* :mod:`~conduit_srl.testing.endpoints`: the conformance endpoints (``ENDPOINTS``).
"""

from conduit_srl.testing.endpoints import ENDPOINTS, SrlOnPolicyEndpoint, SrlReplayEndpoint, entry_ids
from conduit_srl.testing.records import Record, make_sample, stack

__all__ = ["ENDPOINTS", "SrlReplayEndpoint", "SrlOnPolicyEndpoint", "entry_ids", "Record", "make_sample", "stack"]
