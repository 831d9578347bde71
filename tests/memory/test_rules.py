"""The rules the memory code keeps (DESIGN.md), one test each."""

from __future__ import annotations

import pytest

from pagedkv.memory import BlockMove, KVCacheManager, MoveKind, NoFreeBlocks
from pagedkv.memory.pool import BlockPool


def snapshot(manager: KVCacheManager) -> tuple:
    """Everything observable about a manager's state."""
    tables = {s: (manager.block_table(s), manager.num_tokens(s)) for s in manager.seq_ids}
    refs = [manager.block_ref_count(b) for b in range(manager.num_gpu_blocks)]
    cached = [manager.is_cached(b) for b in range(manager.num_gpu_blocks)]
    free = manager.num_free_blocks, manager.num_free_cpu_blocks
    return tables, refs, cached, free, manager.stats, manager.offload_stats


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_a_sequence_of_L_tokens_holds_ceil_L_over_block_size_blocks(block_size: int) -> None:
    manager = KVCacheManager(num_gpu_blocks=200, block_size=block_size)
    manager.allocate("s", [7] * 5)
    assert len(manager.block_table("s")) == -(-5 // block_size)
    for length in range(6, 120):
        manager.append("s", [length])
        assert len(manager.block_table("s")) == -(-length // block_size)
        assert manager.num_tokens("s") == length


def test_free_plus_used_is_total_and_ref_counts_equal_holders() -> None:
    manager = KVCacheManager(num_gpu_blocks=20, block_size=4)
    manager.allocate("a", list(range(10)))
    manager.mark_computed("a", 10)
    manager.fork("a", "b")
    manager.allocate("c", list(range(9)) + [99])  # shares a's two full blocks via the cache
    held = {b for s in manager.seq_ids for b in manager.block_table(s)}
    assert manager.num_free_blocks + len(held) == 20
    for block in range(20):
        holders = sum(manager.block_table(s).count(block) for s in manager.seq_ids)
        assert manager.block_ref_count(block) == holders
    assert manager.block_ref_count(manager.block_table("a")[0]) == 3
    for seq_id in manager.seq_ids:
        manager.free(seq_id)
    assert manager.num_free_blocks == 20
    assert manager.usage == 0.0
    manager.check_invariants()


def test_a_failed_operation_changes_nothing() -> None:
    manager = KVCacheManager(num_gpu_blocks=6, block_size=4, num_cpu_blocks=2)
    manager.allocate("a", list(range(6)))
    manager.mark_computed("a", 6)
    manager.fork("a", "b")
    manager.allocate("c", [50] * 12)
    before = snapshot(manager)
    with pytest.raises(NoFreeBlocks):
        manager.allocate("d", [60] * 13)  # needs 4 blocks, 2 free
    with pytest.raises(NoFreeBlocks):
        manager.append("b", [1] * 7)  # copy-on-write of the shared last block + 2 new
    with pytest.raises(NoFreeBlocks):
        manager.swap_out("c")  # 3 blocks, 2 CPU blocks
    assert snapshot(manager) == before
    manager.swap_out("a")
    manager.free("b")
    manager.allocate("e", [70] * 12)  # takes every GPU block left
    before = snapshot(manager)
    with pytest.raises(NoFreeBlocks):
        manager.swap_in("a")
    assert snapshot(manager) == before
    manager.check_invariants()


def test_only_computed_full_blocks_enter_the_prefix_cache() -> None:
    manager = KVCacheManager(num_gpu_blocks=32, block_size=16)
    prompt = list(range(100))
    manager.allocate("a", prompt)
    assert manager.allocate("uncomputed", prompt) == 0
    manager.mark_computed("a", 40)  # two full blocks and a partial one
    assert manager.allocate("partial", prompt) == 32
    assert [manager.is_cached(b) for b in manager.block_table("a")] == [True] * 2 + [False] * 5


def test_a_prefix_hit_leaves_at_least_one_token_to_compute() -> None:
    manager = KVCacheManager(num_gpu_blocks=32, block_size=16)
    manager.allocate("a", list(range(96)))
    manager.mark_computed("a", 96)
    assert manager.allocate("same", list(range(96))) == 80
    assert manager.allocate("one more", list(range(97))) == 96
    assert manager.allocate("one block", list(range(16))) == 0


def test_freed_cached_blocks_stay_reusable_until_evicted_lru_first() -> None:
    manager = KVCacheManager(num_gpu_blocks=6, block_size=4)
    old, new = [1] * 8 + [0], [2] * 8 + [0]  # two full blocks each, then a partial block
    tables = {}
    for seq_id, prompt in (("old", old), ("new", new)):
        manager.allocate(seq_id, prompt)
        manager.mark_computed(seq_id, 9)
        tables[seq_id] = manager.block_table(seq_id)
        manager.free(seq_id)
    assert manager.num_free_blocks == 6
    manager.allocate("filler", [3] * 8)  # the uncached blocks are reused first
    assert manager.stats.evictions == 0
    manager.allocate("more", [4] * 4)  # must evict: the least recently freed chain goes first
    assert manager.stats.evictions == 1
    old_head, old_tail = tables["old"][:2]
    assert manager.is_cached(old_head) and not manager.is_cached(old_tail)
    assert all(manager.is_cached(block) for block in tables["new"][:2])
    assert manager.allocate("new again", new) == 8


def test_freeing_releases_a_table_tail_first() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    for i, block in enumerate(blocks):
        pool.cache([block], [(block_hash := bytes([100 + i]), token_bytes := bytes([i]))])
        assert pool.lookup(block_hash, token_bytes) is block
    pool.release(reversed(blocks))
    order = [block.block_id for block in pool.free_queue]
    assert order == [3, blocks[2].block_id, blocks[1].block_id, blocks[0].block_id]


def test_taking_a_cached_block_from_the_middle_of_the_free_queue_touches_only_its_neighbours() -> (
    None
):
    pool = BlockPool(10_000)
    middle = pool.blocks[5_000]
    links = {b.block_id: (b.prev_free, b.next_free) for b in pool.blocks}
    before, after = middle.prev_free, middle.next_free
    pool.touch([middle])
    changed = {b.block_id for b in pool.blocks if (b.prev_free, b.next_free) != links[b.block_id]}
    assert changed == {before.block_id, middle.block_id, after.block_id}
    assert before.next_free is after and after.prev_free is before
    assert pool.num_free_blocks == 9_999
    pool.check_invariants()


def test_copy_on_write_gives_the_writer_a_private_copy_of_a_shared_partial_block() -> None:
    manager = KVCacheManager(num_gpu_blocks=10, block_size=4)
    manager.allocate("parent", list(range(6)))
    manager.fork("parent", "child")
    shared_last = manager.block_table("parent")[-1]
    [copy] = manager.append("child", [42])
    assert (copy.kind, copy.src) == (MoveKind.COPY, shared_last)
    assert manager.block_table("child")[-1] == copy.dst
    assert not manager.append("parent", [43])  # the parent is now the only holder
    assert manager.block_table("parent")[-1] == shared_last
    assert manager.block_table("parent")[0] == manager.block_table("child")[0]
    assert manager.stats.cow_copies == 1


def test_swap_out_keeps_blocks_a_sequence_still_on_the_gpu_shares() -> None:
    manager = KVCacheManager(num_gpu_blocks=10, block_size=4, num_cpu_blocks=10)
    manager.allocate("a", list(range(10)))
    manager.mark_computed("a", 10)
    manager.fork("a", "b")
    table = manager.block_table("a")
    plan = manager.swap_out("a")
    assert {move.kind for move in plan} == {MoveKind.SWAP_OUT}
    assert [gpu for gpu, _ in plan.pairs()] == table
    assert manager.block_table("b") == table
    assert all(manager.block_ref_count(b) == 1 for b in table)
    assert manager.num_free_cpu_blocks == 7
    back = manager.swap_in("a")  # the two full blocks are reused from b, the last is copied
    last = BlockMove(MoveKind.SWAP_IN, plan.moves[2].dst, manager.block_table("a")[2])
    assert back.moves == [last]
    assert manager.block_table("a")[:2] == table[:2]
    manager.check_invariants()
