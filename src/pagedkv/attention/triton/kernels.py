"""Triton kernels for paged attention; `triton_attention` launches them.

All kernels read K/V through the block table one tile of ``BLOCK_N`` key positions at a time:
each key's cache row is found from its position (``block_table[pos // BLOCK_SIZE]``, offset
``pos % BLOCK_SIZE``), so a tile may span several cache blocks and the tile size is tuned
apart from the block size. A program holds the query rows of every query head that shares one
KV head (``GROUP`` heads, padded to at least 16 rows for ``tl.dot``), so each K/V tile is read
from memory once per KV head, not once per query head. Softmax is online (running max and sum
per row) in float32, in base 2: ``qk_scale`` already holds ``log2(e)``.

An fp8 cache's tiles are widened to the query's dtype as they are loaded (the hardware's own
conversion; exact, since every fp8 value is a bf16, fp16 and float32 value); its key scale is
in ``qk_scale`` and its value scale multiplies each output once (``v_scale``, 1 otherwise).

- ``_decode_kernel``: one query token per sequence. Each sequence's visible keys (all of them,
  or the sliding window's) are cut into partitions of ``PARTITION_SIZE`` keys; a work item is
  one (sequence, partition) pair, and a fixed grid of programs walks the work list, so the
  cost follows the keys each sequence holds, not the longest context times the batch.
  Partial results go to scratch and ``_merge_partitions_kernel`` combines them by
  log-sum-exp (flash-decoding); with one partition per sequence the kernel writes the output.
- ``_prefill_kernel``: any number of new tokens per sequence over the cached prefix plus
  themselves, causal; one program per (tile of ``BLOCK_Q`` query tokens, KV head).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _decode_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    num_seqs,
    num_heads,
    max_parts,
    qk_scale,
    v_scale,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    SEQS_P: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    kv_head = tl.program_id(1)
    # The work list, rebuilt by every program from context_lens (a few hundred bytes, cached):
    # sequence s owns works ends[s] - parts[s] .. ends[s] - 1.
    seqs = tl.arange(0, SEQS_P)
    context_lens = tl.load(context_lens_ptr + seqs, mask=seqs < num_seqs, other=0)
    # Clamped to the scratch's max_parts: a caller's too-small max_context_len gives wrong
    # numbers, never writes out of bounds.
    parts = tl.minimum(tl.cdiv(tl.minimum(context_lens, window), PARTITION_SIZE), max_parts)
    ends = tl.cumsum(parts, 0)
    num_works = tl.sum(parts, 0)

    rows = tl.arange(0, BLOCK_M)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, HEAD_DIM_P)
    dim_mask = dims < HEAD_DIM
    for work in range(tl.program_id(0), num_works, tl.num_programs(0)):
        seq = tl.sum((ends <= work).to(tl.int32), 0)
        part = work - tl.sum(tl.where(seqs == seq, ends - parts, 0), 0)
        context_len = tl.load(context_lens_ptr + seq)
        key_lo = tl.maximum(context_len - window, 0) + part * PARTITION_SIZE
        key_hi = tl.minimum(key_lo + PARTITION_SIZE, context_len)

        q_offsets = seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :]
        q_mask = row_mask[:, None] & dim_mask[None, :]
        q = tl.load(query_ptr + q_offsets, mask=q_mask, other=0.0)
        query_pos = tl.zeros([BLOCK_M], tl.int32) + context_len - 1
        acc, row_max, row_sum = _attend(
            q,
            query_pos,
            key_lo,
            key_hi,
            block_tables_ptr + seq.to(tl.int64) * stride_bt,
            k_cache_ptr,
            v_cache_ptr,
            kv_head,
            window,
            qk_scale,
            v_scale,
            stride_kb,
            stride_ks,
            stride_kh,
            stride_vb,
            stride_vs,
            stride_vh,
            dims,
            dim_mask,
            BLOCK_M,
            BLOCK_N,
            BLOCK_SIZE,
            HEAD_DIM_P,
            DOT_PRECISION,
        )
        if SPLIT:
            part_index = (seq.to(tl.int64) * num_heads + heads) * max_parts + part
            tl.store(part_max_ptr + part_index, row_max, mask=row_mask)
            tl.store(part_sum_ptr + part_index, row_sum, mask=row_mask)
            acc_ptrs = part_acc_ptr + part_index[:, None] * HEAD_DIM + dims[None, :]
            tl.store(acc_ptrs, acc, mask=q_mask)
        else:
            out_offsets = seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :]
            out = acc / row_sum[:, None]
            tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _merge_partitions_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    context_lens_ptr,
    num_heads,
    max_parts,
    window,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    PARTS_P: tl.constexpr,
):
    """One program per (sequence, query head): rescale each partition to the global max."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    num_parts = tl.minimum(tl.cdiv(tl.minimum(context_len, window), PARTITION_SIZE), max_parts)
    base = (seq.to(tl.int64) * num_heads + head) * max_parts

    parts = tl.arange(0, PARTS_P)
    part_mask = parts < num_parts
    part_max = tl.load(part_max_ptr + base + parts, mask=part_mask, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + base + parts, mask=part_mask, other=0.0)
    global_max = tl.max(part_max, 0)
    total = tl.sum(part_sum * tl.exp2(part_max - global_max), 0)

    dims = tl.arange(0, HEAD_DIM_P)
    dim_mask = dims < HEAD_DIM
    acc = tl.zeros([HEAD_DIM_P], tl.float32)
    for part in range(0, num_parts):
        weight = tl.exp2(tl.load(part_max_ptr + base + part) - global_max)
        part_acc = tl.load(part_acc_ptr + (base + part) * HEAD_DIM + dims, mask=dim_mask)
        acc += weight * part_acc
    out = acc / total
    out_ptrs = out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + dims
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


