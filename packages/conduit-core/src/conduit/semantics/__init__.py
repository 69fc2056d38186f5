"""Semantics: what the framework stores and consumes (replay or on-policy)."""

from conduit.semantics.base import SampleInfo, Selection, Semantics
from conduit.semantics.onpolicy import OnPolicy
from conduit.semantics.replay import PrioritizedSampler, Replay, Sampler, UniformSampler

__all__ = ["Semantics", "Selection", "SampleInfo", "Replay", "OnPolicy", "Sampler", "UniformSampler",
           "PrioritizedSampler"]
