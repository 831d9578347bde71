"""Errors raised by paged KV memory; all derive from `KVMemoryError`.

The scheduler catches `NoFreeBlocks` to decide between waiting and preempting, so every
operation that raises it leaves the manager exactly as it was.
"""

from __future__ import annotations


class KVMemoryError(Exception):
    """Base of every error raised by `pagedkv.memory`."""


class NoFreeBlocks(KVMemoryError):
    """The pool cannot hold what was asked for; nothing was changed."""

    def __init__(self, needed: int, free: int, pool: str = "GPU") -> None:
        super().__init__(f"need {needed} free {pool} blocks, only {free} free")
        self.needed = needed
        self.free = free
        self.pool = pool


class UnknownSequence(KVMemoryError):
    """The sequence id has no block table (never allocated, or already freed)."""

    def __init__(self, seq_id: object) -> None:
        super().__init__(f"sequence {seq_id!r} has no block table")
        self.seq_id = seq_id


class DuplicateSequence(KVMemoryError):
    """The sequence id already has a block table."""

    def __init__(self, seq_id: object) -> None:
        super().__init__(f"sequence {seq_id!r} already has a block table")
        self.seq_id = seq_id


class SequenceSwappedOut(KVMemoryError):
    """The operation needs the sequence's blocks on the GPU, but they are in the CPU pool."""

    def __init__(self, seq_id: object, operation: str) -> None:
        super().__init__(f"sequence {seq_id!r} is swapped out; swap it in before {operation}")
        self.seq_id = seq_id


class NoContiguousSpace(KVMemoryError):
    """A slab reservation found no single hole large enough.

    `total_free >= requested` means the free space exists but is scattered in holes that are
    each too small: external fragmentation.
    """

    def __init__(self, requested: int, total_free: int, largest_hole: int) -> None:
        if total_free >= requested:
            cause = "enough in total, but scattered: external fragmentation"
        else:
            cause = "not enough in total"
        super().__init__(
            f"no contiguous hole of {requested} tokens: largest hole {largest_hole}, "
            f"{total_free} free ({cause})"
        )
        self.requested = requested
        self.total_free = total_free
        self.largest_hole = largest_hole

    @property
    def is_external_fragmentation(self) -> bool:
        """True when compaction alone would have made room for the request."""
        return self.total_free >= self.requested


class SequenceNotSwappedOut(KVMemoryError):
    """`swap_in` was asked for a sequence whose blocks are already on the GPU."""

    def __init__(self, seq_id: object) -> None:
        super().__init__(f"sequence {seq_id!r} is not swapped out")
        self.seq_id = seq_id


class InvalidTokenIds(KVMemoryError, ValueError):
    """A token id is not an int in [0, 2**63): rejected where it enters, before any change.

    Ids are stored and hashed as signed 64-bit integers; checking them on entry keeps every
    later operation (hashing a block, caching it) free of conversion errors.
    """

    def __init__(self, seq_id: object, position: int, token_id: object) -> None:
        super().__init__(
            f"sequence {seq_id!r}: token id {token_id!r} at position {position} is not an int "
            "in [0, 2**63)"
        )
        self.seq_id = seq_id
        self.position = position
        self.token_id = token_id
