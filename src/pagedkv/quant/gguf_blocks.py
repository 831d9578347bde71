"""GGUF block bytes -> `QuantizedTensor`, re-packed without losing a bit.

A GGUF file stores a quantised weight as rows of fixed-size blocks, each holding small
integers and one or two float16 numbers; every format we read dequantises as
`w = scale * q + min` per group of 16 or 32 values, which is exactly `QuantizedTensor`'s layout
(see `formats.py`). Converting at load time keeps the weight quantised in memory and lets one
matmul kernel serve every source format.

Exactness: `QuantizedTensor.dequantize()` computes `q * scale + min` in float32, one rounding
per operation. For each type the scale and min stored here are the very float32 numbers gguf's
own dequantiser (`gguf/quants.py`) multiplies and adds with, computed in the same order
(`float32(d) * float32(sc)` first), and its integers are the same, so both sides perform the same
roundings and agree bit for bit (up to the sign of zero) whenever the float16 fields are finite:
- Q4_0 `d * (q - 8)`: scale `d`, min `-8 d` (exact); `d * q` and the sum are exact in float32.
- Q4_1 `d * q + m`, Q5_1 `d * q + m`: the same two operations.
- Q8_0 `d * q`, Q5_0 `d * (q - 16)`: values kept signed, min 0 (`x + 0` returns `x`).
- Q4_K / Q5_K `(d * sc) * q - dmin * m`: `d * sc` and `dmin * m` are exact (11 + 6 bits) and
  `a - b` is `a + (-b)`, so the min is `-(dmin * m)`.
- Q6_K `(d * sc) * (q - 32)`: scale `d * sc` (exact), values `q - 32`, min 0.

Four-bit types keep their nibbles (Q4_K's are re-ordered into ggml's Q4_0 order); five- and
six-bit ones are widened to signed bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from pagedkv.quant.formats import QuantizedTensor, narrowed

_CHUNK_VALUES = 1 << 20  # weight values converted per step, bounding the temporaries

# A converter takes `[n, type_size]` C-contiguous blocks and returns, per block, the values
# (`[n, bytes]` of the target width), the scales and the mins (both float32 `[n, groups]`).
_Converted = tuple[np.ndarray, np.ndarray, np.ndarray]


class _Format(NamedTuple):
    """How one GGUF type maps onto `QuantizedTensor`: target width, group size, converter."""

    bits: int
    group_size: int
    convert: Callable[[np.ndarray], _Converted]


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The little-endian float16 at byte `offset` of every block, as float32 `[n, 1]`."""
    return np.ascontiguousarray(blocks[:, offset : offset + 2]).view("<f2").astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """ggml-order nibble bytes `[n, 16]` -> the 32 values `[n, 32]` (uint8, 0..15)."""
    return np.concatenate((packed & 0x0F, packed >> 4), axis=1)


def _high_bits(packed: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's little-endian 32-bit mask `[n, 4]` -> bit `i` of each block `[n, 32]`."""
    return np.unpackbits(packed, axis=1, bitorder="little")


def _zeros(scales: np.ndarray) -> np.ndarray:
    return np.zeros_like(scales)


def _q4_0(blocks: np.ndarray) -> _Converted:
    d = _f16(blocks, 0)
    return blocks[:, 2:18], d, d * np.float32(-8)


def _q4_1(blocks: np.ndarray) -> _Converted:
    return blocks[:, 4:20], _f16(blocks, 0), _f16(blocks, 2)


def _q8_0(blocks: np.ndarray) -> _Converted:
    d = _f16(blocks, 0)
    return blocks[:, 2:34].view(np.int8), d, _zeros(d)


def _q5_0(blocks: np.ndarray) -> _Converted:
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 6:22]) | (_high_bits(blocks[:, 2:6]) << 4)
    return q.astype(np.int8) - np.int8(16), d, _zeros(d)


