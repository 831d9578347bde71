"""Attention over paged KV blocks: the one place the model reads and writes the cache.

Each layer's cache is a pair ``k_cache``, ``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``p`` of a sequence lives in flat
slot ``block_table[p // block_size] * block_size + p % block_size``; the block table is the only
thing that says where a sequence's keys are, so blocks can be shared, copied and swapped without
the model noticing.

A batch is flat and unpadded: the new tokens of every sequence, concatenated. What the step
looks like (who decodes, who prefills, which blocks and keys each reads) is planned once per
forward in `AttentionMetadata`; the functions here only run the plan on one layer's tensors.
Sequences that decode (one new token) are attended together by a block-wise kernel whose cost
follows the keys actually held; sequences that prefill are attended one at a time with
``scaled_dot_product_attention`` over their gathered keys (prefill is compute bound, so the
gather is cheap next to the attention itself).

Precision: on the CPU, 16-bit caches are attended in float64. Decode and prefill sum a
query's terms in different orders, and so do a prompt prefilled whole and one whose prefix came
from the cache. In float32 the results differ in their last bits, and rounded to 16 bits they
then differ now and then (a 0.125 logit difference and a flipped greedy token in 20 bf16
prompts of a tiny Llama, issue 7). In float64 they differ by ~1e-16, far below half a 16-bit
ulp, so the rounded outputs agree bit for bit unless an exact value lies within ~1e-16 of a
rounding boundary: outputs do not depend on what was cached
(tests/model/test_prefix_cache_precision.py).

fp8 caches (`attention/fp8.py`) hold the model's values in one byte: `write_kv` rounds the new
keys and values into them, and attention widens each chunk of blocks to the compute dtype as
its gather copies them into its buffer (prefill: the keys its chunk sees), so no step makes a
widened copy of the whole cache; the key scale goes into the score scale and the value scale
into the output. The compute dtype follows the model's (the query's) dtype, as for a cache of
that dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedkv.attention.fp8 import (
    UNIT_SCALES,
    KVScales,
    as_stored,
    check_cache_dtypes,
    is_fp8,
    quantize,
)
from pagedkv.attention.metadata import AttentionMetadata, DecodePlan, PrefillPlan


def compute_dtype(query_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype attention accumulates in for a model computing in ``query_dtype`` (see the
    module doc).

    float64 only for 16-bit models on the CPU, where SDPA's flash kernel takes float64. On a
    GPU this module is the fallback of the Triton kernels, and float64 SDPA there would fall
    back to a kernel that materialises every score, so it accumulates in float32.
    """
    if query_dtype.itemsize >= 4:
        return query_dtype
    return torch.float64 if device.type == "cpu" else torch.float32


def key_bytes_per_block(k_cache: Tensor, query_dtype: torch.dtype) -> int:
    """Bytes one block of keys takes once gathered in the compute dtype (sizes decode chunks)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    return (
        block_size * num_kv_heads * head_dim * compute_dtype(query_dtype, k_cache.device).itemsize
    )


def write_kv(
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    scales: KVScales = UNIT_SCALES,
) -> None:
    """Write the new tokens' keys and values into their cache slots, in place.

    ``key`` and ``value`` are ``[num_tokens, num_kv_heads, head_dim]``; ``slot_mapping`` holds
    one flat slot id (``block * block_size + offset``) per token. An fp8 cache receives them
    rounded (`fp8.quantize`) with ``scales``.
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
    if is_fp8(k_cache.dtype):
        key = as_stored(quantize(key, k_cache.dtype, scales.k))
        value = as_stored(quantize(value, v_cache.dtype, scales.v))
    slots = slot_mapping.long()
    as_stored(k_cache).view(num_blocks * block_size, num_kv_heads, head_dim)[slots] = key
    as_stored(v_cache).view(num_blocks * block_size, num_kv_heads, head_dim)[slots] = value


