"""An fp8 KV pool: one byte per value, twice the blocks of 16 bits in the same memory, and
copies and swaps that move its bytes exactly as they are (NaN bytes included)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.attention.errors import KVCacheDtypeMismatch
from pagedkv.attention.fp8 import KVScales
from pagedkv.memory import MemoryPlan, MoveKind
from pagedkv.model.llama import LlamaModel
from pagedkv.worker.kv_budget import kv_budget
from pagedkv.worker.kv_cache import (
    KVCache,
    bytes_per_block,
    kv_cache_torch_dtype,
    kv_dtype_name,
)
from pagedkv.worker.kv_request import PoolRequest
from tests.worker.test_kv_cache import LLAMA3_8B, TINY, check_execute_runs_the_moves_one_by_one

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


def random_bytes_cache(dtype: torch.dtype, num_blocks: int = 6, num_cpu_blocks: int = 6):
    """An fp8 cache whose every byte is random, NaN and infinity bytes included."""
    cache = KVCache.for_model(
        TINY, block_size=2, num_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks, dtype=dtype
    )
    generator = torch.Generator().manual_seed(0)
    cache.cache.copy_(torch.randint(0, 256, cache.cache.shape, generator=generator))
    cache.swap_space.copy_(torch.randint(0, 256, cache.swap_space.shape, generator=generator))
    cache.cache[0, 0, 0, 0, 0, :2] = torch.tensor([0x7F, 0xFF])  # NaN in both formats
    return cache


@pytest.mark.parametrize("dtype", FORMATS)
def test_an_fp8_pool_is_bytes_viewed_as_its_format(dtype):
    cache = KVCache.for_model(TINY, block_size=4, num_blocks=5, num_cpu_blocks=2, dtype=dtype)
    assert cache.cache.dtype == cache.swap_space.dtype == torch.uint8
    assert cache.dtype == dtype
    k_cache, v_cache = cache.layer(1)
    assert k_cache.dtype == v_cache.dtype == dtype and k_cache.shape == (5, 4, 1, 4)
    k_cache[2].fill_(1.5)  # a view: writes reach the pool's bytes
    assert (cache.cache[1, 0, 2] == torch.tensor(1.5).to(dtype).view(torch.uint8)).all()
    assert cache.cache.nbytes == 5 * bytes_per_block(TINY, 4, dtype)


def test_fp8_blocks_take_half_of_16_bits_and_a_quarter_of_32():
    for config in (TINY, LLAMA3_8B):
        fp8 = bytes_per_block(config, 16, torch.float8_e4m3fn)
        assert bytes_per_block(config, 16, torch.float8_e5m2) == fp8
        assert 2 * fp8 == bytes_per_block(config, 16, torch.bfloat16)
        assert 4 * fp8 == bytes_per_block(config, 16, torch.float32)
    # Llama 3 8B: 2 x 32 layers x 8 KV heads x 128 x 1 byte = 64 KiB per token.
    assert bytes_per_block(LLAMA3_8B, 1, torch.float8_e4m3fn) == 65_536


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_the_same_memory_holds_4x_float32_and_2x_bf16_blocks(model_dtype):
    model = LlamaModel(TINY).to(model_dtype)  # sizing reads its config, dtype and device
    request = PoolRequest(
        block_size=16,
        swap_space_gb=0.001,
        num_gpu_blocks=None,
        kv_cache_memory=3_000_001,
        gpu_memory_utilization=0.9,
        max_num_batched_tokens=2048,
        max_model_len=1024,
    )
    auto = kv_budget(request, model)
    fp8 = kv_budget(replace(request, kv_cache_dtype="fp8"), model)
    ratio = model_dtype.itemsize
    assert fp8.bytes_per_block * ratio == auto.bytes_per_block
    assert fp8.num_gpu_blocks == 3_000_001 // fp8.bytes_per_block
    assert fp8.num_gpu_blocks // ratio == auto.num_gpu_blocks  # within one block's rounding
    assert fp8.num_cpu_blocks // ratio == auto.num_cpu_blocks
    assert fp8.kv_dtype == torch.float8_e4m3fn and auto.kv_dtype == model_dtype


@pytest.mark.parametrize("dtype", FORMATS)
def test_copy_on_write_and_swaps_move_bytes_as_they_are(dtype):
    cache = random_bytes_cache(dtype)
    before = cache.cache.clone()
    cache.execute(MemoryPlan.of(MoveKind.COPY, [(0, 4), (2, 5)]))
    assert torch.equal(cache.cache[:, :, [4, 5]], before[:, :, [0, 2]])
    saved = cache.cache[:, :, [4, 1, 3]].clone()
    cache.execute(MemoryPlan.of(MoveKind.SWAP_OUT, [(4, 2), (1, 0), (3, 5)]))
    cache.cache.zero_()
    cache.execute(MemoryPlan.of(MoveKind.SWAP_IN, [(2, 1), (0, 0), (5, 3)]))
    assert torch.equal(cache.cache[:, :, [1, 0, 3]], saved)
    assert cache.cache[0, 0, 1, 0, 0, :2].tolist() == [0x7F, 0xFF]  # block 0 -> 4 -> swap -> 1


moves = st.lists(
    st.tuples(st.sampled_from(list(MoveKind)), st.integers(0, 5), st.integers(0, 5)), max_size=10
)


@settings(max_examples=60, deadline=None)
@given(moves, st.sampled_from(FORMATS))
def test_execute_moves_fp8_bytes_as_moves_one_by_one_would(raw_moves, dtype):
    check_execute_runs_the_moves_one_by_one(random_bytes_cache(dtype), raw_moves)


def test_an_fp8_cache_takes_k_v_of_any_model_dtype():
    for model_dtype in (torch.float32, torch.bfloat16):
        model = LlamaModel(TINY).to(model_dtype)
        cache = KVCache.for_model(model, block_size=2, num_blocks=3, dtype=torch.float8_e4m3fn)
        cache.check_dtype(model_dtype)
    model = LlamaModel(TINY)  # float32: a 16-bit cache is neither its dtype nor fp8
    with pytest.raises(KVCacheDtypeMismatch, match="model's dtype or an fp8 format"):
        KVCache.for_model(model, block_size=2, num_blocks=3, dtype=torch.float16)
    with pytest.raises(ValueError, match="a KV cache stores one of"):
        KVCache(
            num_layers=1, num_blocks=1, block_size=1, num_kv_heads=1, head_dim=1, dtype=torch.int8
        )


def test_scales_are_one_per_layer_and_default_to_one():
    cache = KVCache.for_model(TINY, block_size=2, num_blocks=3, dtype=torch.float8_e4m3fn)
    assert [cache.layer_scales(i) for i in range(3)] == [KVScales(1.0, 1.0)] * 3
    scales = [KVScales(0.5, 0.25), KVScales(1.0, 2.0), KVScales(3.0, 0.1)]
    cache = KVCache.for_model(
        TINY, block_size=2, num_blocks=3, dtype=torch.float8_e4m3fn, scales=scales
    )
    assert [cache.layer_scales(i) for i in range(3)] == scales
    with pytest.raises(ValueError, match="2 KV scales given for 3 layers"):
        KVCache.for_model(TINY, block_size=2, num_blocks=3, scales=scales[:2])


def test_kv_cache_dtype_names():
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.float32) == torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*'fp4'"):
        kv_cache_torch_dtype("fp4", torch.float32)
    names = [kv_dtype_name(d) for d in (torch.float32, torch.bfloat16, *FORMATS)]
    assert names == ["float32", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
