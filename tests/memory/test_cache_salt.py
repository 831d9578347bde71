"""A cache salt isolates prefix caching: blocks are shared only between equal salts."""

from __future__ import annotations

import pytest

from pagedkv.memory import KVCacheManager

PROMPT = list(range(100, 109))  # two full blocks of 4, then one token


def computed(manager: KVCacheManager, seq_id: str, salt: str | None, prompt=PROMPT) -> int:
    num_cached = manager.allocate(seq_id, prompt, cache_salt=salt)
    manager.mark_computed(seq_id, len(prompt))
    return num_cached


@pytest.mark.parametrize(
    ("first", "second", "hit"),
    [("a", "a", 8), ("a", "b", 0), (None, "a", 0), ("a", None, 0), (None, None, 8), ("", None, 0)],
)
def test_prompts_share_blocks_only_under_the_same_salt(first, second, hit) -> None:
    manager = KVCacheManager(num_gpu_blocks=16, block_size=4)
    computed(manager, "first", first)
    assert computed(manager, "second", second) == hit


def test_a_fork_inherits_its_parents_salt() -> None:
    manager = KVCacheManager(num_gpu_blocks=16, block_size=4)
    manager.allocate("parent", PROMPT[:3], cache_salt="a")  # no full block hashed yet
    manager.fork("parent", "child")
    manager.append("child", PROMPT[3:])
    manager.mark_computed("child", len(PROMPT))  # the child's blocks enter the cache
    assert computed(manager, "unsalted", None) == 0
    assert computed(manager, "other tenant", "b") == 0
    assert computed(manager, "same tenant", "a") == 8


def test_swap_in_reuses_only_blocks_cached_under_the_sequences_salt() -> None:
    manager = KVCacheManager(num_gpu_blocks=6, block_size=4, num_cpu_blocks=3)
    computed(manager, "a", "a")
    manager.swap_out("a")
    manager.allocate("filler", list(range(24)))  # evicts every block a left in the cache
    manager.free("filler")
    computed(manager, "b", "b")  # the same tokens, cached under another salt
    assert len(manager.swap_in("a")) == 3  # every block copied back, none of b's reused
    manager.swap_out("a")
    manager.free("b")
    computed(manager, "a2", "a")
    assert len(manager.swap_in("a")) == 1  # the two full blocks come from a2
    manager.check_invariants()


def test_a_salt_that_is_not_a_str_is_rejected_before_anything_changes() -> None:
    manager = KVCacheManager(num_gpu_blocks=4, block_size=4)
    with pytest.raises(TypeError, match="cache_salt must be a str or None, got int"):
        manager.allocate("a", PROMPT, cache_salt=7)
    assert "a" not in manager and manager.num_free_blocks == 4