@triton.jit
def _prefill_kernel(
    out_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    query_start_loc_ptr,
    num_seqs,
    qk_scale,
    v_scale,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SEQS_P: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Sequence s owns tiles first_tile[s] = query_start[s] // BLOCK_Q + s onwards: at least
    # cdiv(query_len, BLOCK_Q) of them, and the launch's num_tokens // BLOCK_Q + num_seqs
    # tiles cover every sequence. Tiles past a sequence's last query token exit.
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seqs = tl.arange(0, SEQS_P)
    seq_mask = seqs < num_seqs
    query_starts = tl.load(query_start_loc_ptr + seqs, mask=seq_mask, other=0)
    first_tiles = query_starts // BLOCK_Q + seqs
    seq = tl.sum(((first_tiles <= tile) & seq_mask).to(tl.int32), 0) - 1
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    tile_start = (tile - (query_start // BLOCK_Q + seq)) * BLOCK_Q
    if tile_start >= query_len:
        return
    context_len = tl.load(context_lens_ptr + seq)

    # Row r is query token tile_start + r // GROUP_P of head kv_head * GROUP + r % GROUP_P.
    rows = tl.arange(0, BLOCK_M)
    token = tile_start + rows // GROUP_P
    heads = kv_head * GROUP + rows % GROUP_P
    row_mask = (rows % GROUP_P < GROUP) & (rows // GROUP_P < BLOCK_Q) & (token < query_len)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_mask = dims < HEAD_DIM
    q_mask = row_mask[:, None] & dim_mask[None, :]
    flat_token = (query_start + token).to(tl.int64)[:, None]
    q_offsets = flat_token * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(query_ptr + q_offsets, mask=q_mask, other=0.0)

    first_pos = context_len - query_len + tile_start
    query_pos = first_pos + rows // GROUP_P
    key_lo = tl.maximum(first_pos - window + 1, 0)
    key_hi = tl.minimum(first_pos + BLOCK_Q, context_len)
    acc, _, row_sum = _attend(
        q,
        query_pos,
        key_lo,
        key_hi,
        block_tables_ptr + seq.to(tl.int64) * stride_bt,
        k_cache_ptr,
        v_cache_ptr,
        kv_head,
        window,
        qk_scale,
        v_scale,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        dims,
        dim_mask,
        BLOCK_M,
        BLOCK_N,
        BLOCK_SIZE,
        HEAD_DIM_P,
        DOT_PRECISION,
    )
    out = acc / tl.where(row_mask, row_sum, 1.0)[:, None]
    out_offsets = flat_token * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _attend(
    q,
    query_pos,
    key_lo,
    key_hi,
    block_table_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_head,
    window,
    qk_scale,
    v_scale,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    dims,
    dim_mask,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax of ``q`` over key positions ``[key_lo, key_hi)`` of one sequence.

    Returns the unnormalised output ``[BLOCK_M, HEAD_DIM_P]`` (times ``v_scale``), each row's
    running max (base-2 logits) and sum of exponentials. A key is seen by a row at
    ``query_pos`` when ``0 <= query_pos - key < window``. K/V tiles of another dtype than
    ``q`` (fp8) are widened to it.
    """
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    k_head_ptr = k_cache_ptr + kv_head * stride_kh + dims[None, :]
    v_head_ptr = v_cache_ptr + kv_head * stride_vh + dims[None, :]
    for tile_start in range(key_lo, key_hi, BLOCK_N):
        key_pos = tile_start + tl.arange(0, BLOCK_N)
        in_range = key_pos < key_hi
        blocks = tl.load(block_table_ptr + key_pos // BLOCK_SIZE, mask=in_range, other=0)
        offsets = key_pos % BLOCK_SIZE
        kv_mask = in_range[:, None] & dim_mask[None, :]
        k_rows = blocks.to(tl.int64)[:, None] * stride_kb + offsets[:, None] * stride_ks
        k = tl.load(k_head_ptr + k_rows, mask=kv_mask, other=0.0).to(q.dtype)
        v_rows = blocks.to(tl.int64)[:, None] * stride_vb + offsets[:, None] * stride_vs
        v = tl.load(v_head_ptr + v_rows, mask=kv_mask, other=0.0).to(q.dtype)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        distance = query_pos[:, None] - key_pos[None, :]
        visible = in_range[None, :] & (distance >= 0) & (distance < window)
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        # A row that has seen no visible key yet keeps max -inf; subtract 0 there, not -inf.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - safe_max[:, None])
        rescale = tl.exp2(row_max - safe_max)
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        pv = tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * rescale[:, None] + pv
        row_max = new_max
    return acc * v_scale, row_max, row_sum
