"""Chained block hashes: the identity of a full block of tokens in the prefix cache.

A block's hash covers its own token ids and, through the parent hash, every token before
it, so equal hashes mean equal prefixes. The hash is SHA-256: Python's built-in `hash` is
fast but predictable, and in a server shared by many clients a crafted prompt that collides
with another client's chain would be served that client's KV. The pool also compares a
hit's token bytes, a cheap second guard.

A `cache_salt` starts a chain from a root of its own instead of `ROOT_HASH`, so prompts with
different salts (tenants) never share a block and one tenant cannot probe another's prompts
by timing cache hits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

from pagedkv.memory.tokens import BYTES_PER_TOKEN

BlockHash = bytes
ROOT_HASH: BlockHash = b""
# Token bytes never look like this (each int64's sign byte is below 0x80), so a salted root
# can never equal the hash of a block of tokens: salted and unsalted chains stay apart.
_SALT_PREFIX = b"\xff" * BYTES_PER_TOKEN


def root_hash(cache_salt: str | None) -> BlockHash:
    """The parent hash of a sequence's first block: `ROOT_HASH`, or one derived from its salt."""
    if cache_salt is None:
        return ROOT_HASH
    if not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
    return hashlib.sha256(_SALT_PREFIX + cache_salt.encode()).digest()


def chain_hashes(
    parent_hash: BlockHash, token_bytes: bytes, block_size: int
) -> Iterator[tuple[BlockHash, bytes]]:
    """(hash, token bytes) of each full block of `token_bytes`, chained from `parent_hash`.

    A block's hash is SHA-256 of its parent's hash followed by its token bytes. Lazy, so a
    caller that stops at the first prefix-cache miss hashes one block only.
    """
    sha256 = hashlib.sha256  # looked up once: this loop runs once per block
    block_bytes = block_size * BYTES_PER_TOKEN
    for offset in range(0, len(token_bytes) - block_bytes + 1, block_bytes):
        block_tokens = token_bytes[offset : offset + block_bytes]
        parent_hash = sha256(parent_hash + block_tokens).digest()
        yield parent_hash, block_tokens
