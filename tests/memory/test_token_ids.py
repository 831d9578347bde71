"""Token ids are checked where they enter; mark_computed is all-or-nothing like the rest."""

from __future__ import annotations

import hashlib

import pytest

from pagedkv.memory import InvalidTokenIds, KVCacheManager

from .test_rules import snapshot

SHA256 = hashlib.sha256
BAD_IDS = [2**70, 2**63, -1, -(2**70), "x", None, 1.5, True, False, 3.0]


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
@pytest.mark.parametrize("position", [0, 5, 9])  # first block, a later full block, last partial
def test_allocate_rejects_an_id_that_is_not_an_int_in_0_to_2_63(caching, bad, position) -> None:
    manager = KVCacheManager(num_gpu_blocks=8, block_size=4, enable_prefix_caching=caching)
    prompt = list(range(10))
    prompt[position] = bad
    before = snapshot(manager)
    with pytest.raises(InvalidTokenIds) as error:
        manager.allocate("a", prompt)
    assert (error.value.position, error.value.token_id) == (position, bad)
    message = f"token id {bad!r} at position {position} is not an int in [0, 2**63)"
    assert message in str(error.value)
    assert isinstance(error.value, ValueError)
    assert snapshot(manager) == before and "a" not in manager


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_append_rejects_a_bad_id_and_changes_nothing(caching, bad) -> None:
    manager = KVCacheManager(num_gpu_blocks=8, block_size=4, enable_prefix_caching=caching)
    manager.allocate("a", [1, 2, 3])
    manager.fork("a", "b")  # the next append would copy the shared last block
    before = snapshot(manager)
    with pytest.raises(InvalidTokenIds, match=r"sequence 'a': .* at position 5 "):
        manager.append("a", [4, 5, 6, 7, 8, bad])
    assert snapshot(manager) == before


def test_the_issue_example_is_rejected_with_caching_off() -> None:
    manager = KVCacheManager(num_gpu_blocks=8, block_size=4, enable_prefix_caching=False)
    with pytest.raises(InvalidTokenIds, match="token id 1180591620717411303424 at position 0"):
        manager.allocate("a", [2**70, "x", None, 1.5])


def test_the_extreme_valid_ids_are_stored_hashed_and_hit() -> None:
    manager = KVCacheManager(num_gpu_blocks=8, block_size=2)
    prompt = [0, 2**63 - 1, 2**63 - 1, 0, 7]
    manager.allocate("a", prompt)
    manager.mark_computed("a", 5)
    assert manager.allocate("b", prompt) == 4


class FailingHash:
    """SHA-256 that runs out of memory on its second call."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, data: bytes) -> object:
        self.calls += 1
        if self.calls == 2:
            raise MemoryError("out of memory while hashing")
        return SHA256(data)


def test_mark_computed_records_nothing_if_hashing_a_block_fails(monkeypatch) -> None:
    manager = KVCacheManager(num_gpu_blocks=8, block_size=2)
    manager.allocate("a", [1, 2, 3, 4, 5])
    monkeypatch.setattr("hashlib.sha256", FailingHash())
    before = snapshot(manager)
    with pytest.raises(MemoryError):
        manager.mark_computed("a", 5)
    assert snapshot(manager) == before
    assert manager.num_computed_tokens("a") == 0
    monkeypatch.undo()
    manager.mark_computed("a", 5)
    assert [manager.is_cached(block) for block in manager.block_table("a")] == [True, True, False]
    manager.check_invariants()
