"""Triton store kernel: the new tokens' keys and values into their paged cache slots.

The PyTorch reference (`pagedkv.attention.torch_backend.write_kv`) does two scatter launches
through a flat view of each cache. Here one program per token copies that token's key and
value rows (all KV heads) to slot ``block * block_size + offset``: one launch, no index
tensors built, and it reads ``key`` and ``value`` through their strides, so slices of a fused
QKV projection need no copy first. Imported only on the GPU path and in tests: it imports
triton.

Into an fp8 cache each value is scaled and rounded in the kernel by integer arithmetic on its
float32 bits (`_fp8_bits`), to the byte `fp8.quantize` (torch) gives: the same bytes on every
GPU and under the interpreter, whose own float-to-fp8 cast does not round to nearest (it
turned 0.0312 into 0.0156 in e4m3, measured with triton 3.9).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pagedkv.attention.fp8 import FP8_LAYOUTS, UNIT_SCALES, KVScales, as_stored, check_cache_dtypes


def triton_write_kv(
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    scales: KVScales = UNIT_SCALES,
) -> None:
    """Write ``key``, ``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their slots.

    ``k_cache``, ``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``, of the
    keys' dtype or fp8 (rounded into with ``scales``); ``slot_mapping`` holds one flat slot id
    (``block * block_size + offset``) per token.
    """
    _check(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    fp8 = FP8_LAYOUTS.get(k_cache.dtype)
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        as_stored(k_cache),
        as_stored(v_cache),
        slot_mapping,
        1.0 / scales.k,  # the multiplier fp8.quantize uses
        1.0 / scales.v,
        *key.stride()[:2],
        *value.stride()[:2],
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        HEADS_P=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_P=triton.next_power_of_2(head_dim),
        FP8=fp8 is not None,
        FP8_MANTISSA=0 if fp8 is None else fp8.mantissa_bits,
        FP8_BIAS=0 if fp8 is None else fp8.exponent_bias,
        FP8_MAX=0.0 if fp8 is None else fp8.max,
    )


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_inverse_scale,
    v_inverse_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MANTISSA: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_P)[:, None]
    dims = tl.arange(0, HEAD_DIM_P)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)

    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    if FP8:
        k = _fp8_bits(k.to(tl.float32) * k_inverse_scale, FP8_MANTISSA, FP8_BIAS, FP8_MAX)
        v = _fp8_bits(v.to(tl.float32) * v_inverse_scale, FP8_MANTISSA, FP8_BIAS, FP8_MAX)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads * stride_kch + dims
    tl.store(k_dst, k, mask=mask)
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + dims
    tl.store(v_dst, v, mask=mask)


@triton.jit
def _fp8_bits(x, MANTISSA: tl.constexpr, BIAS: tl.constexpr, MAX: tl.constexpr):
    """The fp8 byte nearest float32 ``x`` (ties to even), saturated at ``MAX``, as uint8.

    As ``to_fp8`` in kernels/rope_kv.c: a normal result is float32's bit pattern rounded at the
    format's last mantissa bit (a carry moves into the exponent) and rebiased; a subnormal one
    counts its fixed steps of 2^(1 - BIAS - MANTISSA). NaN stays NaN (0x7F).
    """
    sign = ((x.to(tl.uint32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
    magnitude = tl.minimum(tl.abs(x), MAX)
    bits = magnitude.to(tl.uint32, bitcast=True)
    exponent = (bits >> 23).to(tl.int32) - 127
    shift = 23 - MANTISSA
    half = (1 << (shift - 1)) - 1 + ((bits >> shift) & 1)
    normal = ((bits + half) >> shift) - ((127 - BIAS) << MANTISSA)
    # Below half the smallest step, every shift past 31 rounds to 0 as 31 does.
    sub_shift = tl.minimum(24 - BIAS - MANTISSA - exponent, 31).to(tl.uint32)
    significand = (bits & 0x7FFFFF) | 0x800000
    sub_half = (tl.full(bits.shape, 1, tl.uint32) << (sub_shift - 1)) - 1
    sub_half += (significand >> sub_shift) & 1
    subnormal = (significand + sub_half) >> sub_shift
    rounded = tl.where(exponent >= 1 - BIAS, normal, subnormal).to(tl.uint8)
    return tl.where(x != x, 0x7F, sign | rounded).to(tl.uint8)


def _check(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Raise ValueError on shapes, dtypes or layouts the kernel would silently misread."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    expected = (key.shape[0], *k_cache.shape[2:])
    for name, tensor in (("key", key), ("value", value)):
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"{name} must be {expected} to match the cache, got {tuple(tensor.shape)}"
            )
        check_cache_dtypes(tensor.dtype, k_cache.dtype, v_cache.dtype)
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if any(t.stride(-1) != 1 for t in (key, value, k_cache, v_cache)):
        raise ValueError("key, value and the caches need a contiguous last (head_dim) dimension")
    if any(t.device != k_cache.device for t in (key, value, v_cache, slot_mapping)):
        raise ValueError("key, value, caches and slot_mapping must be on one device")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
