"""Chained block hashes: the identity of a full block of tokens in the prefix cache.

A block's hash covers its own token ids and, through the parent hash, every token before
it, so equal hashes mean equal prefixes. The hash is SHA-256: Python's built-in `hash` is
fast but predictable, and in a server shared by many clients a crafted prompt that collides
with another client's chain would be served that client's KV. The pool also compares a
hit's token ids, a cheap second guard.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes
ROOT_HASH: BlockHash = b""


def hash_block(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block given the hash of the block before it (ROOT_HASH for the first)."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


def extend_block_hashes(
    block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, num_tokens: int
) -> None:
    """Append to `block_hashes` the hashes of every full block within the first `num_tokens`.

    `block_hashes` already holds the hashes of the leading blocks; only new ones are computed,
    so calling this as a sequence grows costs O(new blocks).
    """
    parent = block_hashes[-1] if block_hashes else ROOT_HASH
    for start in range(len(block_hashes) * block_size, num_tokens - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        block_hashes.append(parent)
