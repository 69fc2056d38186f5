"""Conduit: an Experience Data Plane for distributed reinforcement learning.

The public surface. ``conduit.testing`` (the conformance suite) is imported explicitly.
"""

from conduit.batch import ExperienceBatch, Ragged
from conduit.edp import ExperienceDataPlane
from conduit.errors import (
    CapacityError,
    ConduitError,
    ConfigurationError,
    EmptyBufferError,
    PlacementError,
    PriorityError,
    SchemaError,
    StaleExperienceError,
)
from conduit.exposure import ExposureLog, IterationExposure
from conduit.placement import (
    AdaptivePlacement,
    DevicePlacement,
    DiskPlacement,
    HostPlacement,
    Placement,
    PlacementSpec,
    Planner,
    ShardedPlacement,
)
from conduit.scheduling import Automatic, Overlapped, Scheduler, Synchronous, safe_ranges
from conduit.schema import ExperienceSchema, Field
from conduit.semantics import OnPolicy, PrioritizedSampler, Replay, SampleInfo, Sampler, Semantics, UniformSampler
from conduit.storage import ColumnarStorage, Storage
from conduit.telemetry import Telemetry

__version__ = "0.1.0"

__all__ = [
    "ExperienceDataPlane",
    "ExperienceSchema",
    "Field",
    "ExperienceBatch",
    "Ragged",
    "SampleInfo",
    "Semantics",
    "Replay",
    "OnPolicy",
    "Sampler",
    "UniformSampler",
    "PrioritizedSampler",
    "Storage",
    "ColumnarStorage",
    "Placement",
    "HostPlacement",
    "DevicePlacement",
    "ShardedPlacement",
    "DiskPlacement",
    "PlacementSpec",
    "AdaptivePlacement",
    "Planner",
    "Scheduler",
    "Synchronous",
    "Overlapped",
    "Automatic",
    "safe_ranges",
    "Telemetry",
    "ExposureLog",
    "IterationExposure",
    "ConduitError",
    "SchemaError",
    "CapacityError",
    "EmptyBufferError",
    "PriorityError",
    "StaleExperienceError",
    "ConfigurationError",
    "PlacementError",
    "__version__",
]
