"""Block-table updates: what a runner keeping each sequence's table must apply, and no more.

`take_table_update` reports the table from its first changed entry on: the whole table for a
new, forked or swapped-in sequence, the new entries after growth, and the copied entry after
a copy-on-write. Applied to a kept table it always gives back `block_table`.
"""

from __future__ import annotations

from pagedkv.memory import KVCacheManager
from pagedkv.memory.tokens import SequenceTokens


def test_a_new_sequence_reports_its_whole_table_once() -> None:
    manager = KVCacheManager(8, block_size=4)
    manager.allocate("a", list(range(6)))
    assert manager.take_table_update("a") == (0, manager.block_table("a"))
    assert manager.take_table_update("a") is None


def test_growth_reports_only_the_new_entries() -> None:
    manager = KVCacheManager(8, block_size=4)
    manager.allocate("a", list(range(6)))
    manager.take_table_update("a")
    manager.append("a", [1])  # 7 tokens: still two blocks
    assert manager.take_table_update("a") is None
    manager.append("a", [1, 2])  # 9 tokens: a third block
    table = manager.block_table("a")
    assert manager.take_table_update("a") == (2, table[2:])


def test_a_copy_on_write_reports_the_copied_entry() -> None:
    manager = KVCacheManager(8, block_size=4)
    manager.allocate("a", list(range(6)))
    manager.take_table_update("a")
    manager.fork("a", "b")
    assert manager.take_table_update("b") == (0, manager.block_table("a"))
    plan = manager.append("a", [9])  # the shared partial last block is copied for "a"
    assert len(plan) == 1
    assert manager.take_table_update("a") == (1, manager.block_table("a")[1:])
    manager.append("b", [8])  # "b" now owns the old block alone: no copy, no change
    assert manager.take_table_update("b") is None


def test_swap_in_reports_the_whole_new_table() -> None:
    manager = KVCacheManager(8, block_size=4, num_cpu_blocks=4)
    manager.allocate("a", list(range(6)))
    manager.take_table_update("a")
    manager.swap_out("a")
    manager.allocate("intruder", list(range(100, 124)))  # takes the freed blocks
    manager.swap_in("a")
    assert manager.take_table_update("a") == (0, manager.block_table("a"))


def test_a_shared_record_is_read_not_copied_and_freed_kv_is_not_computed() -> None:
    manager = KVCacheManager(8, block_size=4)
    record = SequenceTokens("a", [5, 6, 7])
    assert manager.allocate("a", record) == 0
    manager.mark_computed("a", 3)
    assert manager.num_computed_tokens("a") == 3
    record.extend([8, 9])  # the owner samples; the manager gives the new tokens slots
    allocation = manager.allocate_slots("a", record, len(record))
    assert allocation is not None and allocation.table_update == (0, manager.block_table("a"))
    assert manager.num_tokens("a") == 5 and manager.num_computed_tokens("a") == 3
    manager.free("a")
    assert manager.allocate_slots("a", record, len(record)).num_cached == 0
    assert manager.num_computed_tokens("a") == 0
