"""Paged attention is dense attention read through block tables.

The reference is computed independently: each sequence's K/V laid out contiguously and fed to
``torch.nn.functional.scaled_dot_product_attention`` with an explicit boolean mask built from
positions (causal, plus the sliding window when set). The cache is filled by indexing
``[block, offset]`` directly, so the reference shares no slot arithmetic with the code under test.
"""

from __future__ import annotations

from dataclasses import dataclass
from unittest.mock import patch

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.attention import metadata as attention_metadata
from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.attention.torch_backend import key_bytes_per_block, paged_attention, write_kv


@dataclass
class Batch:
    """A random paged batch plus the contiguous K/V and queries it was built from."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_lens: torch.Tensor
    keys: list[torch.Tensor]  # per sequence [context_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]


def make_batch(
    seqs: list[tuple[int, int]],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    index_dtype: torch.dtype = torch.int32,
) -> Batch:
    """Scatter each sequence's K/V over a shuffled shared block pool; pad tables with junk."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    physical = torch.randperm(num_blocks, generator=gen)
    # Padding must never be read: mix out-of-range ids, -1 and a real block of another sequence.
    padding = [-1, num_blocks + 5, int(physical[0])]
    block_tables = torch.tensor(
        [[padding[i % 3]] * (max(blocks_per_seq) + 1) for i in range(len(seqs))],
        dtype=index_dtype,
    )
    keys, values, queries, used = [], [], [], 0
    for s, (ctx, q_len) in enumerate(seqs):
        table = physical[used : used + blocks_per_seq[s]]
        used += blocks_per_seq[s]
        block_tables[s, : len(table)] = table.to(index_dtype)
        keys.append(torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype))
        values.append(torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype))
        pos = torch.arange(ctx)
        k_cache[table[pos // block_size], pos % block_size] = keys[-1]
        v_cache[table[pos // block_size], pos % block_size] = values[-1]
        shape = (q_len, num_kv_heads * group, head_dim)
        queries.append(torch.randn(shape, generator=gen).to(dtype))
    return Batch(
        query=torch.cat(queries),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        context_lens=torch.tensor([ctx for ctx, _ in seqs], dtype=index_dtype),
        query_lens=torch.tensor([q for _, q in seqs], dtype=index_dtype),
        keys=keys,
        values=values,
    )


def dense_attention(batch: Batch, scale: float, sliding_window: int | None) -> torch.Tensor:
    """Per sequence SDPA on contiguous float32 K/V with an explicit position mask."""
    outputs, start = [], 0
    group = batch.query.shape[1] // batch.keys[0].shape[1]
    for k, v, q_len in zip(batch.keys, batch.values, batch.query_lens.tolist(), strict=True):
        ctx = k.shape[0]
        q = batch.query[start : start + q_len].float().transpose(0, 1)  # [H, q_len, D]
        k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, ctx, D]
        v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        q_pos = torch.arange(ctx - q_len, ctx)[:, None]
        k_pos = torch.arange(ctx)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= q_pos - k_pos < sliding_window
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        outputs.append(out.transpose(0, 1))
        start += q_len
    return torch.cat(outputs)


def attend(
    batch: Batch, scale: float, sliding_window: int | None = None, query: torch.Tensor | None = None
) -> torch.Tensor:
    """`paged_attention` over the batch, its step planned as a forward pass plans it."""
    metadata = AttentionMetadata.build(
        batch.block_tables,
        batch.context_lens.tolist(),
        batch.query_lens.tolist(),
        batch.k_cache.shape[1],
        sliding_window,
        key_bytes_per_block(batch.k_cache, batch.query.dtype),
    )
    query = batch.query if query is None else query
    return paged_attention(query, batch.k_cache, batch.v_cache, metadata, scale)


@st.composite
def sequences(draw: st.DrawFn) -> list[tuple[int, int]]:
    """A mixed batch: decodes, whole prompts, and chunks after a cached prefix."""
    seqs = []
    for _ in range(draw(st.integers(1, 5))):
        ctx = draw(st.integers(1, 90))
        kind = draw(st.sampled_from(["decode", "prefill", "chunk"]))
        q_len = {"decode": 1, "prefill": ctx, "chunk": draw(st.integers(1, ctx))}[kind]
        seqs.append((ctx, q_len))
    return seqs


@settings(max_examples=150, deadline=None)
@given(
    seqs=sequences(),
    num_kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4]),
    block_size=st.sampled_from([1, 16, 32]),
    sliding_window=st.one_of(st.none(), st.integers(1, 40)),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    mask_elements=st.sampled_from([40, attention_metadata.PREFILL_MASK_ELEMENTS]),
    seed=st.integers(0, 2**16),
)
def test_paged_attention_equals_dense_attention(
    seqs: list[tuple[int, int]],
    num_kv_heads: int,
    group: int,
    block_size: int,
    sliding_window: int | None,
    index_dtype: torch.dtype,
    mask_elements: int,
    seed: int,
) -> None:
    """Mixed batches; prefill queries in one chunk, or in many small masked chunks."""
    batch = make_batch(seqs, num_kv_heads, group, 16, block_size, seed, index_dtype=index_dtype)
    with patch.object(attention_metadata, "PREFILL_MASK_ELEMENTS", mask_elements):
        out = attend(batch, 0.25, sliding_window)
    expected = dense_attention(batch, 0.25, sliding_window)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    num_seqs=st.integers(1, 6),
    context_len=st.integers(1, 200),
    block_size=st.sampled_from([1, 16, 32]),
    sliding_window=st.one_of(st.none(), st.integers(1, 64)),
    # One block per chunk; one sequence per group; groups of a few walked in several chunks.
    chunk_bytes=st.sampled_from([1, 50_000, 100_000, attention_metadata.DECODE_CHUNK_BYTES]),
    seed=st.integers(0, 2**16),
)
def test_decode_batch_equals_dense_attention(
    num_seqs: int,
    context_len: int,
    block_size: int,
    sliding_window: int | None,
    chunk_bytes: int,
    seed: int,
) -> None:
    """All-decode batches (the engine's steady state), walked one or several columns at a time."""
    lens = torch.randint(
        1, context_len + 1, (num_seqs,), generator=torch.Generator().manual_seed(seed)
    )
    seqs = [(int(n), 1) for n in lens]
    batch = make_batch(seqs, num_kv_heads=2, group=4, head_dim=32, block_size=block_size, seed=seed)
    with patch.object(attention_metadata, "DECODE_CHUNK_BYTES", chunk_bytes):
        out = attend(batch, 32**-0.5, sliding_window)
    expected = dense_attention(batch, 32**-0.5, sliding_window)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seqs", [[(40, 40), (70, 1), (33, 12)], [(50, 1), (17, 1), (90, 1)]])
