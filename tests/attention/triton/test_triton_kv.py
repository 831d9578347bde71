"""The Triton store kernel writes each token's rows to its slot and nothing else."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedkv.attention.triton.kv import triton_write_kv  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_matches_reference(
    device: torch.device, block_size: int, dtype: torch.dtype
) -> None:
    """Scattered slots in several blocks; key and value are slices of one fused projection."""
    num_blocks, num_kv_heads, head_dim, num_tokens = 6, 2, 24, 37
    generator = torch.Generator().manual_seed(block_size)
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=generator).to(dtype)
    key, value = fused[:, num_kv_heads : 2 * num_kv_heads], fused[:, 2 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_ref = torch.randn(cache_shape, generator=generator).to(dtype)
    v_ref = torch.randn(cache_shape, generator=generator).to(dtype)
    k_cache, v_cache = k_ref.to(device), v_ref.to(device)

    triton_write_kv(key.to(device), value.to(device), k_cache, v_cache, slots.to(device))
    k_ref.view(-1, num_kv_heads, head_dim)[slots] = key
    v_ref.view(-1, num_kv_heads, head_dim)[slots] = value
    assert torch.equal(k_cache.cpu(), k_ref)
    assert torch.equal(v_cache.cpu(), v_ref)


def test_write_kv_rejects_wrong_head_count(device: torch.device) -> None:
    """Keys with more heads than the cache holds are an error naming the expected shape."""
    cache = torch.zeros(2, 16, 2, 8, device=device)
    key = torch.zeros(3, 4, 8, device=device)
    with pytest.raises(ValueError, match=r"key must be \(3, 2, 8\)"):
        triton_write_kv(key, key, cache, cache.clone(), torch.arange(3, device=device))
