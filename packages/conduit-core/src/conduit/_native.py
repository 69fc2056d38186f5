"""Loading conduit-core's optional compiled modules (built by ``hatch_build.py`` where a C compiler is found)."""

from __future__ import annotations

import importlib
from typing import Any


def load_kernels(name: str, kernels: tuple[str, ...]) -> Any:
    """The compiled module ``name``, or None where it was not built (no C compiler at install) or lacks one of
    ``kernels`` (compiled from an older source that an install left in place): the caller then runs its NumPy or
    torch path."""
    try:
        module = importlib.import_module(name)
    except ImportError:
        return None
    return module if all(hasattr(module, k) for k in kernels) else None
