"""Conduit adapter for rllib."""

__version__ = "0.1.0"

__all__ = ["__version__"]
