"""`from_gguf_blocks` against gguf's own dequantiser, bit for bit.

The re-packed tensor must dequantise to exactly what `gguf.quants.dequantize` gives for the same
bytes: anything looser would let a wrong nibble order or scale unpacking hide behind a tolerance.
Block bytes come two ways: gguf's quantiser on random floats (realistic blocks, for the types it
can quantise) and random bytes with every float16 field any finite value (every bit pattern of
the integer fields, and scales from subnormal to 65504).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.quant import gguf_blocks
from pagedkv.quant.formats import QuantizedTensor
from pagedkv.quant.gguf_blocks import BLOCK_TYPES, from_gguf_blocks

# Byte offsets of each block's float16 fields (d, and m or dmin where the type has one).
F16_FIELDS = {
    QType.Q4_0: (0,),
    QType.Q4_1: (0, 2),
    QType.Q8_0: (0,),
    QType.Q5_0: (0,),
    QType.Q5_1: (0, 2),
    QType.Q4_K: (0, 2),
    QType.Q5_K: (0, 2),
    QType.Q6_K: (208,),
}
LAYOUTS = {  # bits, group size
    QType.Q4_0: (4, 32),
    QType.Q4_1: (4, 32),
    QType.Q8_0: (8, 32),
    QType.Q5_0: (8, 32),
    QType.Q5_1: (8, 32),
    QType.Q4_K: (4, 32),
    QType.Q5_K: (8, 32),
    QType.Q6_K: (8, 16),
}
QUANTISABLE = (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0)  # by gguf itself
SHAPES = ((1, 1), (2, 2), (3, 1), (5, 3), (4, 7))  # (rows, blocks per row)


def random_blocks(qtype: QType, rows: int, blocks: int, seed: int) -> np.ndarray:
    """Random `[rows, bytes]` block data whose float16 fields are finite (any finite value)."""
    rng = np.random.default_rng(seed)
    type_size = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (rows * blocks, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        bits = rng.integers(0, 1 << 16, rows * blocks, dtype=np.uint16)
        infinite = (bits & 0x7C00) == 0x7C00  # exponent 31: inf or NaN
        bits[infinite] ^= np.uint16(0x4000)  # exponent 15 instead, keeping sign and mantissa
        raw[:, offset : offset + 2] = bits.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, blocks * type_size)


def cols_of(qtype: QType, blocks: int) -> int:
    return GGML_QUANT_SIZES[qtype][0] * blocks


def assert_exact(raw: np.ndarray, qtype: QType, cols: int) -> QuantizedTensor:
    """Convert `raw` and check it dequantises to gguf's floats exactly (zero's sign aside)."""
    quantized = from_gguf_blocks(raw, qtype, cols)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(raw.shape[0], cols))
    got = quantized.dequantize()
    assert torch.isfinite(expected).all()
    assert torch.equal(got, expected), (
        f"{qtype.name}: max |diff| {(got - expected).abs().max().item()}"
    )
    return quantized


def test_block_types_are_the_supported_ones() -> None:
    assert set(BLOCK_TYPES) == set(LAYOUTS)


@pytest.mark.parametrize("qtype", QUANTISABLE, ids=lambda t: t.name)
@pytest.mark.parametrize("rows, blocks", SHAPES)
def test_gguf_quantised_blocks_match_exactly(qtype: QType, rows: int, blocks: int) -> None:
    """Blocks as llama.cpp writes them, from gguf's own quantiser."""
    weights = np.random.default_rng(rows * 10 + blocks).standard_normal(
        (rows, cols_of(qtype, blocks)), dtype=np.float32
    )
    raw = gguf.quants.quantize(weights, qtype)
    assert_exact(raw, qtype, weights.shape[1])


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows, blocks", SHAPES)
def test_random_blocks_match_exactly(qtype: QType, rows: int, blocks: int) -> None:
    """Every bit of the integer fields exercised, for every type (gguf cannot make K blocks)."""
    raw = random_blocks(qtype, rows, blocks, seed=rows * 10 + blocks)
    assert_exact(raw, qtype, cols_of(qtype, blocks))


