"""Chained block hashes: the identity of a full block of tokens in the prefix cache.

A block's hash covers its own token ids and, through the parent hash, every token before
it, so equal hashes mean equal prefixes. The hash is SHA-256: Python's built-in `hash` is
fast but predictable, and in a server shared by many clients a crafted prompt that collides
with another client's chain would be served that client's KV. The pool also compares a
hit's token bytes, a cheap second guard.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence

BlockHash = bytes
ROOT_HASH: BlockHash = b""
BYTES_PER_TOKEN = array("q").itemsize


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as fixed-width bytes: what block hashes and the collision guard compare."""
    return array("q", token_ids).tobytes()


def hash_block(parent_hash: BlockHash, block_tokens: bytes) -> BlockHash:
    """Hash of one full block given the hash of the block before it (ROOT_HASH for the first)."""
    return hashlib.sha256(parent_hash + block_tokens).digest()


def chain_hashes(
    parent_hash: BlockHash, token_ids: Sequence[int], block_size: int
) -> Iterator[tuple[BlockHash, bytes]]:
    """(hash, token bytes) of each full block of `token_ids`, chained from `parent_hash`.

    Tokens are encoded in runs that double in length, lazily: a caller that stops at the
    first block (a prefix-cache miss) pays for encoding one block, one that hashes all n
    blocks makes log2(n) encoding calls instead of n.
    """
    num_full_blocks = len(token_ids) // block_size
    block_bytes = block_size * BYTES_PER_TOKEN
    first, run = 0, 1
    while first < num_full_blocks:
        stop = min(num_full_blocks, first + run)
        encoded = encode_tokens(token_ids[first * block_size : stop * block_size])
        for offset in range(0, len(encoded), block_bytes):
            block_tokens = encoded[offset : offset + block_bytes]
            parent_hash = hash_block(parent_hash, block_tokens)
            yield parent_hash, block_tokens
        first, run = stop, run * 2
