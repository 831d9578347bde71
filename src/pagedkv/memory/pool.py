"""BlockPool: the physical KV blocks, their reference counts, the free queue and the
prefix-cache index.

A block with ref count 0 is free. A free block may still hold a full block of computed KV
that the prefix cache can hand out again; it stays reusable until the free queue reaches it
and the pool evicts it for new data. The free queue is ordered for eviction: blocks are
taken from its head, cached blocks are released to its tail (least recently used first),
and blocks that hold nothing reusable are released to its head so they are reused before
any cached data is sacrificed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from pagedkv.memory.errors import NoFreeBlocks
from pagedkv.memory.hashing import BlockHash


@dataclass(eq=False, slots=True)
class Block:
    """One physical KV block and its bookkeeping (the intrusive free-queue links live here)."""

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    token_bytes: bytes | None = None
    prev_free: Block | None = None
    next_free: Block | None = None


class BlockPool:
    """Physical blocks, the free queue and the hash -> block prefix-cache index."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, Block] = {}
        self.num_evictions = 0
        # (block id, hash, token bytes) of the cached blocks the last `allocate` evicted: the
        # KV they still hold until it is overwritten, for a host tier to save.
        self.last_evicted: list[tuple[int, BlockHash, bytes]] = []
        # Ids of the blocks taken as runs (`take_run`), held until `release_run`.
        self.runs: set[int] = set()

    @property
    def num_blocks(self) -> int:
        """Total physical blocks."""
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no table holds, cached-but-free ones included."""
        return len(self.free_queue)

    def allocate(self, count: int) -> list[Block]:
        """Take `count` blocks from the head of the free queue, evicting cached data they held."""
        if count > len(self.free_queue):
            raise NoFreeBlocks(count, len(self.free_queue))
        taken = self.free_queue.popleft_many(count)
        self.last_evicted = []
        for block in taken:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
        return taken

    def take_run(self, count: int) -> list[Block] | None:
        """Take `count` free blocks of consecutive ids (a LoRA adapter's, `adapters.py`), the
        run holding the fewest prefix-cached blocks, evicting those; None when no run of free
        blocks is that long."""
        best: tuple[int, int] | None = None  # (cached blocks in the run, first id)
        start = cached = 0
        for end, block in enumerate(self.blocks):
            if block.ref_count != 0:
                start, cached = end + 1, 0
                continue
            cached += block.block_hash is not None
            if end - start + 1 > count:
                cached -= self.blocks[start].block_hash is not None
                start += 1
            if end - start + 1 == count and (best is None or cached < best[0]):
                best = (cached, start)
        if best is None:
            return None
        taken = self.blocks[best[1] : best[1] + count]
        self.last_evicted = []  # as `allocate`: only this call's evictions
        for block in taken:
            self.free_queue.remove(block)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
        self.runs.update(block.block_id for block in taken)
        return taken

    def release_run(self, blocks: list[Block]) -> None:
        """Give back a run `take_run` took: its blocks are free, reused first."""
        self.runs.difference_update(block.block_id for block in blocks)
        self.release(blocks)

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take one more reference on each block (prefix-cache hits), reviving free ones."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def release(self, blocks: Iterable[Block]) -> None:
        """Drop one reference on each block, in eviction order: the first freed is evicted first."""
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def lookup(self, block_hash: BlockHash, token_bytes: bytes) -> Block | None:
        """The cached block holding exactly these tokens after this prefix, if any.

        Comparing the token bytes guards against hash collisions handing out wrong KV.
        """
        block = self.cached.get(block_hash)
        if block is None or block.token_bytes != token_bytes:
            return None
        return block

    def cache(self, blocks: list[Block], hashed: list[tuple[BlockHash, bytes]]) -> None:
        """Register full blocks in the prefix cache with their (hash, token bytes): computed,
        or to be computed by the step being scheduled (`KVCacheManager.mark_scheduled`).

        A block already cached keeps its entry; a hash already served by another block keeps
        that block (two requests computed the same prefix at once), and this one stays
        uncached, to be reused first when it is freed. One call per chain, not per block:
        this runs for every block a sequence computes.
        """
        cached = self.cached
        for block, (block_hash, token_bytes) in zip(blocks, hashed, strict=True):
            if block.block_hash is None and block_hash not in cached:
                block.block_hash = block_hash
                block.token_bytes = token_bytes
                cached[block_hash] = block

    def uncache(self, blocks: Iterable[Block]) -> None:
        """Take blocks out of the prefix cache: their KV is not what their hash says (a copy
        into them that a failed step never ran). A free one is reused like any other."""
        for block in blocks:
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
                block.token_bytes = None

    def _evict(self, block: Block) -> None:
        self.last_evicted.append((block.block_id, block.block_hash, block.token_bytes))
        del self.cached[block.block_hash]
        block.block_hash = None
        block.token_bytes = None
        self.num_evictions += 1

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first inconsistency in queue, counts or index."""
        queued = list(self.free_queue)
        if len(queued) != len(self.free_queue):
            raise AssertionError(
                f"free queue links {len(queued)} blocks, counts {len(self.free_queue)}"
            )
        if len({id(block) for block in queued}) != len(queued):
            raise AssertionError("a block appears twice in the free queue")
        for block in queued:
            if block.ref_count != 0:
                raise AssertionError(
                    f"block {block.block_id} is queued free with ref count {block.ref_count}"
                )
        num_unreferenced = sum(1 for block in self.blocks if block.ref_count == 0)
        if num_unreferenced != len(queued):
            raise AssertionError(
                f"{num_unreferenced} blocks have ref count 0, {len(queued)} are queued free"
            )
        for block in self.blocks:
            if block.ref_count < 0:
                raise AssertionError(
                    f"block {block.block_id} has negative ref count {block.ref_count}"
                )
        for block_hash, block in self.cached.items():
            if block.block_hash != block_hash:
                raise AssertionError(
                    f"prefix index maps a hash to block {block.block_id} holding another"
                )
        num_hashed = sum(1 for block in self.blocks if block.block_hash is not None)
        if num_hashed != len(self.cached):
            raise AssertionError(
                f"{num_hashed} blocks carry a hash, the prefix index has {len(self.cached)}"
            )


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks themselves.

    Unlike `deque.remove`, taking a cached block out of the middle on a prefix-cache hit
    is O(1): the block knows its neighbours.
    """

    def __init__(self, blocks: list[Block]) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._size = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free

    def popleft_many(self, count: int) -> list[Block]:
        """Remove and return the `count` blocks at the head (the next to be reused), in order.

        The run is unlinked as a whole: one relink of the head, not one per block.
        """
        if count > self._size:
            raise IndexError(f"pop of {count} blocks from a free queue of {self._size}")
        taken = []
        block = self._head.next_free
        for _ in range(count):
            taken.append(block)
            block.prev_free, block.next_free, block = None, None, block.next_free
        self._head.next_free = block
        block.prev_free = self._head
        self._size -= count
        return taken

    def append(self, block: Block) -> None:
        """Put a block at the tail: reused last."""
        before = self._tail.prev_free
        block.prev_free, block.next_free = before, self._tail
        before.next_free = self._tail.prev_free = block
        self._size += 1

    def appendleft(self, block: Block) -> None:
        """Put a block at the head: reused first."""
        after = self._head.next_free
        block.prev_free, block.next_free = self._head, after
        self._head.next_free = after.prev_free = block
        self._size += 1

    def remove(self, block: Block) -> None:
        """Unlink a block from wherever it is in the queue."""
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self._size -= 1
