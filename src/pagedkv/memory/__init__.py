"""Paged KV memory in pure Python: block ids and copy/swap plans, never tensors.

`KVCacheManager` is what the engine and the simulator use; `SlabAllocator` is the
contiguous-reservation baseline it is measured against.
"""

from pagedkv.memory.errors import (
    DuplicateSequence,
    KVMemoryError,
    NoContiguousSpace,
    NoFreeBlocks,
    SequenceNotSwappedOut,
    SequenceSwappedOut,
    UnknownSequence,
)
from pagedkv.memory.manager import KVCacheManager, KVCacheStats
from pagedkv.memory.slab import SlabAllocator, SlabReport

__all__ = [
    "DuplicateSequence",
    "KVCacheManager",
    "KVCacheStats",
    "KVMemoryError",
    "NoContiguousSpace",
    "NoFreeBlocks",
    "SequenceNotSwappedOut",
    "SequenceSwappedOut",
    "SlabAllocator",
    "SlabReport",
    "UnknownSequence",
]
