"""Typed errors. Every error says what to do, and is raised before any state changes."""

from __future__ import annotations

__all__ = [
    "ConduitError",
    "SchemaError",
    "CapacityError",
    "AllocationError",
    "EmptyBufferError",
    "PriorityError",
    "StaleExperienceError",
    "ConfigurationError",
    "PlacementError",
]


class ConduitError(Exception):
    """Base class of every error Conduit raises on purpose."""


class SchemaError(ConduitError, ValueError):
    """A batch does not match the experience schema (field set, dtype, shape, lengths)."""


class CapacityError(ConduitError, ValueError):
    """A request does not fit: a batch larger than capacity, or a sample larger than the contents."""


class AllocationError(CapacityError, MemoryError):
    """Memory for a request could not be allocated: a buffer's storage (its capacity, its ragged pools) or a
    delivery's rows. Nothing was built, stored or drawn. A ``MemoryError`` too, as the allocator's own refusal is
    (code that caught that goes on catching it); the allocator's error is its ``__cause__``."""


class EmptyBufferError(ConduitError, LookupError):
    """Sampling or delivering from a buffer that holds nothing to deliver."""


class PriorityError(ConduitError, ValueError):
    """A priority is NaN, infinite or negative, or does not pair with the handles given."""


class StaleExperienceError(ConduitError):
    """On-policy experience fell behind the staleness bound and the policy is to raise."""


class ConfigurationError(ConduitError, ValueError):
    """A constructor or a role got arguments that cannot work together."""


class NotCopyableError(ConfigurationError, TypeError):
    """An object that owns storage, locks or threads (an ``ExperienceDataPlane``) was pickled or copied; its
    ``state_dict()`` is what pickles. A ``TypeError`` too, as Python's own refusal to pickle such an object is."""


class PlacementError(ConduitError):
    """No placement fits the request, or a topology/profile cannot be used here."""
