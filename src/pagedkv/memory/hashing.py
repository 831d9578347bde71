"""Chained block hashes: the identity of a full block of tokens in the prefix cache.

A block's hash covers its own token ids and, through the parent hash, every token before
it, so equal hashes mean equal prefixes (up to collisions, which the pool guards against
by also comparing token ids). Python's hash of a tuple of ints is deterministic across
processes (hash randomisation only applies to str and bytes), and it is fast.
"""

from __future__ import annotations

from collections.abc import Sequence

ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Hash of one full block given the hash of the block before it (ROOT_HASH for the first)."""
    return hash((parent_hash, token_ids))


def extend_block_hashes(
    block_hashes: list[int], token_ids: Sequence[int], block_size: int, num_tokens: int
) -> None:
    """Append to `block_hashes` the hashes of every full block within the first `num_tokens`.

    `block_hashes` already holds the hashes of the leading blocks; only new ones are computed,
    so calling this as a sequence grows costs O(new blocks).
    """
    parent = block_hashes[-1] if block_hashes else ROOT_HASH
    for start in range(len(block_hashes) * block_size, num_tokens - block_size + 1, block_size):
        parent = hash_block(parent, tuple(token_ids[start : start + block_size]))
        block_hashes.append(parent)
