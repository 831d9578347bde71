"""Block hashes chain through every earlier token; a cache salt starts a chain of its own."""

from __future__ import annotations

import hashlib
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.memory.hashing import ROOT_HASH, chain_hashes, root_hash


def encoded(token_ids: list[int]) -> bytes:
    return array("q", token_ids).tobytes()


def reference_chain(token_ids: list[int], block_size: int) -> list[bytes]:
    """SHA-256 over parent hash + the block's ids as little-endian int64, block by block."""
    hashes, parent = [], ROOT_HASH
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        block = token_ids[start : start + block_size]
        payload = b"".join(t.to_bytes(8, "little", signed=True) for t in block)
        parent = hashlib.sha256(parent + payload).digest()
        hashes.append(parent)
    return hashes


@settings(deadline=None)  # a loaded CI machine must not turn slowness into a failure
@given(st.lists(st.integers(0, 2**31), max_size=200), st.integers(1, 17))
def test_chain_hashes_match_a_block_by_block_reference(token_ids, block_size) -> None:
    got = [block_hash for block_hash, _ in chain_hashes(ROOT_HASH, encoded(token_ids), block_size)]
    assert got == reference_chain(token_ids, block_size)


def test_the_same_block_after_a_different_prefix_hashes_differently() -> None:
    block = list(range(16))
    first = list(chain_hashes(ROOT_HASH, encoded([1] * 16 + block), 16))
    second = list(chain_hashes(ROOT_HASH, encoded([2] * 16 + block), 16))
    assert first[1][1] == second[1][1]  # same token bytes
    assert first[1][0] != second[1][0]  # different chain


def test_a_salt_gives_its_own_root_and_no_salt_the_plain_root() -> None:
    assert root_hash(None) == ROOT_HASH
    assert root_hash("tenant-a") == root_hash("tenant-a")
    assert len({root_hash("tenant-a"), root_hash("tenant-b"), root_hash(""), ROOT_HASH}) == 4
    with pytest.raises(TypeError, match="cache_salt must be a str or None, got bytes"):
        root_hash(b"tenant-a")


def test_a_salt_spelling_a_block_of_tokens_does_not_continue_that_unsalted_chain() -> None:
    # Hashing the salt's bytes alone would make this salt's root the hash of block [65, 66],
    # so the salted tenant would share every later block of prompts starting with it.
    block = encoded([65, 66])
    salt = block.decode()
    [(first_block, _)] = chain_hashes(ROOT_HASH, block, 2)
    assert hashlib.sha256(salt.encode()).digest() == first_block
    assert root_hash(salt) != first_block
