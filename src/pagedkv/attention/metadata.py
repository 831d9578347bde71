"""AttentionMetadata: the batch's layout as attention reads it, built once per forward pass.

Every layer attends over the same sequences, so which rows decode and which prefill, where
each prefill's queries start, which block columns the decode kernel walks and which keys each
query may see are facts of the step, not of the layer. They are worked out here once per
forward (once per distinct sliding window) from Python ints the batch builder already holds,
and every tensor is created on the block tables' device: no layer computes them again, calls
``.tolist()`` or syncs with the host.

Decode planning (the engine's steady state). Decoding sequences are sorted longest first and
cut into groups of neighbours (similar lengths); within a group the sequences still reading at
a block column are a prefix of it. The kernel walks each group's columns in chunks sized so
their keys fit ``DECODE_CHUNK_BYTES``. A chunk ends where its shortest sequence ends unless
reading on (masked) wastes little, so the blocks read are within ``1 / (WASTE_DIVISOR - 1)``
of the blocks held: cost follows the sum of the contexts, not num_seqs x longest context.

Prefill planning. A whole prompt that fits its window (if any) attends causally (``is_causal``,
no mask). Otherwise (a cached prefix, or a window shorter than the prompt) the queries are cut
into chunks whose boolean mask holds at most ``PREFILL_MASK_ELEMENTS``, each chunk reading only
the keys it can see; the masks are built with the plan, once per forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import torch
from torch import Tensor

# Bytes of keys (or values) the decode kernel gathers at a time: large enough that the Python
# loop's per-chunk cost is small, small enough that a chunk stays in cache between its gather
# and its matmuls. 2 MiB with chunks of at least 8 columns (below) was best of 0.5-4 MiB and
# 4-16 columns on a shared 2-core EPYC (bench/attention_bench.py, all rows).
DECODE_CHUNK_BYTES = 2 << 20
# A chunk reads past a sequence's last block (masked) while that wastes at most 1/8 of its keys;
# beyond that it ends with the sequence, at the price of one more chunk.
WASTE_DIVISOR = 8
# Sequences are walked in groups of similar length, few enough that a chunk gives each at least
# this many block columns: multiplying 16-token slivers of many sequences costs more per key.
MIN_CHUNK_COLS = 8
# Largest prefill mask chunk (query rows x keys, one byte each).
PREFILL_MASK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class DecodeChunk:
    """Block columns read together by a run of sequences of the decode order."""

    rows: slice  # the sequences reading this chunk, as positions in the decode order
    blocks: Tensor  # [num_active, num_cols] int64 block ids
    hidden: Tensor | None  # [num_active, num_cols * block_size] bool: keys to mask, or None


@dataclass(frozen=True)
class DecodePlan:
    """The one-token queries of a step, longest context first, and the chunks they read."""

    rows: Tensor  # [num_decodes] int64, flat query row of each, in decode order
    chunks: tuple[DecodeChunk, ...]
    max_chunk_blocks: int  # the most blocks one chunk gathers: the scratch buffer's size


@dataclass(frozen=True)
class PrefillChunk:
    """Query rows ``[query_start, query_stop)`` attending to keys ``[key_start, key_stop)``."""

    query_start: int  # flat row in the batch
    query_stop: int
    key_start: int  # index into the sequence's gathered keys (PrefillPlan.key_slots)
    key_stop: int
    mask: Tensor | None  # [rows, keys] bool, True where visible; None when causal
    causal: bool


@dataclass(frozen=True)
class PrefillPlan:
    """One sequence with several new tokens: where its visible keys live, and its chunks."""

    key_slots: Tensor  # [num_keys] int64 flat cache slots of the keys any of its queries see
    chunks: tuple[PrefillChunk, ...]


@dataclass
class AttentionMetadata:
    """Everything `paged_attention` needs besides the tensors, for one forward pass."""

    device: torch.device  # where every tensor of the plan lives: the block tables'
    num_tokens: int
    block_size: int
    sliding_window: int | None
    decode: DecodePlan | None
    prefills: tuple[PrefillPlan, ...]
    # Scratch memory of the decode kernel, allocated by the first layer and reused by the rest.
    scratch: dict[tuple[object, ...], tuple[Tensor, Tensor]] = field(
        default_factory=dict, repr=False
    )

    @classmethod
    def build(
        cls,
        block_tables: Tensor,
        context_lens: Sequence[int],
        query_lens: Sequence[int],
        block_size: int,
        sliding_window: int | None,
        key_bytes_per_block: int,
    ) -> AttentionMetadata:
        """Plan one step's attention; ``key_bytes_per_block`` sizes the decode chunks.

        ``block_tables`` is ``[num_seqs, max_blocks]`` on the device attention runs on; the
        lengths are Python ints (the batch builder has them), so nothing here waits on it.
        """
        _check_lengths(block_tables, context_lens, query_lens, block_size, sliding_window)
        starts = [0, *accumulate(query_lens)]
        decoding = [s for s, q_len in enumerate(query_lens) if q_len == 1]
        decode = None
        if decoding:
            budget = max(1, DECODE_CHUNK_BYTES // key_bytes_per_block)
            decode = _plan_decode(
                block_tables, decoding, starts, context_lens, block_size, sliding_window, budget
            )
        prefills = tuple(
            _plan_prefill(block_tables, s, starts[s], q_len, ctx, block_size, sliding_window)
            for s, (q_len, ctx) in enumerate(zip(query_lens, context_lens, strict=True))
            if q_len > 1
        )
        return cls(block_tables.device, starts[-1], block_size, sliding_window, decode, prefills)


def _plan_decode(
    block_tables: Tensor,
    decoding: list[int],
    starts: list[int],
    context_lens: Sequence[int],
    block_size: int,
    sliding_window: int | None,
    budget_blocks: int,
) -> DecodePlan:
    """Sort the decoding sequences longest first and cut their block columns into chunks.

    Column ``c`` of a sequence is its logical block ``first + c``, where ``first`` is 0, or
    with a window the block holding its oldest visible key, so a long context under a short
    window costs only the window. The chunks are slices of one ``[num_decodes, max_cols]``
    table of block ids (8 bytes per block: padded, but a 16-token block's K/V take kilobytes).
    """
    device = block_tables.device
    window_starts = {
        s: 0 if sliding_window is None else max(0, context_lens[s] - sliding_window)
        for s in decoding
    }
    num_cols = {
        s: (context_lens[s] - 1) // block_size - window_starts[s] // block_size + 1
        for s in decoding
    }
    order = sorted(decoding, key=lambda s: -num_cols[s])
    cols_sorted = [num_cols[s] for s in order]
    # Whether a sequence's last (first) column holds keys past its context (before its window).
    partial_last = [context_lens[s] % block_size != 0 for s in order]
    partial_first = any(window_starts[s] % block_size for s in order)

    def tensor(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    ctx = tensor([context_lens[s] for s in order])
    first_block = tensor([window_starts[s] // block_size for s in order])
    cols = first_block[:, None] + torch.arange(cols_sorted[0], device=device)
    owned = cols < (first_block + tensor(cols_sorted))[:, None]
    table_cols = cols.clamp(max=block_tables.shape[1] - 1)
    blocks = block_tables[tensor(order)[:, None], table_cols].long().where(owned, 0)
    offsets = torch.arange(block_size, device=device)

    def hidden(rows: slice, col_span: slice) -> Tensor:  # [rows, keys]: keys to mask
        key_pos = (cols[rows, col_span, None] * block_size + offsets).flatten(1)
        query_pos = ctx[rows, None] - 1
        if sliding_window is None:
            return key_pos > query_pos
        return (key_pos > query_pos) | (query_pos - key_pos >= sliding_window)

    chunks = []
    group_size = max(1, budget_blocks // MIN_CHUNK_COLS)
    for group_start in range(0, len(order), group_size):
        group_cols = cols_sorted[group_start : group_start + group_size]
        start_col, num_active = 0, len(group_cols)
        while start_col < group_cols[0]:
            while group_cols[num_active - 1] <= start_col:
                num_active -= 1
            stop_col = _chunk_stop(group_cols[:num_active], start_col, budget_blocks)
            last = group_start + num_active - 1
            needs_mask = (start_col == 0 and partial_first) or stop_col > cols_sorted[last]
            ending = last  # sorted longest first: rows ending here are at the end
            while not needs_mask and ending >= group_start and cols_sorted[ending] <= stop_col:
                needs_mask = partial_last[ending]
                ending -= 1
            rows, col_span = slice(group_start, last + 1), slice(start_col, stop_col)
            chunks.append(
                DecodeChunk(
                    rows,
                    blocks[rows, col_span].contiguous(),
                    hidden(rows, col_span) if needs_mask else None,
                )
            )
            start_col = stop_col
    max_chunk_blocks = max(chunk.blocks.numel() for chunk in chunks)
    return DecodePlan(tensor([starts[s] for s in order]), tuple(chunks), max_chunk_blocks)


def _chunk_stop(cols_sorted: list[int], start_col: int, budget_blocks: int) -> int:
    """Where a chunk starting at ``start_col`` over these (all still reading) sequences ends."""
    shortest = cols_sorted[-1]
    width = max(1, budget_blocks // len(cols_sorted))
    stop = start_col + width
    if shortest >= stop:
        return stop
    wasted = sum(max(0, stop - cols) for cols in cols_sorted)
    return shortest if wasted * WASTE_DIVISOR > width * len(cols_sorted) else stop


def _plan_prefill(
    block_tables: Tensor,
    seq: int,
    row_start: int,
    query_len: int,
    context_len: int,
    block_size: int,
    sliding_window: int | None,
) -> PrefillPlan:
    """The keys one prefilling sequence's queries can see, and its query chunks."""
    device = block_tables.device
    first_query = context_len - query_len
    first_key = 0 if sliding_window is None else max(0, first_query - sliding_window + 1)
    key_pos = torch.arange(first_key, context_len, device=device)
    key_slots = block_tables[seq].long()[key_pos // block_size] * block_size + key_pos % block_size
    if first_query == 0 and (sliding_window is None or context_len <= sliding_window):
        whole = PrefillChunk(row_start, row_start + query_len, 0, context_len, None, causal=True)
        return PrefillPlan(key_slots, (whole,))
    rows_per_chunk = max(1, PREFILL_MASK_ELEMENTS // (context_len - first_key))
    chunks = []
    for q_start in range(first_query, context_len, rows_per_chunk):
        q_stop = min(q_start + rows_per_chunk, context_len)
        k_start = first_key if sliding_window is None else max(0, q_start - sliding_window + 1)
        query_pos = torch.arange(q_start, q_stop, device=device)[:, None]
        chunk_keys = torch.arange(k_start, q_stop, device=device)
        visible = chunk_keys <= query_pos
        if sliding_window is not None:
            visible &= query_pos - chunk_keys < sliding_window
        rows = row_start + q_start - first_query
        chunks.append(
            PrefillChunk(
                rows,
                rows + q_stop - q_start,
                k_start - first_key,
                q_stop - first_key,
                visible,
                causal=False,
            )
        )
    return PrefillPlan(key_slots, tuple(chunks))


def _check_lengths(
    block_tables: Tensor,
    context_lens: Sequence[int],
    query_lens: Sequence[int],
    block_size: int,
    sliding_window: int | None,
) -> None:
    """Raise ValueError naming the first sequence whose lengths its table cannot hold."""
    if block_tables.dim() != 2:
        raise ValueError(
            f"block_tables must be [num_seqs, max_blocks], got {tuple(block_tables.shape)}"
        )
    num_seqs, max_blocks = block_tables.shape
    for name, lens in (("context_lens", context_lens), ("query_lens", query_lens)):
        if len(lens) != num_seqs:
            raise ValueError(
                f"{name} must have {num_seqs} entries (num_seqs of block_tables), got {len(lens)}"
            )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    for s, (q_len, ctx) in enumerate(zip(query_lens, context_lens, strict=True)):
        if not 1 <= q_len <= ctx:
            raise ValueError(f"sequence {s}: query_len {q_len} must be in [1, context_len {ctx}]")
        if ctx > max_blocks * block_size:
            raise ValueError(
                f"sequence {s}: context_len {ctx} needs {-(-ctx // block_size)} blocks, "
                f"block_tables has {max_blocks}"
            )