def test_half_precision_matches_float32_reference(
    dtype: torch.dtype, seqs: list[tuple[int, int]]
) -> None:
    batch = make_batch(
        seqs, num_kv_heads=2, group=2, head_dim=16, block_size=16, seed=0, dtype=dtype
    )
    out = attend(batch, 0.25)
    assert out.dtype == dtype
    expected = dense_attention(batch, 0.25, None)
    # The inputs are already half, so what differs is float32 accumulation and the output's
    # rounding to the dtype: two of its epsilons (measured: 3.8e-3 bf16, 8.3e-4 fp16).
    tolerance = 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


@given(
    block_size=st.sampled_from([1, 16, 32]),
    num_tokens=st.integers(1, 64),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=30, deadline=None)
def test_write_kv_round_trip(block_size: int, num_tokens: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 70
    k_cache = torch.zeros(num_blocks, block_size, 2, 8)
    v_cache = torch.zeros(num_blocks, block_size, 2, 8)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    key = torch.randn(num_tokens, 2, 8, generator=gen)
    value = torch.randn(num_tokens, 2, 8, generator=gen)
    write_kv(key, value, k_cache, v_cache, slots.to(torch.int32))
    block, offset = slots // block_size, slots % block_size
    assert torch.equal(k_cache[block, offset], key)
    assert torch.equal(v_cache[block, offset], value)
    untouched = torch.ones(num_blocks, block_size, dtype=torch.bool)
    untouched[block, offset] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


def _valid_args() -> dict[str, object]:
    batch = make_batch(
        [(20, 20), (9, 1)], num_kv_heads=2, group=2, head_dim=8, block_size=16, seed=1
    )
    return {
        "query": batch.query,
        "k_cache": batch.k_cache,
        "v_cache": batch.v_cache,
        "block_tables": batch.block_tables,
        "context_lens": batch.context_lens,
        "query_lens": batch.query_lens,
        "scale": 1.0,
    }


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        ("query", lambda t: t[:, :3], "num_heads"),
        ("query", lambda t: t[:, :, :4], "head_dim"),
        ("query", lambda t: t[:-1], "query_lens"),
        ("v_cache", lambda t: t[:, :8], "v_cache"),
        ("block_tables", lambda t: t[:1], "block_tables"),
        ("block_tables", lambda t: t[:, :1], "blocks"),
        ("context_lens", lambda t: t[:1], "context_lens"),
        ("context_lens", lambda t: t.clamp(max=5), "query_len 20"),
        ("context_lens", lambda t: t + 100, "blocks"),
        ("query", lambda t: t[0], "query"),
    ],
)
def test_bad_shapes_are_clear_errors(name: str, bad, message: str) -> None:
    args = _valid_args()
    args[name] = bad(args[name])
    with pytest.raises(ValueError, match=message):
        metadata = AttentionMetadata.build(
            args.pop("block_tables"),
            args.pop("context_lens").tolist(),
            args.pop("query_lens").tolist(),
            block_size=16,
            sliding_window=None,
            key_bytes_per_block=1 << 10,
        )
        paged_attention(metadata=metadata, **args)


