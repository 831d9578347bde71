"""fp8 KV bytes: every writer rounds to the byte torch's cast gives, and saturates.

The reference is `fp8.quantize` (torch's own float8 cast after a clamp); the C writer
(`rope_kv.c`) must give the very same bytes for any float32 input, including ties, values past
the range, subnormals and zero. The inputs sweep 16 binades above and below 1 and add every
fp8 value and every midpoint between neighbours, where round-to-nearest-even decides.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention.fp8 import (
    FP8_DTYPES,
    FP8_LAYOUTS,
    KVScales,
    byte_values,
    check_cache_dtypes,
    quantize,
)
from pagedkv.kernels import native
from pagedkv.kvmath.spec import KV_CACHE_DTYPES

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


def hard_inputs(dtype: torch.dtype) -> torch.Tensor:
    """Random values over many binades, every finite fp8 value, and every midpoint."""
    generator = torch.Generator().manual_seed(0)
    magnitudes = torch.logspace(-16, 16, 4096, base=2.0)
    spread = torch.randn(4096, generator=generator) * magnitudes
    values = byte_values(dtype)
    finite = values[torch.isfinite(values)].sort().values
    midpoints = (finite[1:].double() + finite[:-1].double()).div(2).float()
    limit = FP8_LAYOUTS[dtype].max
    edges = torch.tensor([0.0, -0.0, limit, -limit, limit * 1.01, 1e30, -1e30, 1e-40])
    return torch.cat([spread, finite, midpoints, edges])


@pytest.mark.parametrize("dtype", FORMATS)
def test_quantize_saturates_instead_of_overflowing(dtype):
    limit = FP8_LAYOUTS[dtype].max
    out = quantize(torch.tensor([1e9, -1e9, limit * 1.2]), dtype, 1.0).float()
    assert out.tolist() == [limit, -limit, limit]


@pytest.mark.parametrize("dtype", FORMATS)
def test_the_byte_table_is_what_torch_decodes(dtype):
    table = byte_values(dtype)
    assert table.shape == (256,) and table.dtype == torch.float32
    decoded = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    assert torch.equal(table.nan_to_num(7.0), decoded.nan_to_num(7.0))
    assert FP8_LAYOUTS[dtype].max == torch.finfo(dtype).max


@pytest.mark.skipif(native.kernels() is None, reason="no C compiler")
@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("scale", [1.0, 0.5, 0.37, 3.0])
def test_the_c_writer_gives_torchs_bytes(dtype, scale):
    """Keys and values into scattered slots: bytes equal `quantize`'s, others untouched."""
    inputs = hard_inputs(dtype)
    width = 32
    rows = inputs[: inputs.numel() // width * width].view(-1, width)
    values = -rows
    num_tokens = rows.shape[0]
    slots = torch.randperm(num_tokens + 5, generator=torch.Generator().manual_seed(1))
    slots = slots[:num_tokens]
    k_cache = torch.full((num_tokens + 5, width), 0xAA, dtype=torch.uint8)
    v_cache = k_cache.clone()
    layout = FP8_LAYOUTS[dtype]
    native.kernels().write_kv_fp8(
        rows.data_ptr(),
        width,
        values.data_ptr(),
        width,
        num_tokens,
        width,
        slots.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        layout.mantissa_bits,
        layout.exponent_bias,
        layout.max,
        1.0 / scale,
        1.0 / (2 * scale),
    )
    expected_k = torch.full_like(k_cache, 0xAA)
    expected_k[slots] = quantize(rows, dtype, scale).view(torch.uint8)
    expected_v = torch.full_like(v_cache, 0xAA)
    expected_v[slots] = quantize(values, dtype, 2 * scale).view(torch.uint8)
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


def test_vllm_names_map_to_formats():
    assert ("auto", *FP8_DTYPES) == KV_CACHE_DTYPES
    assert FP8_DTYPES["fp8"] == FP8_DTYPES["fp8_e4m3"] == torch.float8_e4m3fn
    assert FP8_DTYPES["fp8_e5m2"] == torch.float8_e5m2


def test_a_cache_holds_the_model_dtype_or_fp8():
    check_cache_dtypes(torch.bfloat16, torch.bfloat16, torch.bfloat16)
    check_cache_dtypes(torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fn)
    check_cache_dtypes(torch.float32, torch.float8_e5m2, torch.float8_e5m2)
    with pytest.raises(ValueError, match="differ in dtype"):
        check_cache_dtypes(torch.float32, torch.float16, torch.float16)
    with pytest.raises(ValueError, match="differ in dtype"):
        check_cache_dtypes(torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_scales_are_positive_and_finite(bad):
    with pytest.raises(ValueError, match="k_scale must be a positive finite number"):
        KVScales(k=bad)