def paged_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    metadata: AttentionMetadata,
    scale: float,
    scales: KVScales = UNIT_SCALES,
) -> Tensor:
    """Attention of each sequence's new tokens over that sequence's keys in the paged cache.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``, the new tokens of all sequences in order.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, already holding
            the new tokens' keys and values (see :func:`write_kv`).
        metadata: the step's plan (block tables, lengths, sliding window), built once per
            forward; see `AttentionMetadata.build`.
        scale: multiplier of ``q @ k`` (usually ``head_dim ** -0.5``).
        scales: what an fp8 cache's bytes are worth (ignored for other caches).

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in the query's dtype. A query at position ``i``
        attends to positions ``j <= i`` (and ``i - j < sliding_window`` when set, the window
        counting the token itself, as in Mistral): causal within the new tokens, all of the
        cached prefix.
    """
    _check_shapes(query, k_cache, v_cache, metadata)
    # The key scale multiplies every score, the value scale every output: folded into both,
    # they cost nothing per cached value.
    k_scale, v_scale = (scales.k, scales.v) if is_fp8(k_cache.dtype) else (1.0, 1.0)
    dtype = compute_dtype(query.dtype, query.device)
    out = torch.empty_like(query)
    if metadata.decode is not None:
        buffers = _Buffers.for_plan(metadata, metadata.decode, k_cache, dtype)
        out[metadata.decode.rows] = _decode_attention(
            query, k_cache, v_cache, metadata.decode, buffers, scale * k_scale, v_scale
        )
    for plan in metadata.prefills:
        _prefill_attention(query, k_cache, v_cache, plan, scale * k_scale, v_scale, out)
    return out


def _decode_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    plan: DecodePlan,
    buffers: _Buffers,
    scale: float,
    v_scale: float,
) -> Tensor:
    """One new token per sequence, all sequences at once, a chunk of block columns at a time.

    Gathering every sequence's whole context into one tensor would write, then read back, a
    copy as large as the cache itself. Instead each chunk's blocks are copied into one reused
    buffer small enough to stay in cache, and the matmuls read them from there. The query heads
    that share a KV head form one ``[group, head_dim]`` matrix, so each key is multiplied once
    per KV head. Scores are small next to K and V (``num_heads`` floats per key against
    ``2 * num_kv_heads * head_dim``), so each chunk's are kept and the softmax is exact: a pass
    of ``q @ k`` that also finds each query's maximum score, then a pass of ``exp`` and
    ``p @ v``. Kept per chunk, they take memory in proportion to the keys read, never
    num_seqs x longest context. Returns the outputs in decode order (longest context first).
    """
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    dtype = buffers.head_major.dtype
    q = query.index_select(0, plan.rows).to(dtype) * scale
    q = q.view(len(q), num_kv_heads, group, head_dim)
    best = q.new_full((*q.shape[:3], 1), float("-inf"))  # each query head's maximum score
    chunk_scores = []
    for chunk in plan.chunks:
        scores = q[chunk.rows] @ buffers.gather(k_cache, chunk.blocks).transpose(2, 3)
        if chunk.hidden is not None:
            scores.masked_fill_(chunk.hidden[:, None, None, :], float("-inf"))
        best[chunk.rows] = torch.maximum(best[chunk.rows], scores.amax(dim=-1, keepdim=True))
        chunk_scores.append(scores)
    total = torch.zeros_like(best)  # sum of exp(score - best)
    acc = torch.zeros_like(q)  # sum of exp(score - best) * value
    for chunk, scores in zip(plan.chunks, chunk_scores, strict=True):
        probs = scores.sub_(best[chunk.rows]).exp_()
        total[chunk.rows] += probs.sum(dim=-1, keepdim=True)
        values = buffers.gather(v_cache, chunk.blocks)
        if chunk.hidden is not None:
            # A hidden key's weight is 0, but 0 * NaN is NaN: slots past a sequence's length
            # (and padding columns) may never have been written, so their values are zeroed.
            values.masked_fill_(chunk.hidden[:, None, :, None], 0.0)
        acc[chunk.rows].view(-1, group, head_dim).baddbmm_(
            probs.view(-1, group, probs.shape[-1]), values.view(-1, *values.shape[2:])
        )
    out = acc / total
    if v_scale != 1.0:
        out.mul_(v_scale)
    return out.view(len(q), num_heads, head_dim).to(query.dtype)


