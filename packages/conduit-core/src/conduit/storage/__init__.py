"""Storage tiers."""

from conduit.storage.base import AppendResult, Storage
from conduit.storage.columnar import Allocator, ColumnarStorage

__all__ = ["Storage", "AppendResult", "ColumnarStorage", "Allocator"]