def _q5_1(blocks: np.ndarray) -> _Converted:
    q = _nibbles(blocks[:, 8:24]) | (_high_bits(blocks[:, 4:8]) << 4)
    return q.view(np.int8), _f16(blocks, 0), _f16(blocks, 2)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's super-block header -> float32 `(d * sc, -(dmin * m))`, each `[n, 8]`.

    Bytes 4..15 pack eight 6-bit scales and eight 6-bit mins: sub-blocks 0..3 take the low six
    bits of bytes 0..3 (scales) and 4..7 (mins); sub-blocks 4..7 take a nibble of bytes 8..11
    (low for scales, high for mins) plus the top two bits of bytes 0..3 or 4..7.
    """
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    packed = blocks[:, 4:16]
    low_sc, low_m, mixed = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate((low_sc & 0x3F, (mixed & 0x0F) | ((low_sc >> 2) & 0x30)), axis=1)
    m = np.concatenate((low_m & 0x3F, (mixed >> 4) | ((low_m >> 2) & 0x30)), axis=1)
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _q4_k(blocks: np.ndarray) -> _Converted:
    # Each 64-value chunk is 32 bytes: values 0..31 in the low nibbles, 32..63 in the high ones.
    # Ours wants per 32-value group byte j = value j | value j + 16 << 4, so pair the chunk's
    # first 16 bytes with its last 16, once for the low nibbles and once for the high ones.
    chunks = blocks[:, 16:144].reshape(-1, 4, 2, 16)
    first, second = chunks[:, :, 0], chunks[:, :, 1]
    low_group = (first & 0x0F) | (second << 4)
    high_group = (first >> 4) | (second & 0xF0)
    values = np.stack((low_group, high_group), axis=2).reshape(-1, 128)
    return (values, *_k_scales(blocks))


def _q5_k(blocks: np.ndarray) -> _Converted:
    # Low nibbles as Q4_K (chunk c: sub-block 2c low, 2c+1 high); bit i of byte j of the 32
    # high-bit bytes is the fifth bit of value j of sub-block i.
    low = blocks[:, 48:176].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    high = blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
    q = (low & 0x0F).reshape(-1, 8, 32) | ((high & 0x01) << 4)
    return (q.reshape(-1, 256).view(np.int8), *_k_scales(blocks))


def _q6_k(blocks: np.ndarray) -> _Converted:
    # Each 128-value half: 64 bytes of low nibbles (values 0..63 low, 64..127 high) and 32 bytes
    # of two-bit pairs (bits 2t..2t+1 of byte j belong to value 32 t + j).
    low = blocks[:, 0:128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
    pair_shifts = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    high = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> pair_shifts
    q = (low & 0x0F).reshape(-1, 256) | ((high & 0x03).reshape(-1, 256) << 4)
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks, 208)
    scales = d * sc
    return q.astype(np.int8) - np.int8(32), scales, _zeros(scales)


_FORMATS: dict[QType, _Format] = {
    QType.Q4_0: _Format(4, 32, _q4_0),
    QType.Q4_1: _Format(4, 32, _q4_1),
    QType.Q8_0: _Format(8, 32, _q8_0),
    QType.Q5_0: _Format(8, 32, _q5_0),
    QType.Q5_1: _Format(8, 32, _q5_1),
    QType.Q4_K: _Format(4, 32, _q4_k),
    QType.Q5_K: _Format(8, 32, _q5_k),
    QType.Q6_K: _Format(8, 16, _q6_k),
}
BLOCK_TYPES: tuple[QType, ...] = tuple(_FORMATS)


def from_gguf_blocks(raw: np.ndarray, qtype: QType, cols: int) -> QuantizedTensor:
    """Re-pack GGUF blocks `raw` (uint8 `[rows, bytes_per_row]`) of a `cols`-wide weight.

    `raw` may be any view (a `row_order` gather, a slice of a memory-mapped file): rows are
    copied a chunk at a time, so temporaries stay near `_CHUNK_VALUES` values whatever the
    tensor's size. The result dequantises to exactly what `gguf.quants.dequantize` gives.
    """
    qtype = QType(qtype)  # a plain int names its type too (or raises ValueError)
    fmt = _FORMATS.get(qtype)
    if fmt is None:
        supported = ", ".join(t.name for t in BLOCK_TYPES)
        raise ValueError(f"cannot re-pack GGUF type {qtype.name}; supported: {supported}")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if raw.ndim != 2 or raw.dtype != np.uint8:
        raise ValueError(
            f"{qtype.name} blocks must be uint8 [rows, bytes], got {raw.dtype} {raw.shape}"
        )
    if cols <= 0 or cols % block_size:
        raise ValueError(f"{qtype.name} rows must hold whole blocks of {block_size}, got {cols}")
    blocks_per_row = cols // block_size
    if raw.shape[1] != blocks_per_row * type_size:
        raise ValueError(
            f"{qtype.name} rows of {cols} values take {blocks_per_row * type_size} bytes, "
            f"got {raw.shape[1]}"
        )
    rows = raw.shape[0]
    value_dtype = np.uint8 if fmt.bits == 4 else np.int8
    values = np.empty((rows, cols * fmt.bits // 8), dtype=value_dtype)
    scales = np.empty((rows, cols // fmt.group_size), dtype=np.float32)
    mins = np.empty_like(scales)
    step = max(1, _CHUNK_VALUES // cols)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        blocks = np.ascontiguousarray(raw[start:stop]).reshape(-1, type_size)
        chunk_values, chunk_scales, chunk_mins = fmt.convert(blocks)
        values[start:stop] = chunk_values.reshape(stop - start, -1)
        scales[start:stop] = chunk_scales.reshape(stop - start, -1)
        mins[start:stop] = chunk_mins.reshape(stop - start, -1)
    # Kept as float16 where the file's are (and every product, like Q4_0's -8 d, still is).
    kept_scales, kept_mins = narrowed(torch.from_numpy(scales), torch.from_numpy(mins))
    return QuantizedTensor.from_ggml(
        torch.from_numpy(values), kept_scales, kept_mins, fmt.bits, fmt.group_size
    )