class _Buffers:
    """Scratch memory the decode kernel gathers each chunk of blocks into, reused per chunk.

    Writing into memory that is already mapped and warm is what keeps the gather cheap: a
    fresh tensor per chunk would be page-faulted in on every call. The buffers live in the
    step's metadata, so every layer of the forward pass reuses the first layer's.
    """

    def __init__(self, rows: Tensor, head_major: Tensor) -> None:
        self.rows = rows  # [blocks, block_size, kv_heads, head_dim], as the cache stores them
        self.head_major = head_major  # the same values, flat, widened to the compute dtype

    @classmethod
    def for_plan(
        cls, metadata: AttentionMetadata, plan: DecodePlan, cache: Tensor, dtype: torch.dtype
    ) -> _Buffers:
        """The step's buffers for caches shaped like ``cache``, computed in ``dtype``, made by
        the first layer."""
        key = (cache.dtype, dtype, cache.device, tuple(cache.shape[1:]))
        if key not in metadata.scratch:
            rows = as_stored(cache).new_empty(plan.max_chunk_blocks, *cache.shape[1:])
            metadata.scratch[key] = (rows, rows.new_empty(rows.numel(), dtype=dtype))
        return cls(*metadata.scratch[key])

    def gather(self, cache: Tensor, blocks: Tensor) -> Tensor:
        """``cache[blocks]`` for ``blocks [seqs, cols]``, laid out for batched matmuls and
        widened to the compute dtype (an fp8 cache's bytes are converted by this copy)."""
        num_seqs, num_cols = blocks.shape
        _, block_size, num_kv_heads, head_dim = cache.shape
        rows = self.rows[: blocks.numel()]
        torch.index_select(as_stored(cache), 0, blocks.flatten(), out=rows)
        per_seq = rows.view(cache.dtype).view(
            num_seqs, num_cols * block_size, num_kv_heads, head_dim
        )
        head_major = self.head_major[: rows.numel()].view(per_seq.transpose(1, 2).shape)
        return head_major.copy_(per_seq.transpose(1, 2))


def _prefill_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    plan: PrefillPlan,
    scale: float,
    v_scale: float,
    out: Tensor,
) -> None:
    """Several new tokens of one sequence: gather the keys they can see (widened to the
    compute dtype), then SDPA per chunk."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    dtype = compute_dtype(query.dtype, query.device)

    def gathered(cache: Tensor) -> Tensor:  # [1, kv_heads, keys, head_dim]
        keys = as_stored(cache).view(-1, num_kv_heads, head_dim).index_select(0, plan.key_slots)
        return keys.view(cache.dtype).transpose(0, 1)[None].to(dtype)

    keys, values = gathered(k_cache), gathered(v_cache)
    for chunk in plan.chunks:
        # A leading batch dimension of 1: with 3-d inputs SDPA on CPU falls back to its math
        # kernel, which materialises [num_heads, q_len, keys] scores (gigabytes for long prompts).
        rows = slice(chunk.query_start, chunk.query_stop)
        attended = slice(chunk.key_start, chunk.key_stop)
        result = F.scaled_dot_product_attention(
            query[rows].transpose(0, 1)[None].to(dtype),
            keys[:, :, attended],
            values[:, :, attended],
            attn_mask=chunk.mask,
            is_causal=chunk.causal,
            scale=scale,
            enable_gqa=True,
        )
        if v_scale != 1.0:
            result.mul_(v_scale)
        out[rows] = result[0].transpose(0, 1)


def _check_shapes(
    query: Tensor, k_cache: Tensor, v_cache: Tensor, metadata: AttentionMetadata
) -> None:
    """Raise ValueError naming the first mismatch between the tensors and the plan."""
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
    check_cache_dtypes(query.dtype, k_cache.dtype, v_cache.dtype)
    if not query.device == k_cache.device == v_cache.device == metadata.device:
        raise ValueError(
            f"query ({query.device}), caches ({k_cache.device}, {v_cache.device}) and the "
            f"batch's block tables ({metadata.device}) must be on one device"
        )
    if num_tokens != metadata.num_tokens:
        raise ValueError(
            f"query has {num_tokens} tokens but the batch's query_lens sum to {metadata.num_tokens}"
        )
    if block_size != metadata.block_size:
        raise ValueError(f"cache block_size {block_size} != the batch's {metadata.block_size}")