@settings(deadline=None)  # a loaded CI machine must not turn slowness into a failure
@given(
    st.sampled_from(BLOCK_TYPES),
    st.integers(1, 5),
    st.integers(1, 4),
    st.integers(0, 2**32 - 1),
)
def test_any_blocks_match_exactly(qtype: QType, rows: int, blocks: int, seed: int) -> None:
    assert_exact(random_blocks(qtype, rows, blocks, seed), qtype, cols_of(qtype, blocks))


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_layout(qtype: QType) -> None:
    """Width, group size, dtypes and shapes as `formats.py` documents them, C-contiguous."""
    rows, blocks = 3, 2
    cols = cols_of(qtype, blocks)
    quantized = from_gguf_blocks(random_blocks(qtype, rows, blocks, seed=1), qtype, cols)
    bits, group_size = LAYOUTS[qtype]
    assert (quantized.bits, quantized.group_size) == (bits, group_size)
    assert quantized.shape == (rows, cols)
    assert quantized.values.dtype == (torch.uint8 if bits == 4 else torch.int8)
    assert tuple(quantized.values.shape) == (rows, cols * bits // 8)
    assert tuple(quantized.scales.shape) == (rows, cols // group_size)
    for tensor in (quantized.values, quantized.scales, quantized.mins):
        assert tensor.is_contiguous()


@pytest.mark.parametrize("qtype", (QType.Q4_0, QType.Q4_1), ids=lambda t: t.name)
def test_q4_nibbles_are_kept_as_stored(qtype: QType) -> None:
    """Q4_0 and Q4_1 already use our nibble order, so their bytes pass through untouched."""
    raw = random_blocks(qtype, 2, 3, seed=2)
    quantized = from_gguf_blocks(raw, qtype, cols_of(qtype, 3))
    start = 2 * len(F16_FIELDS[qtype])
    stored = raw.reshape(2, 3, -1)[:, :, start:].reshape(2, -1)
    assert np.array_equal(quantized.values.numpy(), stored)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_non_contiguous_input_converts_like_its_copy(qtype: QType) -> None:
    """Row gathers (`row_order`), strided and reversed rows, unaligned column windows."""
    rows, blocks = 6, 2
    cols = cols_of(qtype, blocks)
    raw = random_blocks(qtype, rows, blocks, seed=3)
    whole = from_gguf_blocks(raw, qtype, cols)
    permutation = np.array([4, 1, 5, 0, 3, 2])
    gathered = from_gguf_blocks(raw[permutation], qtype, cols)
    expected = whole.rows(torch.from_numpy(permutation))
    for name in ("values", "scales", "mins"):
        assert torch.equal(getattr(gathered, name), getattr(expected, name))
    padded = np.zeros((rows, raw.shape[1] + 3), dtype=np.uint8)
    padded[:, 1:-2] = raw
    views = (raw[::-1], raw[::2], padded[:, 1:-2], np.asfortranarray(raw))
    for view in views:
        assert_exact(view, qtype, cols)
        copy = from_gguf_blocks(np.ascontiguousarray(view), qtype, cols)
        converted = from_gguf_blocks(view, qtype, cols)
        for name in ("values", "scales", "mins"):
            assert torch.equal(getattr(converted, name), getattr(copy, name))


@pytest.mark.parametrize("qtype", (QType.Q8_0, QType.Q4_K, QType.Q6_K), ids=lambda t: t.name)
def test_rows_split_across_chunks(qtype: QType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Large tensors are converted a few rows at a time, last chunk partial; nothing changes."""
    rows, blocks = 7, 2
    cols = cols_of(qtype, blocks)
    raw = random_blocks(qtype, rows, blocks, seed=4)
    whole = from_gguf_blocks(raw, qtype, cols)
    monkeypatch.setattr(gguf_blocks, "_CHUNK_VALUES", 3 * cols)
    chunked = assert_exact(raw, qtype, cols)
    for name in ("values", "scales", "mins"):
        assert torch.equal(getattr(chunked, name), getattr(whole, name))


def test_no_rows() -> None:
    quantized = from_gguf_blocks(np.zeros((0, 34), dtype=np.uint8), QType.Q8_0, 32)
    assert quantized.shape == (0, 32)


@pytest.mark.parametrize(
    "qtype", (QType.IQ2_XXS, QType.F16, QType.F32, QType.BF16, QType.Q2_K), ids=lambda t: t.name
)
def test_unsupported_type_is_named(qtype: QType) -> None:
    with pytest.raises(ValueError, match=qtype.name):
        from_gguf_blocks(np.zeros((1, 64), dtype=np.uint8), qtype, 32)


def test_plain_int_type_is_accepted() -> None:
    raw = random_blocks(QType.Q8_0, 2, 1, seed=5)
    assert_exact(raw, int(QType.Q8_0), 32)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "raw, cols, message",
    [
        (np.zeros((2, 34), dtype=np.uint8), 48, "whole blocks of 32"),
        (np.zeros((2, 34), dtype=np.uint8), 64, "take 68 bytes, got 34"),
        (np.zeros((2, 34), dtype=np.int8), 32, "uint8"),
        (np.zeros(34, dtype=np.uint8), 32, "uint8"),
    ],
    ids=("partial block", "byte count", "dtype", "one-dimensional"),
)
def test_malformed_blocks_are_refused(raw: np.ndarray, cols: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        from_gguf_blocks(raw, QType.Q8_0, cols)
