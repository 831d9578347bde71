"""SlabAllocator: one contiguous reservation per request, the baseline paging replaces.

Engines without paging reserve a request's worst case up front in one linear KV address
space. This allocator does exactly that (first fit) and accounts for where the memory goes:
reserved ahead of the tokens written so far, reserved but never written by requests that
finished (internal fragmentation), and free space stranded in holes too small for the request
waiting to be placed (external fragmentation).
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable
from dataclasses import dataclass

from pagedkv.memory.errors import DuplicateSequence, NoContiguousSpace, UnknownSequence


@dataclass(frozen=True)
class SlabReport:
    """Where the slab address space goes, in tokens.

    `reservation_waste` is live (reserved minus written, for requests still running);
    `internal_fragmentation` is cumulative (reserved minus written, for released requests);
    `external_fragmentation` is live: the free space stranded for the waiting request (the
    last reservation that failed, while none has succeeded since) when there is enough free
    space in total but no hole fits it, so every hole is too small; 0 when nothing waits, when
    it would fit now, or when it needs more than is free (that is a full pool, not
    fragmentation).
    """

    capacity: int
    reserved: int
    used: int
    reservation_waste: int
    internal_fragmentation: int
    external_fragmentation: int
    largest_hole: int
    num_free: int

    @property
    def utilization(self) -> float:
        """Token state as a fraction of reserved KV memory."""
        return self.used / self.reserved if self.reserved else 0.0


@dataclass
class _Slab:
    offset: int
    size: int
    used: int = 0


class SlabAllocator:
    """First-fit contiguous reservations in a linear space of `capacity_tokens` slots."""

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens <= 0:
            raise ValueError(f"capacity_tokens must be positive, got {capacity_tokens}")
        self.capacity = capacity_tokens
        self._slabs: dict[Hashable, _Slab] = {}
        self._offsets: list[int] = []  # sorted offsets of live slabs
        self._by_offset: dict[int, Hashable] = {}
        self._internal_fragmentation = 0
        self._waiting_request = 0  # size of the last failed reservation; 0 once one succeeds

    def reserve(self, req_id: Hashable, num_tokens: int) -> int:
        """Reserve `num_tokens` contiguous slots at the first hole that fits; return the offset."""
        if req_id in self._slabs:
            raise DuplicateSequence(req_id)
        if num_tokens <= 0:
            raise ValueError(f"request {req_id!r}: reservation must be positive, got {num_tokens}")
        for start, size in self.holes():
            if size >= num_tokens:
                self._slabs[req_id] = _Slab(start, num_tokens)
                bisect.insort(self._offsets, start)
                self._by_offset[start] = req_id
                self._waiting_request = 0
                return start
        self._waiting_request = num_tokens
        raise NoContiguousSpace(num_tokens, self.num_free, self.largest_hole)

    def write(self, req_id: Hashable, num_tokens: int) -> None:
        """Record `num_tokens` more tokens stored in the request's slab."""
        slab = self._get(req_id)
        if num_tokens < 0:
            raise ValueError(f"request {req_id!r}: cannot write {num_tokens} tokens")
        if slab.used + num_tokens > slab.size:
            raise ValueError(
                f"request {req_id!r}: writing {num_tokens} tokens overflows its slab "
                f"({slab.used} of {slab.size} used)"
            )
        slab.used += num_tokens

    def release(self, req_id: Hashable) -> None:
        """Free the request's slab; what it reserved and never wrote counts as internal waste."""
        slab = self._get(req_id)
        del self._slabs[req_id]
        self._offsets.remove(slab.offset)
        del self._by_offset[slab.offset]
        self._internal_fragmentation += slab.size - slab.used

    def holes(self) -> list[tuple[int, int]]:
        """Free (offset, size) ranges in address order."""
        holes = []
        cursor = 0
        for offset in self._offsets:
            if offset > cursor:
                holes.append((cursor, offset - cursor))
            cursor = offset + self._slabs[self._by_offset[offset]].size
        if cursor < self.capacity:
            holes.append((cursor, self.capacity - cursor))
        return holes

    def reservations(self) -> list[tuple[Hashable, int, int, int]]:
        """Live slabs as (req_id, offset, reserved, used), in address order."""
        rows = []
        for offset in self._offsets:
            req_id = self._by_offset[offset]
            slab = self._slabs[req_id]
            rows.append((req_id, offset, slab.size, slab.used))
        return rows

    @property
    def num_free(self) -> int:
        """Slots in no reservation."""
        return self.capacity - sum(slab.size for slab in self._slabs.values())

    @property
    def largest_hole(self) -> int:
        """Size of the largest free range: the biggest reservation that can succeed now."""
        return max((size for _, size in self.holes()), default=0)

    def report(self) -> SlabReport:
        """Reserved, used and wasted slots right now (internal fragmentation: so far)."""
        reserved = sum(slab.size for slab in self._slabs.values())
        used = sum(slab.used for slab in self._slabs.values())
        holes = [size for _, size in self.holes()]
        num_free = self.capacity - reserved
        largest_hole = max(holes, default=0)
        stranded = largest_hole < self._waiting_request <= num_free
        return SlabReport(
            capacity=self.capacity,
            reserved=reserved,
            used=used,
            reservation_waste=reserved - used,
            internal_fragmentation=self._internal_fragmentation,
            external_fragmentation=num_free if stranded else 0,
            largest_hole=largest_hole,
            num_free=num_free,
        )

    def _get(self, req_id: Hashable) -> _Slab:
        slab = self._slabs.get(req_id)
        if slab is None:
            raise UnknownSequence(req_id)
        return slab
