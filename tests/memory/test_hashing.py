"""Block hashes chain through every earlier token, and lazy encoding does not change them."""

from __future__ import annotations

import hashlib

from hypothesis import given
from hypothesis import strategies as st

from pagedkv.memory.hashing import ROOT_HASH, chain_hashes


def reference_chain(token_ids: list[int], block_size: int) -> list[bytes]:
    """SHA-256 over parent hash + the block's ids as little-endian int64, block by block."""
    hashes, parent = [], ROOT_HASH
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        block = token_ids[start : start + block_size]
        payload = b"".join(t.to_bytes(8, "little", signed=True) for t in block)
        parent = hashlib.sha256(parent + payload).digest()
        hashes.append(parent)
    return hashes


@given(st.lists(st.integers(0, 2**31), max_size=200), st.integers(1, 17))
def test_chain_hashes_match_a_block_by_block_reference(token_ids, block_size) -> None:
    got = [block_hash for block_hash, _ in chain_hashes(ROOT_HASH, token_ids, block_size)]
    assert got == reference_chain(token_ids, block_size)


def test_the_same_block_after_a_different_prefix_hashes_differently() -> None:
    block = list(range(16))
    first = list(chain_hashes(ROOT_HASH, [1] * 16 + block, 16))
    second = list(chain_hashes(ROOT_HASH, [2] * 16 + block, 16))
    assert first[1][1] == second[1][1]  # same token bytes
    assert first[1][0] != second[1][0]  # different chain