def test_write_kv_bad_shapes_are_clear_errors() -> None:
    k_cache = v_cache = torch.zeros(4, 16, 2, 8)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), k_cache, v_cache, torch.zeros(2))
    with pytest.raises(ValueError, match="key"):
        write_kv(torch.zeros(3, 4, 8), torch.zeros(3, 4, 8), k_cache, v_cache, torch.zeros(3))


@pytest.mark.parametrize("seqs", [[(30, 1), (12, 1)], [(30, 1), (25, 5)]])
def test_query_may_be_a_strided_view(seqs: list[tuple[int, int]]) -> None:
    """The model slices queries out of a fused projection; no contiguous copy is required."""
    batch = make_batch(seqs, num_kv_heads=2, group=2, head_dim=8, block_size=16, seed=3)
    fused = torch.cat([batch.query, torch.randn_like(batch.query)], dim=1)
    strided = fused[:, : batch.query.shape[1]]
    assert not strided.is_contiguous()
    out = attend(batch, 0.5, query=strided)
    torch.testing.assert_close(out, dense_attention(batch, 0.5, None), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sliding_window", [None, 24])
def test_a_query_is_computed_alike_on_every_path(
    dtype: torch.dtype, sliding_window: int | None
) -> None:
    """A whole prompt, its tail after a cached prefix, or its last token decoding among other
    sequences: the same query over the same keys gives the same output, bit for bit in 16-bit
    dtypes (so prefix caching cannot change outputs), to float32 rounding in float32."""
    context, scale = 70, 32**-0.5
    batch = make_batch([(context, context)], 2, 4, 32, block_size=16, seed=7, dtype=dtype)
    table = batch.block_tables[:1]
    whole = attend(batch, scale, sliding_window)

    def same(out: torch.Tensor, expected: torch.Tensor) -> None:
        if dtype == torch.float32:
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(out, expected)

    for tail in (1, 2, 5, 16, 33):
        metadata = AttentionMetadata.build(
            table,
            [context],
            [tail],
            16,
            sliding_window,
            key_bytes_per_block(batch.k_cache, batch.query.dtype),
        )
        out = paged_attention(batch.query[-tail:], batch.k_cache, batch.v_cache, metadata, scale)
        same(out, whole[-tail:])
    # Decoding beside shorter and longer sequences (their blocks: any of the pool's).
    gen = torch.Generator().manual_seed(8)
    tables = torch.randint(0, batch.k_cache.shape[0], (4, 16), generator=gen, dtype=table.dtype)
    tables[1, : table.shape[1]] = table[0]
    queries = torch.randn(4, *whole.shape[1:], generator=gen).to(dtype)
    queries[1] = batch.query[-1]
    metadata = AttentionMetadata.build(
        tables, [150, context, 3, 200], [1, 1, 1, 1], 16, sliding_window, 1 << 16
    )
    out = paged_attention(queries, batch.k_cache, batch.v_cache, metadata, scale)
    same(out[1:2], whole[-1:])
