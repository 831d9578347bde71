"""Attention over fp8 caches equals dense attention over the values those bytes hold.

The caches are random keys and values rounded into fp8 with scales other than 1 (so a path
that forgot a scale, or applied it twice, is off by far more than any tolerance); the oracle
is `dense_attention` in float64 over the dequantised caches (``float(byte) * scale``). What is
left is each path's own rounding: float32 sums for a float32 query (2e-5, as the Triton tests
allow), and the output rounded to bf16 for a bf16 query (2e-2).
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention.backend import CPUAttention, TorchAttention
from pagedkv.attention.batch import ForwardBatch, SequenceInput
from pagedkv.attention.fp8 import KVScales, quantize
from pagedkv.kernels import native
from tests.attention.triton.paged_batch import PagedBatch, dense_attention, make_batch

SCALES = KVScales(k=0.37, v=0.05)
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
# Decodes beside a whole prompt and a chunk after a cached prefix; then decodes only.
MIXED = ([30, 9, 40], [1, 9, 7])
DECODES = ([30, 1, 17, 64], [1, 1, 1, 1])


def fp8_batch(lens: tuple[list[int], list[int]], dtype: torch.dtype, query_dtype) -> PagedBatch:
    """A random batch whose caches hold fp8 bytes (keys x4 so some lie past e4m3's steps)."""
    batch = make_batch(
        *lens, block_size=16, num_kv_heads=2, group=2, head_dim=16, dtype=torch.float32
    )
    return PagedBatch(
        query=batch.query.to(query_dtype),
        k_cache=quantize(batch.k_cache * 4, dtype, SCALES.k),
        v_cache=quantize(batch.v_cache, dtype, SCALES.v),
        block_tables=batch.block_tables,
        context_lens=batch.context_lens,
        query_lens=batch.query_lens,
        query_start_loc=batch.query_start_loc,
    )


def dequantised(batch: PagedBatch) -> PagedBatch:
    """The same batch with the values the fp8 bytes stand for, in float64."""
    return PagedBatch(
        query=batch.query.double(),
        k_cache=batch.k_cache.double() * SCALES.k,
        v_cache=batch.v_cache.double() * SCALES.v,
        block_tables=batch.block_tables,
        context_lens=batch.context_lens,
        query_lens=batch.query_lens,
        query_start_loc=batch.query_start_loc,
    )


def forward_batch(batch: PagedBatch) -> ForwardBatch:
    """The engine's batch over `batch`'s sequences and block tables (token ids unused)."""
    block_size = batch.k_cache.shape[1]
    return ForwardBatch.build(
        [
            SequenceInput([1] * q_len, c_len - q_len, table[: -(-c_len // block_size)])
            for table, c_len, q_len in zip(
                batch.block_tables.tolist(),
                batch.context_lens.tolist(),
                batch.query_lens.tolist(),
                strict=True,
            )
        ],
        block_size,
    )


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("lens", [MIXED, DECODES], ids=["mixed", "decodes"])
def test_pytorch_attention_reads_fp8_blocks(dtype, query_dtype, window, lens):
    batch = fp8_batch(lens, dtype, query_dtype)
    out = TorchAttention().attend(
        batch.query, batch.k_cache, batch.v_cache, forward_batch(batch), 0.5, window, SCALES
    )
    assert out.dtype == query_dtype
    expected = dense_attention(dequantised(batch), 0.5, window)
    tolerance = TOLERANCE[query_dtype]
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.skipif(native.kernels() is None, reason="no C compiler")
@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("window", [None, 8])
def test_the_c_decode_kernel_reads_fp8_blocks(dtype, window, monkeypatch):
    """An all-decode step takes the C kernel (the PyTorch path is made to fail to prove it)."""
    batch = fp8_batch(DECODES, dtype, torch.float32)
    monkeypatch.setattr(TorchAttention, "attend", lambda *args: pytest.fail("took PyTorch"))
    out = CPUAttention().attend(
        batch.query, batch.k_cache, batch.v_cache, forward_batch(batch), 0.5, window, SCALES
    )
    expected = dense_attention(dequantised(batch), 0.5, window)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16])
def test_every_cpu_writer_stores_the_same_bytes(dtype, key_dtype):
    """The C writer (float32 keys) and PyTorch's (any keys) give `quantize`'s bytes."""
    batch = fp8_batch(MIXED, dtype, torch.float32)
    step = forward_batch(batch)
    generator = torch.Generator().manual_seed(5)
    new = (torch.randn(step.slot_mapping.shape[0], 2, 16, generator=generator) * 30).to(key_dtype)
    written = []
    for backend in (TorchAttention(), CPUAttention()):
        k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
        backend.write_kv(new, new / 7, k_cache, v_cache, step, SCALES)
        written.append((k_cache.view(torch.uint8), v_cache.view(torch.uint8)))
    expected_k = batch.k_cache.clone().view(torch.uint8).view(-1, 2, 16)
    expected_v = batch.v_cache.clone().view(torch.uint8).view(-1, 2, 16)
    expected_k[step.slot_mapping] = quantize(new, dtype, SCALES.k).view(torch.uint8)
    expected_v[step.slot_mapping] = quantize(new / 7, dtype, SCALES.v).view(torch.uint8)
    for k_bytes, v_bytes in written:
        assert torch.equal(k_bytes.view(-1, 2, 16), expected_k)
        assert torch.equal(v_bytes.view(-1, 2, 16), expected_v)


def test_scales_are_ignored_by_16_and_32_bit_caches():
    batch = make_batch(
        *MIXED, block_size=16, num_kv_heads=2, group=2, head_dim=16, dtype=torch.float32
    )
    step = forward_batch(batch)
    attention = TorchAttention()
    plain = attention.attend(batch.query, batch.k_cache, batch.v_cache, step, 0.5, None)
    scaled = attention.attend(batch.query, batch.k_cache, batch.v_cache, step, 0.5, None, SCALES)
    assert torch.equal(plain, scaled)
