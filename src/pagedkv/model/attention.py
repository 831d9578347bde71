"""Attention over paged KV blocks: the one place the model reads and writes the cache.

Each layer's cache is a pair ``k_cache``, ``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``p`` of a sequence lives in flat
slot ``block_table[p // block_size] * block_size + p % block_size``; the block table is the only
thing that says where a sequence's keys are, so blocks can be shared, copied and swapped without
the model noticing.

A batch is flat and unpadded: the new tokens of every sequence, concatenated. Sequences that
decode (one new token) are attended together by a block-wise kernel, because that is the
engine's steady state and it must not cost much more than attention over a contiguous cache.
Sequences that prefill (a prompt, or a chunk of one after a cached prefix) are attended one at
a time with ``scaled_dot_product_attention`` over their gathered keys; prefill is compute bound,
so the gather is cheap next to the attention itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import Tensor

# Bytes of keys (or values) the decode kernel gathers at a time: large enough that the Python
# loop's per-chunk cost is small, small enough that a chunk stays in cache between its gather
# and its matmuls. Of 2, 4, 8 and 16 MiB, 4 was fastest (2-core EPYC, bench/attention_bench.py).
DECODE_CHUNK_BYTES = 4 << 20


def write_kv(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Write the new tokens' keys and values into their cache slots, in place.

    ``key`` and ``value`` are ``[num_tokens, num_kv_heads, head_dim]``; ``slot_mapping`` holds
    one flat slot id (``block * block_size + offset``) per token.
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dim() != 3 or tensor.shape[1:] != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}] to match the cache, "
                f"got {tuple(tensor.shape)}"
            )
    if slot_mapping.shape != (key.shape[0],) or value.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping {tuple(slot_mapping.shape)}, key {tuple(key.shape)} and value "
            f"{tuple(value.shape)} must agree on num_tokens"
        )
    slots = slot_mapping.long()
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slots] = key
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slots] = value


def paged_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    query_lens: Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> Tensor:
    """Attention of each sequence's new tokens over that sequence's keys in the paged cache.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``, the new tokens of all sequences in order.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, already holding
            the new tokens' keys and values (see :func:`write_kv`).
        block_tables: ``[num_seqs, max_blocks_per_seq]``; entries past a sequence's last block
            are padding and never read.
        context_lens: ``[num_seqs]``, tokens per sequence including the new ones.
        query_lens: ``[num_seqs]``, new tokens per sequence; they sum to ``num_tokens``.
        scale: multiplier of ``q @ k`` (usually ``head_dim ** -0.5``).
        sliding_window: if set, a query at position ``i`` sees keys ``j`` with
            ``i - j < sliding_window`` (the window counts the token itself, as in Mistral).

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in the query's dtype. A query at position ``i``
        attends to positions ``j <= i``: causal within the new tokens, all of the cached prefix.
    """
    q_lens, ctx_lens = _check_shapes(
        query, k_cache, v_cache, block_tables, context_lens, query_lens
    )
    args = (k_cache, v_cache, scale, sliding_window)
    if all(n == 1 for n in q_lens):
        return _decode_attention(query, block_tables, context_lens, *args)

    out = torch.empty_like(query)
    starts = [0, *accumulate(q_lens[:-1])]
    decoding = [s for s, n in enumerate(q_lens) if n == 1]
    if decoding:
        rows = torch.tensor([starts[s] for s in decoding])
        seqs = torch.tensor(decoding)
        out[rows] = _decode_attention(query[rows], block_tables[seqs], context_lens[seqs], *args)
    for s, (start, q_len, ctx) in enumerate(zip(starts, q_lens, ctx_lens, strict=True)):
        if q_len > 1:
            out[start : start + q_len] = _prefill_attention(
                query[start : start + q_len], block_tables[s], ctx, *args
            )
    return out


def _decode_attention(
    query: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    scale: float,
    sliding_window: int | None,
) -> Tensor:
    """One new token per sequence, all sequences at once, a few block columns at a time.

    Gathering every sequence's whole context into one tensor would write, then read back, a
    copy as large as the cache itself. Instead the block table is walked a few columns at a
    time: the chunk's blocks are copied into one reused buffer small enough to stay in cache,
    and the matmuls read them from there. The query heads that share a KV head form one
    ``[group, head_dim]`` matrix, so each key is multiplied once per KV head. Scores are small
    next to K and V (``num_heads`` floats per token against ``2 * num_kv_heads * head_dim``),
    so they are kept whole and the softmax is exact: a pass of ``q @ k``, a softmax, a pass of
    ``p @ v``, with no running-max rescaling.
    """
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    table, visible = _decode_blocks(block_tables, context_lens, block_size, sliding_window)
    # float32 whatever the cache dtype: softmax and long sums lose too much in 16 bits.
    q = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).float() * scale
    scores = q.new_empty(*q.shape[:3], visible.shape[1])  # [seqs, kv_heads, group, keys]

    cols_per_chunk = max(1, DECODE_CHUNK_BYTES // (num_seqs * k_cache[0].nbytes))
    buffers = _Buffers.for_chunk(k_cache, num_seqs * cols_per_chunk)
    chunks = [  # (block ids [seqs, cols], the chunk's span of the key axis)
        (table[:, c : c + cols_per_chunk], slice(c * block_size, (c + cols_per_chunk) * block_size))
        for c in range(0, table.shape[1], cols_per_chunk)
    ]
    for blocks, span in chunks:
        k = buffers.gather(k_cache, blocks)  # [seqs, kv_heads, tokens, head_dim]
        scores[..., span] = q @ k.transpose(2, 3)
    scores.masked_fill_(~visible[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.zeros_like(q)
    for blocks, span in chunks:
        out += probs[..., span] @ buffers.gather(v_cache, blocks)
    return out.view(num_seqs, num_heads, head_dim).to(query.dtype)


@dataclass
class _Buffers:
    """Scratch memory the decode kernel gathers each chunk of blocks into, reused per chunk.

    Writing into memory that is already mapped and warm is what keeps the gather cheap: a
    fresh tensor per chunk would be page-faulted in on every call.
    """

    rows: Tensor  # [blocks, block_size, kv_heads, head_dim], as the cache stores them
    head_major: Tensor  # the same values, flat, as float32 [seqs, kv_heads, tokens, head_dim]

    @classmethod
    def for_chunk(cls, cache: Tensor, num_blocks: int) -> _Buffers:
        rows = cache.new_empty(num_blocks, *cache.shape[1:])
        return cls(rows, torch.empty(rows.numel(), dtype=torch.float32))

    def gather(self, cache: Tensor, blocks: Tensor) -> Tensor:
        """``cache[blocks]`` for ``blocks [seqs, cols]``, laid out for batched matmuls."""
        num_seqs, num_cols = blocks.shape
        _, block_size, num_kv_heads, head_dim = cache.shape
        rows = self.rows[: blocks.numel()]
        torch.index_select(cache, 0, blocks.flatten(), out=rows)
        per_seq = rows.view(num_seqs, num_cols * block_size, num_kv_heads, head_dim)
        head_major = self.head_major[: rows.numel()].view(per_seq.transpose(1, 2).shape)
        return head_major.copy_(per_seq.transpose(1, 2))


def _decode_blocks(
    block_tables: Tensor, context_lens: Tensor, block_size: int, sliding_window: int | None
) -> tuple[Tensor, Tensor]:
    """The block columns the decode kernel walks, and which of their keys each query sees.

    Column ``c`` of sequence ``s`` is its logical block ``first[s] + c``, where ``first`` is 0,
    or with a sliding window the block holding the oldest key still in the window; so a long
    context under a short window costs only the window. Columns past a sequence's last block
    point at block 0 (any real block would do) and their keys are masked out, which keeps the
    gather in bounds whatever the table's padding holds.

    Returns ``table [num_seqs, num_cols]`` (int64 block ids) and
    ``visible [num_seqs, num_cols * block_size]`` (bool).
    """
    context_lens = context_lens.long()
    last = (context_lens - 1) // block_size
    first = torch.zeros_like(last)
    if sliding_window is not None:
        first = (context_lens - sliding_window).clamp(min=0) // block_size
    num_cols = int((last - first).max()) + 1
    cols = first[:, None] + torch.arange(num_cols)
    owned = cols <= last[:, None]
    blocks = block_tables.long().gather(1, cols.clamp(max=block_tables.shape[1] - 1))
    table = torch.where(owned, blocks, 0)

    key_pos = (cols[:, :, None] * block_size + torch.arange(block_size)).flatten(1)
    query_pos = context_lens[:, None] - 1
    visible = key_pos <= query_pos
    if sliding_window is not None:
        visible &= query_pos - key_pos < sliding_window
    return table, visible


def _prefill_attention(
    query: Tensor,
    block_table: Tensor,
    context_len: int,
    k_cache: Tensor,
    v_cache: Tensor,
    scale: float,
    sliding_window: int | None,
) -> Tensor:
    """Several new tokens of one sequence: gather the keys they can see, then masked SDPA."""
    q_len, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    first_key = 0
    if sliding_window is not None:
        first_key = max(0, context_len - q_len - sliding_window + 1)
    key_pos = torch.arange(first_key, context_len)
    slots = block_table.long()[key_pos // block_size] * block_size + key_pos % block_size
    keys = k_cache.view(-1, num_kv_heads, head_dim)[slots].transpose(0, 1)
    values = v_cache.view(-1, num_kv_heads, head_dim)[slots].transpose(0, 1)

    query_pos = torch.arange(context_len - q_len, context_len)[:, None]
    visible = key_pos <= query_pos
    if sliding_window is not None:
        visible &= query_pos - key_pos < sliding_window
    # A leading batch dimension of 1: with 3-d inputs SDPA on CPU falls back to its math
    # kernel, which materialises [num_heads, q_len, keys] scores (gigabytes for long prompts).
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None],
        keys[None],
        values[None],
        attn_mask=visible,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _check_shapes(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    query_lens: Tensor,
) -> tuple[list[int], list[int]]:
    """Raise ValueError naming the first mismatch; return query and context lengths as lists."""
    if query.dim() != 3:
        raise ValueError(
            f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if head_dim != cache_head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {cache_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if query.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"query ({query.dtype}) and caches ({k_cache.dtype}, {v_cache.dtype}) differ in dtype"
        )
    if block_tables.dim() != 2:
        raise ValueError(
            f"block_tables must be [num_seqs, max_blocks], got {tuple(block_tables.shape)}"
        )
    num_seqs = block_tables.shape[0]
    for name, lens in (("context_lens", context_lens), ("query_lens", query_lens)):
        if lens.shape != (num_seqs,):
            raise ValueError(
                f"{name} must be [{num_seqs}] (num_seqs of block_tables), got {tuple(lens.shape)}"
            )
    q_lens, ctx_lens = query_lens.tolist(), context_lens.tolist()
    if sum(q_lens) != num_tokens:
        raise ValueError(f"query_lens sum to {sum(q_lens)} but query has {num_tokens} tokens")
    max_context = block_tables.shape[1] * block_size
    for s, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        if not 1 <= q_len <= ctx:
            raise ValueError(f"sequence {s}: query_len {q_len} must be in [1, context_len {ctx}]")
        if ctx > max_context:
            raise ValueError(
                f"sequence {s}: context_len {ctx} needs {-(-ctx // block_size)} blocks, "
                f"block_tables has {block_tables.shape[1]}"
            )
    return q_lens, ctx_lens
