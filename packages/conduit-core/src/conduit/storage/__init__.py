"""Storage tiers."""

from conduit.storage.base import AppendResult, Storage
from conduit.storage.columnar import Allocator, ColumnarStorage
from conduit.storage.disk import DiskStorage, memmap_allocator
from conduit.storage.sharded import ShardedStorage

__all__ = ["Storage", "AppendResult", "ColumnarStorage", "Allocator", "ShardedStorage", "DiskStorage",
           "memmap_allocator"]
