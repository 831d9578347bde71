"""Reference dequantisers written from ggml's block layouts, independent of `gguf.quants`.

Each function takes raw blocks `[num_blocks, block_bytes]` (uint8) and returns float32 values
`[num_blocks, block_values]`, following the C loops of ggml's `dequantize_row_*` one block
at a time, so the loader's output can be checked against a second, plain reading of the spec.
`random_blocks` makes blocks of random bits with sane half-precision scales.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QType

# type -> (values per block, bytes per block, byte offsets of its float16 scale fields)
LAYOUTS = {
    QType.Q4_0: (32, 18, (0,)),
    QType.Q4_1: (32, 20, (0, 2)),
    QType.Q5_0: (32, 22, (0,)),
    QType.Q5_1: (32, 24, (0, 2)),
    QType.Q8_0: (32, 34, (0,)),
    QType.Q4_K: (256, 144, (0, 2)),
    QType.Q5_K: (256, 176, (0, 2)),
    QType.Q6_K: (256, 210, (208,)),
}


def random_blocks(qtype: QType, num_blocks: int, seed: int) -> np.ndarray:
    """Random quantised blocks whose float16 scales are small, finite numbers."""
    _, block_bytes, scale_offsets = LAYOUTS[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)
    for offset in scale_offsets:
        scales = rng.uniform(-0.05, 0.05, size=num_blocks).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(num_blocks, 2)
    return blocks


def dequantize_reference(qtype: QType, blocks: np.ndarray) -> np.ndarray:
    """Dequantise `blocks` of `qtype` with the per-block loops below."""
    return np.stack([_BLOCK_READERS[qtype](block) for block in blocks]).astype(np.float32)


def _f16(block: np.ndarray, offset: int) -> np.float32:
    return np.float32(block[offset : offset + 2].view(np.float16)[0])


def _q4_0(b: np.ndarray) -> np.ndarray:
    d, qs = _f16(b, 0), b[2:18]
    low = (qs & 0x0F).astype(np.int32) - 8
    high = (qs >> 4).astype(np.int32) - 8
    return np.concatenate([low, high]).astype(np.float32) * d


def _q4_1(b: np.ndarray) -> np.ndarray:
    d, m, qs = _f16(b, 0), _f16(b, 2), b[4:20]
    q = np.concatenate([qs & 0x0F, qs >> 4]).astype(np.float32)
    return q * d + m


def _q5_bits(qh_bytes: np.ndarray, qs: np.ndarray) -> np.ndarray:
    qh = int.from_bytes(qh_bytes.tobytes(), "little")
    out = np.empty(32, dtype=np.int32)
    for j in range(16):
        high0 = ((qh >> j) << 4) & 0x10
        high1 = (qh >> (j + 12)) & 0x10
        out[j] = (int(qs[j]) & 0x0F) | high0
        out[j + 16] = (int(qs[j]) >> 4) | high1
    return out


def _q5_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b, 0)
    return (_q5_bits(b[2:6], b[6:22]) - 16).astype(np.float32) * d


def _q5_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b, 0), _f16(b, 2)
    return _q5_bits(b[4:8], b[8:24]).astype(np.float32) * d + m


def _q8_0(b: np.ndarray) -> np.ndarray:
    return b[2:34].view(np.int8).astype(np.float32) * _f16(b, 0)


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    q = [int(v) for v in q]
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    scale = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4)
    minimum = (q[j + 4] >> 4) | ((q[j] >> 6) << 4)
    return scale, minimum


def _q4_k(b: np.ndarray) -> np.ndarray:
    d, dmin, scales, qs = _f16(b, 0), _f16(b, 2), b[4:16], b[16:144]
    out = np.empty(256, dtype=np.float32)
    for chunk in range(4):
        q = qs[32 * chunk : 32 * chunk + 32]
        for half, values in ((0, q & 0x0F), (1, q >> 4)):
            scale, minimum = _scale_min_k4(2 * chunk + half, scales)
            start = 64 * chunk + 32 * half
            out[start : start + 32] = (d * np.float32(scale)) * values.astype(np.float32) - (
                dmin * np.float32(minimum)
            )
    return out


def _q5_k(b: np.ndarray) -> np.ndarray:
    d, dmin, scales, qh, qs = _f16(b, 0), _f16(b, 2), b[4:16], b[16:48], b[48:176]
    out = np.empty(256, dtype=np.float32)
    for chunk in range(4):
        ql = qs[32 * chunk : 32 * chunk + 32]
        for half, low in ((0, ql & 0x0F), (1, ql >> 4)):
            bit = 1 << (2 * chunk + half)
            values = low.astype(np.int32) + np.where(qh & bit, 16, 0)
            scale, minimum = _scale_min_k4(2 * chunk + half, scales)
            start = 64 * chunk + 32 * half
            out[start : start + 32] = (d * np.float32(scale)) * values.astype(np.float32) - (
                dmin * np.float32(minimum)
            )
    return out


def _q6_k(b: np.ndarray) -> np.ndarray:
    ql_all, qh_all, sc_all, d = b[0:128], b[128:192], b[192:208].view(np.int8), _f16(b, 208)
    out = np.empty(256, dtype=np.float32)
    for n in range(2):
        ql, qh, sc = ql_all[64 * n : 64 * n + 64], qh_all[32 * n : 32 * n + 32], sc_all[8 * n :]
        for lane in range(32):
            group = lane // 16
            h = int(qh[lane])
            q1 = ((int(ql[lane]) & 0xF) | ((h & 3) << 4)) - 32
            q2 = ((int(ql[lane + 32]) & 0xF) | (((h >> 2) & 3) << 4)) - 32
            q3 = ((int(ql[lane]) >> 4) | (((h >> 4) & 3) << 4)) - 32
            q4 = ((int(ql[lane + 32]) >> 4) | (((h >> 6) & 3) << 4)) - 32
            for k, q in enumerate((q1, q2, q3, q4)):
                out[128 * n + 32 * k + lane] = d * np.float32(int(sc[group + 2 * k]) * q)
    return out


_BLOCK_READERS = {
    QType.Q4_0: _q4_0,
    QType.Q4_1: _q4_1,
    QType.Q5_0: _q5_0,
    QType.Q5_1: _q5_1,
    QType.Q8_0: _q8_0,
    QType.Q4_K: _q4_k,
    QType.Q5_K: _q5_k,
    QType.Q6_K: _q6_k,
}
