"""fp8 KV: one byte per cached key or value, in half the memory of a 16-bit cache.

`kv_cache_dtype` takes vLLM's names: "fp8" and "fp8_e4m3" store float8_e4m3fn (3 mantissa bits,
largest value 448), "fp8_e5m2" float8_e5m2 (2 mantissa bits, up to 57344). The model computes
in its own dtype; a value ``x`` is written as ``fp8(clamp(x * (1 / scale), -max, max))`` and
read back as ``float(byte) * scale``, with one scale per layer for its keys and one for its
values (vLLM's per-tensor ``k_scale`` / ``v_scale``, `KVScales`). Every path rounds the same
way, to nearest even, and saturates at the format's largest value: torch's e4m3 cast saturates
by itself but its e5m2 cast overflows to infinity, and a key past the range must not become inf
(its softmax weight) or NaN.

Scales are 1.0, vLLM's default for checkpoints without calibrated scales (`KVCache(scales=...)`
takes others; every kernel applies them). Computed scales were measured and not kept: a float
format's relative precision does not depend on its scale, which only moves the range, and on
the built-in model keys reach at most 21 and values 18 in any layer (512-token windows of the
GPL), far inside e4m3's 448. Perplexity over 8 windows (float32 cache 18.474): scales 1.0 give
+1.2%; vLLM's computed rule (`amax(K) / 200`, `amax(V) / 100` per layer) +0.2% calibrated on
the end of the same text but +2.1% calibrated on another fixed text; random scales of the same
magnitudes +0.7% to +2.4%. The spread says a scale changes only where individual values fall on
the fp8 grid, a draw no rule wins over 1.0, so the simplest one stays. Keys cost most of the
loss (keys alone in fp8: +2.3% over 4 windows; values alone: +0.2%), and e5m2 (2 mantissa bits)
costs about four times e4m3's (+5.0% over 8 windows).

Storage is `torch.uint8`, viewed as the fp8 dtype for conversion: on the CPU, torch has no
``index_copy_`` for float8 tensors, while copy-on-write and swaps must move the bytes as they
are (`worker/kv_cache.py`). Attention receives the fp8 views, so a cache tensor's dtype says
what it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor

FP8_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class KVScales:
    """What one stored byte is worth: a key reads ``float(byte) * k``, a value
    ``float(byte) * v``. Only fp8 caches use them; 16- and 32-bit caches hold values as
    they are."""

    k: float = 1.0
    v: float = 1.0

    def __post_init__(self) -> None:
        for name, scale in (("k_scale", self.k), ("v_scale", self.v)):
            if not scale > 0 or scale == float("inf"):
                raise ValueError(f"{name} must be a positive finite number, got {scale}")


# Bytes worth their table value: the default of every write and read, and ignored by 16- and
# 32-bit caches.
UNIT_SCALES = KVScales()


@dataclass(frozen=True)
class Fp8Layout:
    """The bit layout the C and Triton writers round into: mantissa bits and exponent bias."""

    mantissa_bits: int
    exponent_bias: int
    max: float


FP8_LAYOUTS: dict[torch.dtype, Fp8Layout] = {
    torch.float8_e4m3fn: Fp8Layout(3, 7, 448.0),
    torch.float8_e5m2: Fp8Layout(2, 15, 57344.0),
}


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of `dtype` stores one byte per value (and needs conversion)."""
    return dtype in FP8_LAYOUTS


def as_stored(cache: Tensor) -> Tensor:
    """``cache`` as its memory is stored: an fp8 view as uint8, which every indexing op takes
    on every device (for moving bytes as they are), any other cache as it is."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


def check_cache_dtypes(
    kv_dtype: torch.dtype, k_cache_dtype: torch.dtype, v_cache_dtype: torch.dtype
) -> None:
    """Raise ValueError unless both caches hold the model's `kv_dtype` itself, or both one fp8
    format (converted on the way in and out)."""
    same = k_cache_dtype == v_cache_dtype
    if not same or (k_cache_dtype != kv_dtype and not is_fp8(k_cache_dtype)):
        raise ValueError(
            f"query/keys ({kv_dtype}) and caches ({k_cache_dtype}, {v_cache_dtype}) differ in "
            "dtype: the caches must both hold the model's dtype or both one fp8 format"
        )


def quantize(x: Tensor, dtype: torch.dtype, scale: float) -> Tensor:
    """``x`` as `dtype` bytes: scaled by ``1 / scale`` in float32, saturated, rounded to
    nearest even (the reference the C and Triton writers are tested against)."""
    limit = FP8_LAYOUTS[dtype].max
    return (x.float() * (1.0 / scale)).clamp_(-limit, limit).to(dtype)


@cache
def byte_values(dtype: torch.dtype) -> Tensor:
    """The float32 value of each of the 256 bytes of `dtype` (unscaled; NaN bytes NaN): the
    table the C kernels read fp8 caches through, so they decode exactly as torch does."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).float().contiguous()
