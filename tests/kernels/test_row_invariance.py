"""Every per-row computation of a forward pass gives row r the same bits whatever surrounds it.

The oracle is the row computed alone: each kernel (and each torch op the sampler runs per row)
is called with row r among 1, 7, 33 and 200 rows (vocabulary-wide rows: 1, 7, 33 and 64), at
several positions, with 1 and 2 threads, and must give exactly the bits of row r alone.
Correctness against float64 is each kernel's own test; this is the batch-invariance rule the
engine's guarantee stands on.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.kernels import native
from pagedkv.model.decoder import silu_mul
from pagedkv.model.layers.norm import RMSNorm
from pagedkv.model.rope import rope_cos_sin
from pagedkv.quant.matmul import float_linear, quantized_linear
from pagedkv.quant.quantize import quantize_int4, quantize_int8

ROW_COUNTS = (1, 7, 33, 200)


@pytest.fixture(scope="module", autouse=True)
def kernels() -> native.Kernels:
    built = native.kernels()
    if built is None:
        pytest.skip(f"C kernels unavailable: {native.unavailable_reason()}")
    return built


def surroundings(rows: torch.Tensor, row: int, seed: int, counts: tuple[int, ...]):
    """`(batch, index)` pairs: row `row` of `rows` among `counts` rows of random others (drawn
    from `rows` too), at the first, a middle and the last position."""
    gen = torch.Generator().manual_seed(seed)
    for count in counts:
        for index in sorted({0, count // 2, count - 1}):
            others = torch.randint(0, rows.shape[0], (count,), generator=gen)
            others[index] = row
            yield rows[others], index


def assert_row_invariant(
    function, rows: torch.Tensor, what: str, seed: int = 0, counts: tuple[int, ...] = ROW_COUNTS
) -> None:
    """`function(batch)[index]` has the bits of `function(rows[row:row+1])[0]`, for a few rows,
    every surrounding, 1 and 2 threads."""
    threads = torch.get_num_threads()
    try:
        for row in (0, rows.shape[0] // 3, rows.shape[0] - 1):
            torch.set_num_threads(1)
            alone = function(rows[row : row + 1])[0]
            for num_threads in (1, 2):
                torch.set_num_threads(num_threads)
                for batch, index in surroundings(rows, row, seed + row, counts):
                    got = function(batch)[index]
                    assert torch.equal(got, alone), (
                        f"{what}: row {row} among {batch.shape[0]} rows at {index}, "
                        f"{num_threads} threads: max difference {(got - alone).abs().max():.3g}"
                    )
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_int4], ids=["int8", "int4"])
@pytest.mark.parametrize("cols", [64, 576])  # 576: whole blocks of 8 groups plus 2 tail groups
def test_quantized_matmul(quantize, cols):
    weight = quantize(torch.randn(37, cols, generator=torch.Generator().manual_seed(cols)))
    bias = torch.randn(37)
    x = torch.randn(200, cols, generator=torch.Generator().manual_seed(1))
    assert_row_invariant(lambda b: quantized_linear(b, weight, bias), x, f"q{cols}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cols", [8, 77, 576])
def test_float_matmul(dtype, cols):
    gen = torch.Generator().manual_seed(cols)
    weight = torch.randn(45, cols, generator=gen).to(dtype)
    bias = torch.randn(45, generator=gen).to(dtype)
    x = torch.randn(200, cols, generator=gen).to(dtype)
    assert_row_invariant(lambda b: float_linear(b, weight, bias), x, f"f{cols} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(dtype):
    norm = RMSNorm(83, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(83) + 0.5)
    norm = norm.to(dtype)
    x = (torch.randn(200, 83) * 3).to(dtype)
    with torch.no_grad():
        assert_row_invariant(norm, x, f"rms_norm {dtype}")


def test_silu_mul():
    x = torch.randn(200, 2 * 75) * 4
    assert_row_invariant(silu_mul, x, "silu_mul")


def test_rope_tables():
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    positions = torch.randint(0, 100_000, (200,))
    assert_row_invariant(
        lambda p: torch.cat(rope_cos_sin(inv_freq, p, torch.float32), dim=-1),
        positions,
        "rope tables",
    )


@pytest.mark.parametrize(
    "op",
    [
        lambda logits: logits.log_softmax(dim=-1),
        lambda logits: logits.softmax(dim=-1),
        lambda logits: logits.topk(20, dim=-1).values,
        lambda logits: logits.sort(dim=-1, descending=True).values.softmax(-1).cumsum(-1),
    ],
    ids=["log_softmax", "softmax", "topk", "sorted-cumsum"],
)
def test_sampler_row_ops(op):
    """The torch ops the sampler applies per row, over a vocabulary-sized row (among at most 64:
    torch splits these ops by rows, and 64 rows of 49,152 already give each thread several)."""
    logits = torch.randn(64, 49152, generator=torch.Generator().manual_seed(3)) * 5
    assert_row_invariant(op, logits, "sampler op", counts=(1, 7, 33, 64))


def attention_call(kernels, q, k_cache, v_cache, tables, query_starts, context_lens, window):
    """One pagedkv_attention call over float32 caches; out `[rows, heads, head_dim]`."""
    rows, heads, head_dim = q.shape
    out = torch.empty_like(q)
    status = kernels.attention(
        q.data_ptr(),
        heads * head_dim,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        0,
        None,
        1.0,
        1.0,
        tables.data_ptr(),
        tables.shape[1],
        query_starts.data_ptr(),
        context_lens.data_ptr(),
        len(context_lens),
        heads,
        k_cache.shape[2],
        head_dim,
        k_cache.shape[1],
        0.125,
        window,
        out.data_ptr(),
    )
    assert status == 0
    return out


@pytest.mark.parametrize("window", [0, 19])
def test_attention_rows_of_one_sequence(kernels, window):
    """The query rows of one 200-token sequence: as one prefill, in chunks of 1, 7 and 33
    rows (each chunk seeing the earlier tokens from the cache) and beside other sequences,
    every row has the bits it has computed alone as a decode step."""
    gen = torch.Generator().manual_seed(window)
    block_size, heads, kv_heads, head_dim, length = 16, 6, 2, 64, 200
    num_blocks = 40
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    table = torch.randperm(num_blocks, generator=gen)[:13].to(torch.int32)
    q = torch.randn(length, heads, head_dim, generator=gen)

    def rows(start: int, stop: int, extra: int = 0) -> torch.Tensor:
        """Rows start..stop of the sequence, after `extra` one-row decodes of other sequences
        over the same blocks at other lengths."""
        lens = [start + 1 + (i * 37) % (length - start) for i in range(extra)] + [stop]
        tables = table.repeat(len(lens), 1).contiguous()
        starts = torch.tensor([*range(extra + 1), extra + stop - start], dtype=torch.int64)
        others = torch.randn(extra, heads, head_dim, generator=gen)
        queries = torch.cat((others, q[start:stop])).contiguous()
        out = attention_call(
            kernels,
            queries,
            k_cache,
            v_cache,
            tables,
            starts,
            torch.tensor(lens, dtype=torch.int32),
            window,
        )
        return out[extra:]

    alone = torch.cat([rows(p, p + 1) for p in range(length)])
    for chunk in (7, 33, 200):
        for extra in (0, 3):
            chunked = torch.cat(
                [rows(p, min(p + chunk, length), extra) for p in range(0, length, chunk)]
            )
            assert torch.equal(chunked, alone), f"chunks of {chunk} beside {extra} sequences"
