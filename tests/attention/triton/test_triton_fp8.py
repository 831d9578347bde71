"""The Triton kernels over fp8 caches: the store kernel's bytes, and both attention kernels
against the PyTorch path and a dense oracle.

On a CPU these run under ``TRITON_INTERPRET=1`` (slow: the batches are small). The store
kernel must give `fp8.quantize`'s bytes exactly, ties and saturation included. The attention
kernels read the same bytes as the PyTorch path (`paged_attention`, which converts in its
block gather) and must agree with it and with float64 attention over the dequantised caches,
to the tolerances of the float kernels (tests/attention/triton/test_triton_attention.py).
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention.fp8 import KVScales, quantize
from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.attention.torch_backend import key_bytes_per_block, paged_attention
from tests.attention.test_fp8 import hard_inputs
from tests.attention.triton.paged_batch import PagedBatch, dense_attention, make_batch

pytest.importorskip("triton")

from pagedkv.attention.triton.attention import DecodeConfig, triton_paged_attention  # noqa: E402
from pagedkv.attention.triton.kv import triton_write_kv  # noqa: E402

pytestmark = pytest.mark.slow

SCALES = KVScales(k=0.37, v=0.05)
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
SMALL_PARTITIONS = DecodeConfig(partition_size=64, block_n=32, programs_per_sm=6)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16])
def test_the_store_kernel_gives_torchs_bytes(device, dtype, key_dtype):
    # A program stores one token: wide tokens keep the interpreter's program count small.
    num_kv_heads, head_dim, block_size = 4, 64, 16
    values = hard_inputs(dtype)
    padding = -values.numel() % (num_kv_heads * head_dim)  # every hard value is stored
    rows = torch.cat([values, values[:padding]]).view(-1, num_kv_heads, head_dim).to(key_dtype)
    num_tokens = rows.shape[0]
    num_blocks = -(-num_tokens // block_size) + 1
    generator = torch.Generator().manual_seed(2)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, 0xAA, dtype=torch.uint8).view(dtype).to(device)
    v_cache = k_cache.clone()

    triton_write_kv(
        rows.to(device), (rows / 3).to(device), k_cache, v_cache, slots.to(device), SCALES
    )

    expected_k = torch.full(shape, 0xAA, dtype=torch.uint8).view(-1, num_kv_heads, head_dim)
    expected_v = expected_k.clone()
    expected_k[slots] = quantize(rows, dtype, SCALES.k).view(torch.uint8)
    expected_v[slots] = quantize(rows / 3, dtype, SCALES.v).view(torch.uint8)
    assert torch.equal(k_cache.cpu().view(torch.uint8).view_as(expected_k), expected_k)
    assert torch.equal(v_cache.cpu().view(torch.uint8).view_as(expected_v), expected_v)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("context_lens", "query_lens"),
    [([1, 17, 150, 64], [1, 1, 1, 1]), ([23, 49, 6, 90], [23, 9, 1, 30])],
    ids=["decode", "prefill"],
)
def test_attention_over_fp8_matches_pytorch_and_the_oracle(
    device, dtype, query_dtype, context_lens, query_lens
):
    """Decodes over several partitions (merged), and prompts, chunks and a decode at once."""
    batch = make_batch(
        context_lens,
        query_lens,
        block_size=16,
        num_kv_heads=2,
        group=2,
        head_dim=32,
        dtype=torch.float32,
    )
    fp8 = _with_caches(
        batch,
        query=batch.query.to(query_dtype),
        k_cache=quantize(batch.k_cache * 4, dtype, SCALES.k),
        v_cache=quantize(batch.v_cache, dtype, SCALES.v),
    )
    ours = fp8.to(device)
    out = triton_paged_attention(
        ours.query,
        ours.k_cache,
        ours.v_cache,
        ours.block_tables,
        ours.context_lens,
        ours.query_start_loc,
        fp8.max_query_len,
        fp8.max_context_len,
        0.25,
        None,
        scales=SCALES,
        decode_config=SMALL_PARTITIONS,
    ).cpu()
    assert out.dtype == query_dtype
    tolerance = TOLERANCE[query_dtype]
    expected = dense_attention(
        _with_caches(
            fp8,
            query=fp8.query.double(),
            k_cache=fp8.k_cache.double() * SCALES.k,
            v_cache=fp8.v_cache.double() * SCALES.v,
        ),
        0.25,
        None,
    )
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(
        out.double(), _pytorch(fp8).double(), atol=2 * tolerance, rtol=2 * tolerance
    )


def _with_caches(batch: PagedBatch, **tensors: torch.Tensor) -> PagedBatch:
    """`batch` with some of its tensors replaced."""
    fields = {name: getattr(batch, name) for name in batch.__dataclass_fields__}
    return PagedBatch(**{**fields, **tensors})


def _pytorch(batch: PagedBatch) -> torch.Tensor:
    """The PyTorch path over the same fp8 batch and scales."""
    metadata = AttentionMetadata.build(
        batch.block_tables,
        batch.context_lens.tolist(),
        batch.query_lens.tolist(),
        batch.k_cache.shape[1],
        None,
        key_bytes_per_block(batch.k_cache, batch.query.dtype),
    )
    return paged_attention(batch.query, batch.k_cache, batch.v_cache, metadata, 0.25, SCALES)
