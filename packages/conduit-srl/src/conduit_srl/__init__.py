"""Conduit's Experience Data Plane inside SRL's streaming dataflow (a protocol-level adapter).

* :func:`install` / :func:`uninstall`: make the SRL in this process build a :class:`ConduitBuffer`
  for ``buffer_name="conduit"`` (every other name is passed through), and optionally claim sample
  streams named ``"conduit:<name>"`` (:class:`StreamPolicy`: routing and coalescing).
* :class:`ConduitBuffer`: SRL's trainer-side buffer contract (``put``/``get``/``empty``/``qsize``/
  ``update_priorities``) over an :class:`conduit.ExperienceDataPlane`, with background assembly.

Importing this package imports nothing from SRL. Conforms to the SRL interfaces of
openpsi-project/srl at commit 636c5da (protocol-tested; SRL itself does not run on Python 3.11).
"""

from conduit_srl.assembler import ReplayEntry
from conduit_srl.buffer import ConduitBuffer, srl_prioritized_class
from conduit_srl.config import SEMANTICS, BufferConfig
from conduit_srl.errors import (
    BufferFullError,
    ReceiveError,
    SamplesLostWarning,
    SrlNotFoundError,
    StreamClaimError,
    UnstoredSamplesError,
    ZeroCopyStreamError,
)
from conduit_srl.fifo import FifoSampler
from conduit_srl.install import (
    BUFFER_NAME,
    FLAVOURS,
    STREAM_MARKER,
    Flavour,
    Installation,
    check_buffer_worker_config,
    check_trainer_config,
    install,
    installed,
    is_conduit_buffer_name,
    make_conduit_buffer,
    uninstall,
)
from conduit_srl.streams import ConduitSampleConsumer, ConduitSampleProducer, StreamPolicy

__version__ = "0.1.0"

__all__ = [
    "install",
    "uninstall",
    "installed",
    "Installation",
    "Flavour",
    "FLAVOURS",
    "BUFFER_NAME",
    "STREAM_MARKER",
    "is_conduit_buffer_name",
    "make_conduit_buffer",
    "check_trainer_config",
    "check_buffer_worker_config",
    "ConduitBuffer",
    "ReplayEntry",
    "BufferConfig",
    "SEMANTICS",
    "FifoSampler",
    "srl_prioritized_class",
    "StreamPolicy",
    "ConduitSampleProducer",
    "ConduitSampleConsumer",
    "BufferFullError",
    "ZeroCopyStreamError",
    "SrlNotFoundError",
    "StreamClaimError",
    "UnstoredSamplesError",
    "ReceiveError",
    "SamplesLostWarning",
    "__version__",
]
