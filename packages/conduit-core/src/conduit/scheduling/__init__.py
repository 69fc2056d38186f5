"""Scheduling: when and in what granularity experience-path work runs."""

from conduit.scheduling.base import Scheduler, Synchronous

__all__ = ["Scheduler", "Synchronous"]
