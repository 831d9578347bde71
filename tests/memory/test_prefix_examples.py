"""The issue's prefix-caching examples, block size 16: A computes 100 tokens and is freed."""

from __future__ import annotations

import pytest

from pagedkv.memory import KVCacheManager

PROMPT_A = list(range(1000, 1100))


class Collide:
    """A hash under which every block collides."""

    def digest(self) -> bytes:
        return b"collide"


@pytest.fixture
def manager() -> KVCacheManager:
    manager = KVCacheManager(num_gpu_blocks=64, block_size=16)
    manager.allocate("A", PROMPT_A)
    manager.mark_computed("A", 100)
    manager.free("A")
    return manager


def test_the_same_100_tokens_get_96_cached(manager: KVCacheManager) -> None:
    assert manager.allocate("B", PROMPT_A) == 96


def test_the_same_first_40_then_different_get_32_cached(manager: KVCacheManager) -> None:
    assert manager.allocate("B", PROMPT_A[:40] + [7] * 60) == 32


def test_an_identical_96_token_prompt_gets_80_cached(manager: KVCacheManager) -> None:
    manager.allocate("B", PROMPT_A[:96])
    manager.mark_computed("B", 96)
    assert manager.allocate("C", PROMPT_A[:96]) == 80


def test_a_hash_collision_is_not_a_hit(manager: KVCacheManager, monkeypatch) -> None:
    monkeypatch.setattr("hashlib.sha256", lambda data: Collide())
    manager.allocate("X", [5] * 40)
    manager.mark_computed("X", 40)
    assert manager.allocate("Y", [6] * 40) == 0


def test_a_block_after_a_different_prefix_is_not_a_hit(manager: KVCacheManager) -> None:
    same_second_block = PROMPT_A[16:32]
    assert manager.allocate("B", [7] * 16 + same_second_block + [8]) == 0


def test_without_prefix_caching_nothing_is_cached() -> None:
    manager = KVCacheManager(num_gpu_blocks=64, block_size=16, enable_prefix_caching=False)
    manager.allocate("A", PROMPT_A)
    manager.mark_computed("A", 100)
    assert manager.allocate("B", PROMPT_A) == 0
    assert manager.stats.prefix_hit_tokens == 0


def test_stats_count_queried_and_hit_tokens(manager: KVCacheManager) -> None:
    manager.allocate("B", PROMPT_A)
    assert manager.stats.prefix_queried_tokens == 200
    assert manager.stats.prefix_hit_tokens == 96
    assert manager.stats.prefix_hit_rate == pytest.approx(0.48)


def test_read_cache_false_computes_everything_and_still_offers_its_blocks(
    manager: KVCacheManager,
) -> None:
    cached_blocks = {b for b in range(manager.num_gpu_blocks) if manager.is_cached(b)}
    queried = manager.stats.prefix_queried_tokens
    assert manager.allocate("B", PROMPT_A, read_cache=False) == 0
    assert not cached_blocks & set(manager.block_table("B"))  # fresh blocks, not A's
    assert manager.stats.prefix_queried_tokens == queried  # it asked the cache nothing
    manager.mark_computed("B", 100)
    manager.free("B")
    manager.check_invariants()
    assert manager.allocate("C", PROMPT_A) == 96
