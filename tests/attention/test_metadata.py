"""The step's attention plan reads what the sequences hold, not num_seqs x longest context."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.attention import metadata as attention_metadata
from pagedkv.attention.metadata import AttentionMetadata

KEY_BYTES_PER_BLOCK = 16 * 8 * 128 * 4  # a 16-token block of a Llama-8B layer, float32


def plan(
    context_lens: list[int], query_lens: list[int], block_size: int, window: int | None = None
) -> AttentionMetadata:
    max_blocks = max(-(-n // block_size) for n in context_lens)
    block_tables = torch.arange(len(context_lens) * max_blocks, dtype=torch.int32)
    return AttentionMetadata.build(
        block_tables.view(len(context_lens), max_blocks),
        context_lens,
        query_lens,
        block_size,
        window,
        KEY_BYTES_PER_BLOCK,
    )


@settings(max_examples=60, deadline=None)
@given(
    context_lens=st.lists(st.integers(1, 3000), min_size=1, max_size=80),
    block_size=st.sampled_from([1, 16, 32]),
    window=st.one_of(st.none(), st.integers(1, 600)),
)
def test_decode_reads_at_most_one_seventh_more_blocks_than_held(
    context_lens: list[int], block_size: int, window: int | None
) -> None:
    decode = plan(context_lens, [1] * len(context_lens), block_size, window).decode
    assert decode is not None
    visible = [n if window is None else min(n, window) for n in context_lens]
    # Blocks holding a visible key: a window may start mid-block, so one more at most.
    held = sum(-(-n // block_size) + (window is not None) for n in visible)
    read = sum(chunk.blocks.numel() for chunk in decode.chunks)
    divisor = attention_metadata.WASTE_DIVISOR
    assert read * (divisor - 1) <= held * divisor
    keys_per_chunk = [chunk.blocks.numel() * KEY_BYTES_PER_BLOCK for chunk in decode.chunks]
    assert max(keys_per_chunk) <= max(attention_metadata.DECODE_CHUNK_BYTES, KEY_BYTES_PER_BLOCK)


def test_one_long_context_among_short_ones_reads_its_own_length() -> None:
    """The issue's case: 63 x 16 + 1 x 8,192 used to read 64 x 8,192 keys."""
    decode = plan([16] * 63 + [8192], [1] * 64, block_size=16).decode
    assert decode is not None
    assert sum(chunk.blocks.numel() for chunk in decode.chunks) == 63 + 8192 // 16
    assert decode.rows[0] == 63  # longest first


@pytest.mark.parametrize("window", [None, 5000])
def test_a_whole_prompt_is_causal_with_no_mask(window: int | None) -> None:
    (prefill,) = plan([5000], [5000], block_size=16, window=window).prefills
    (chunk,) = prefill.chunks
    assert chunk.causal and chunk.mask is None
    assert (chunk.query_start, chunk.query_stop, chunk.key_start, chunk.key_stop) == (
        0,
        5000,
        0,
        5000,
    )


@pytest.mark.parametrize(
    ("context_len", "query_len", "window"), [(9000, 3000, None), (9000, 9000, 512)]
)
def test_prefix_and_window_prefills_mask_in_bounded_chunks(
    context_len: int, query_len: int, window: int | None
) -> None:
    (prefill,) = plan([context_len], [query_len], block_size=16, window=window).prefills
    rows = [chunk.query_stop - chunk.query_start for chunk in prefill.chunks]
    assert sum(rows) == query_len
    for chunk in prefill.chunks:
        assert not chunk.causal
        assert chunk.mask is not None
        assert chunk.mask.numel() <= attention_metadata.PREFILL_MASK_ELEMENTS
        assert chunk.mask.shape == (
            chunk.query_stop - chunk.query_start,
            chunk.key_stop - chunk.key_start,
        )
    if window is not None:  # each chunk reads its rows' windows, not the whole context
        assert all(c.key_stop - c.key_start < len(c.mask) + window for c in prefill.chunks)
