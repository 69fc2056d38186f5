"""Scheduling: when and in what granularity experience-path work runs.

* :class:`Synchronous` -- everything in the caller, one call at a time (the default).
* :class:`Overlapped` -- background ingestion and delivery prefetch at granularities
  ``g_ing`` / ``g_del`` (or, with ``overlap=False``, the same granularity sequentially).
"""

from conduit.scheduling.base import Scheduler, Synchronous
from conduit.scheduling.overlapped import Overlapped

__all__ = ["Scheduler", "Synchronous", "Overlapped"]
