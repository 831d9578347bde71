"""A stand-in for the KV cache tensors: each slot holds the token whose KV it stores.

Executing the manager's plans on it, then reading every sequence's blocks back, checks that
the plans move the right data: a sequence must read back exactly its own computed tokens,
whatever was shared, copied, swapped or served from the prefix cache. It executes a plan the
way `KVCache.execute` does, batch by batch (gather every source, then scatter), so a batch
that `MemoryPlan.batches` should have split shows up as a wrong read-back.
"""

from __future__ import annotations

from pagedkv.memory import KVCacheManager, MemoryPlan, MoveKind

Slots = dict[tuple[int, int], int]


class SlotStore:
    """KV slots of the GPU and CPU pools, keyed by (block, offset)."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.gpu: Slots = {}
        self.cpu: Slots = {}

    def write(self, seq_id: object, token_ids: list[int], start: int, stop: int) -> None:
        """Write the KV of positions start..stop-1 (the forward pass's job)."""
        table = self.manager.block_table(seq_id)
        size = self.manager.block_size
        for position in range(start, stop):
            self.gpu[(table[position // size], position % size)] = token_ids[position]

    def execute(self, plan: MemoryPlan) -> None:
        """Run a step's plan batch by batch, each batch as one gather then one scatter."""
        for batch in plan.batches():
            source = self.cpu if batch.kind is MoveKind.SWAP_IN else self.gpu
            destination = self.cpu if batch.kind is MoveKind.SWAP_OUT else self.gpu
            # Torch leaves the winner of a scatter to one block twice undefined.
            assert len(set(batch.dsts)) == len(batch.dsts), f"{batch} writes a block twice"
            gathered = [self._block(source, src) for src in batch.srcs]
            for dst, block in zip(batch.dsts, gathered, strict=True):
                for offset, token in enumerate(block):
                    if token is None:
                        destination.pop((dst, offset), None)
                    else:
                        destination[(dst, offset)] = token

    def read(self, seq_id: object, num_tokens: int) -> list[int | None]:
        """The tokens stored for the first num_tokens positions of a sequence."""
        table = self.manager.block_table(seq_id)
        slots = self.cpu if self.manager.is_swapped_out(seq_id) else self.gpu
        size = self.manager.block_size
        return [slots.get((table[p // size], p % size)) for p in range(num_tokens)]

    def _block(self, slots: Slots, block_id: int) -> list[int | None]:
        return [slots.get((block_id, offset)) for offset in range(self.manager.block_size)]
