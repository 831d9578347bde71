"""A picture of the KV pool at one step: which request holds each block-sized cell, and how.

Paged and slab pools are cut into the same cells (one paged block = `block_size` token slots)
so that the two maps of one moment can be drawn side by side at the same scale.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from enum import Enum

from pagedkv.memory import KVCacheManager, SlabAllocator


class Cell(str, Enum):
    """What a cell of the pool holds."""

    FREE = "free"
    CACHED = "cached"  # free, but still holding a full prefix block the cache can hand out
    USED = "used"  # holds KV of its owner's tokens
    SHARED = "shared"  # a paged block in more than one block table
    RESERVED = "reserved"  # slab slots reserved for tokens not written yet


@dataclass(frozen=True)
class MemoryMap:
    """The pool cut into cells of `block_size` token slots, each with a state and an owner."""

    scheme: str
    step: int
    block_size: int
    cells: list[Cell]
    owners: list[Hashable | None]

    def count(self, state: Cell) -> int:
        """How many cells are in `state`."""
        return sum(1 for cell in self.cells if cell is state)


def paged_map(
    manager: KVCacheManager, owners: Mapping[Hashable, Hashable], scheme: str, step: int
) -> MemoryMap:
    """Map each physical block to the request of the first sequence (by `owners`) holding it."""
    cells = [Cell.FREE] * manager.num_gpu_blocks
    block_owner: list[Hashable | None] = [None] * manager.num_gpu_blocks
    for seq_id, req_id in owners.items():
        for block_id in manager.block_table(seq_id):
            if block_owner[block_id] is None:
                block_owner[block_id] = req_id
                shared = manager.block_ref_count(block_id) > 1
                cells[block_id] = Cell.SHARED if shared else Cell.USED
    for block_id, cell in enumerate(cells):
        if cell is Cell.FREE and manager.is_cached(block_id):
            cells[block_id] = Cell.CACHED
    return MemoryMap(scheme, step, manager.block_size, cells, block_owner)


def slab_map(
    allocator: SlabAllocator,
    owners: Mapping[Hashable, Hashable],
    block_size: int,
    scheme: str,
    step: int,
) -> MemoryMap:
    """Map each run of `block_size` slots to the reservation holding its first slot.

    A cell is USED when that reservation has written the cell's first slot, RESERVED when
    the slot is reserved but still empty.
    """
    num_cells = allocator.capacity // block_size
    rows = allocator.reservations()
    starts = [offset for _, offset, _, _ in rows]
    cells = [Cell.FREE] * num_cells
    cell_owner: list[Hashable | None] = [None] * num_cells
    for index in range(num_cells):
        slot = index * block_size
        position = bisect.bisect_right(starts, slot) - 1
        if position < 0:
            continue
        slab_id, offset, reserved, used = rows[position]
        if slot < offset + reserved:
            cell_owner[index] = owners[slab_id]
            cells[index] = Cell.USED if slot < offset + used else Cell.RESERVED
    return MemoryMap(scheme, step, block_size, cells, cell_owner)
