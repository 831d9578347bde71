"""A stand-in for the KV cache tensors: each slot holds the token whose KV it stores.

Executing the manager's copy-on-write and swap plans on it, then reading every sequence's
blocks back, checks that the plans move the right data: a sequence must read back exactly
its own computed tokens, whatever was shared, copied, swapped or served from the prefix
cache.
"""

from __future__ import annotations

from pagedkv.memory import KVCacheManager


class SlotStore:
    """KV slots of the GPU and CPU pools, keyed by (block, offset)."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.gpu: dict[tuple[int, int], int] = {}
        self.cpu: dict[tuple[int, int], int] = {}

    def write(self, seq_id: object, token_ids: list[int], start: int, stop: int) -> None:
        """Write the KV of positions start..stop-1 (the forward pass's job)."""
        table = self.manager.block_table(seq_id)
        size = self.manager.block_size
        for position in range(start, stop):
            self.gpu[(table[position // size], position % size)] = token_ids[position]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: GPU block to GPU block."""
        self._copy(pairs, self.gpu, self.gpu)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """GPU block to CPU block."""
        self._copy(pairs, self.gpu, self.cpu)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """CPU block to GPU block."""
        self._copy(pairs, self.cpu, self.gpu)

    def read(self, seq_id: object, num_tokens: int) -> list[int | None]:
        """The tokens stored for the first num_tokens positions of a sequence."""
        table = self.manager.block_table(seq_id)
        slots = self.cpu if self.manager.is_swapped_out(seq_id) else self.gpu
        size = self.manager.block_size
        return [slots.get((table[p // size], p % size)) for p in range(num_tokens)]

    def _copy(self, pairs, source, destination) -> None:
        size = self.manager.block_size
        for src, dst in pairs:
            for offset in range(size):
                if (src, offset) in source:
                    destination[(dst, offset)] = source[(src, offset)]
                else:
                    destination.pop((dst, offset), None)
