"""Scheduling: when and in what granularity experience-path work runs.

* :class:`Synchronous` -- everything in the caller, one call at a time (the default).
* :class:`Overlapped` -- background ingestion and delivery prefetch at granularities
  ``g_ing`` / ``g_del`` (or, with ``overlap=False``, the same granularity sequentially).
* :class:`Automatic` -- picks the granularities (within :func:`safe_ranges`) and overlap
  from a latency model calibrated on the running job's telemetry.
"""

from conduit.scheduling.auto import Automatic, Decision
from conduit.scheduling.base import Scheduler, Synchronous
from conduit.scheduling.granularity import GranularityRange, ranges_for, safe_ranges
from conduit.scheduling.model import LatencyFit, fit_latency
from conduit.scheduling.overlapped import Overlapped

__all__ = ["Scheduler", "Synchronous", "Overlapped", "Automatic", "Decision", "GranularityRange", "safe_ranges",
           "ranges_for", "LatencyFit", "fit_latency"]
