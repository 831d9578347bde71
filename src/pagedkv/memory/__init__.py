"""Paged KV memory in pure Python: block ids and copy/swap plans, never tensors.

`KVCacheManager` is what the engine and the simulator use; its data-moving operations return
a `MemoryPlan` of `BlockMove`s for the runner. `SlabAllocator` is the contiguous-reservation
baseline it is measured against.
"""

from pagedkv.memory.errors import (
    DuplicateSequence,
    InvalidTokenIds,
    KVMemoryError,
    NoContiguousSpace,
    NoFreeBlocks,
    SequenceNotSwappedOut,
    SequenceSwappedOut,
    UnknownSequence,
)
from pagedkv.memory.manager import Allocation, KVCacheManager, KVCacheStats
from pagedkv.memory.moves import BlockMove, MemoryPlan, MoveBatch, MoveKind
from pagedkv.memory.slab import SlabAllocator, SlabReport

__all__ = [
    "Allocation",
    "BlockMove",
    "DuplicateSequence",
    "InvalidTokenIds",
    "KVCacheManager",
    "KVCacheStats",
    "KVMemoryError",
    "MemoryPlan",
    "MoveBatch",
    "MoveKind",
    "NoContiguousSpace",
    "NoFreeBlocks",
    "SequenceNotSwappedOut",
    "SequenceSwappedOut",
    "SlabAllocator",
    "SlabReport",
    "UnknownSequence",
]
