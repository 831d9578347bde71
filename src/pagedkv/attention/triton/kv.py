"""Triton store kernel: the new tokens' keys and values into their paged cache slots.

The PyTorch reference (`pagedkv.attention.torch_backend.write_kv`) does two scatter launches
through a flat view of each cache. Here one program per token copies that token's key and
value rows (all KV heads) to slot ``block * block_size + offset``: one launch, no index
tensors built, and it reads ``key`` and ``value`` through their strides, so slices of a fused
QKV projection need no copy first. Imported only on the GPU path and in tests: it imports
triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


def triton_write_kv(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Write ``key``, ``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their slots.

    ``k_cache``, ``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``;
    ``slot_mapping`` holds one flat slot id (``block * block_size + offset``) per token.
    """
    _check(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride()[:2],
        *value.stride()[:2],
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        HEADS_P=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_P=triton.next_power_of_2(head_dim),
    )


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
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
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_P)[:, None]
    dims = tl.arange(0, HEAD_DIM_P)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)

    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads * stride_kch + dims
    tl.store(k_dst, k, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + dims
    tl.store(v_dst, v, mask=mask)


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
        if tensor.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
            raise ValueError(
                f"{name} ({tensor.dtype}) and caches ({k_cache.dtype}, {v_cache.dtype}) differ"
            )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if any(t.stride(-1) != 1 for t in (key, value, k_cache, v_cache)):
        raise ValueError("key, value and the caches need a contiguous last (head_dim) dimension")
    if any(t.device != k_cache.device for t in (key, value, v_cache, slot_mapping)):
        raise ValueError("key, value, caches and slot_mapping must be on one device")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
