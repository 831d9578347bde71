"""KVCache: sized by blocks or bytes; copy and swap plans move whole blocks in every layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedkv.memory import KVCacheManager
from pagedkv.model.config import ModelConfig
from pagedkv.model.errors import KVCacheTooSmall
from pagedkv.model.kv_cache import KVCache, bytes_per_block

LLAMA3_8B = ModelConfig.from_dict(
    {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    source=Path("config.json"),
)
TINY = ModelConfig.from_dict(
    {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    },
    source=Path("config.json"),
)


def random_cache(num_blocks: int = 8, num_cpu_blocks: int = 4) -> KVCache:
    cache = KVCache.for_model(
        TINY, block_size=2, num_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks
    )
    cache.cache.copy_(torch.randn_like(cache.cache))
    return cache


def test_bytes_per_block_is_2_layers_kv_heads_head_dim_bytes_per_token():
    # Llama 3 8B in fp16: 2 x 32 x 8 x 128 x 2 = 131,072 bytes (128 KiB) per token.
    assert bytes_per_block(LLAMA3_8B, 1, torch.float16) == 131_072
    assert bytes_per_block(LLAMA3_8B, 16, torch.bfloat16) == 16 * 131_072
    assert bytes_per_block(LLAMA3_8B, 16, torch.float32) == 32 * 131_072


def test_sized_by_block_count_or_by_byte_budget():
    cache = KVCache.for_model(TINY, block_size=4, num_blocks=5, num_cpu_blocks=2)
    assert cache.cache.shape == (3, 2, 5, 4, 1, 4)
    assert (cache.num_blocks, cache.num_cpu_blocks, cache.block_size) == (5, 2, 4)
    k_cache, v_cache = cache.layer(1)
    assert k_cache.shape == v_cache.shape == (5, 4, 1, 4)

    per_block = bytes_per_block(TINY, 4, torch.float16)  # 2 * 3 * 1 * 4 * 2 * 4 = 192
    budgeted = KVCache.for_model(
        TINY,
        block_size=4,
        memory_bytes=10 * per_block + per_block - 1,
        cpu_memory_bytes=3 * per_block,
        dtype=torch.float16,
    )
    assert (budgeted.num_blocks, budgeted.num_cpu_blocks) == (10, 3)
    assert budgeted.cache.dtype == budgeted.swap_space.dtype == torch.float16
    assert budgeted.cache.nbytes == 10 * per_block


def test_a_budget_below_one_block_is_a_clear_error():
    with pytest.raises(KVCacheTooSmall, match="budget of 100 bytes holds no block .* 768 bytes"):
        KVCache.for_model(TINY, block_size=8, memory_bytes=100)
    with pytest.raises(ValueError, match="exactly one of num_blocks and memory_bytes"):
        KVCache.for_model(TINY, block_size=8, num_blocks=4, memory_bytes=4096)


def test_layer_views_write_through_to_the_cache():
    cache = random_cache()
    k_cache, v_cache = cache.layer(2)
    k_cache[3].fill_(7.0)
    v_cache[3].fill_(8.0)
    assert (cache.cache[2, 0, 3] == 7.0).all() and (cache.cache[2, 1, 3] == 8.0).all()


def test_copy_blocks_copies_keys_and_values_of_every_layer():
    cache = random_cache()
    before = cache.cache.clone()
    cache.copy_blocks([(1, 5), (2, 6)])
    assert torch.equal(cache.cache[:, :, [5, 6]], before[:, :, [1, 2]])
    untouched = [0, 1, 2, 3, 4, 7]
    assert torch.equal(cache.cache[:, :, untouched], before[:, :, untouched])
    cache.copy_blocks([])
    assert torch.equal(cache.cache[:, :, untouched], before[:, :, untouched])


def test_swap_out_then_in_restores_blocks_into_new_places():
    cache = random_cache()
    original = cache.cache[:, :, [3, 5]].clone()
    cache.swap_out([(3, 1), (5, 0)])
    assert torch.equal(cache.swap_space[:, :, [1, 0]], original)
    cache.cache.zero_()  # the device blocks are reused by others meanwhile

    cache.swap_in([(1, 6), (0, 2)])

    assert torch.equal(cache.cache[:, :, [6, 2]], original)
    assert not cache.cache[:, :, [0, 1, 3, 4, 5, 7]].any()


def test_plans_run_in_order_save_a_swapped_block_before_a_later_plan_reuses_it():
    manager = KVCacheManager(num_gpu_blocks=4, block_size=2, num_cpu_blocks=2)
    cache = random_cache(num_blocks=4, num_cpu_blocks=2)
    manager.allocate("swapped", [11, 12, 13])
    manager.allocate("parent", [21, 22, 23])  # its last block holds one token of two
    manager.fork("parent", "child")
    assert manager.num_free_blocks == 0
    swapped_blocks = manager.block_table("swapped")
    swapped_kv = cache.cache[:, :, swapped_blocks].clone()
    parent_last = manager.block_table("parent")[-1]
    parent_last_kv = cache.cache[:, :, parent_last].clone()

    # One scheduler step: swap a sequence out, then let the freed blocks go to a child's
    # copy-on-write and to a new request. The plans come back in this order.
    swap_out_plan = manager.swap_out("swapped")
    [(cow_src, cow_dst)] = manager.append("child", [24])
    manager.allocate("newcomer", [31])
    newcomer_block = manager.block_table("newcomer")[0]
    assert cow_src == parent_last
    assert {cow_dst, newcomer_block} == set(swapped_blocks)

    out_of_order = KVCache.for_model(TINY, block_size=2, num_blocks=4, num_cpu_blocks=2)
    out_of_order.cache.copy_(cache.cache)
    out_of_order.copy_blocks([(cow_src, cow_dst)])
    out_of_order.swap_out(swap_out_plan)
    cache.swap_out(swap_out_plan)
    cache.copy_blocks([(cow_src, cow_dst)])
    # The forward pass then writes the new tokens' K/V into the reused blocks.
    cache.cache[:, :, newcomer_block, 0] = torch.randn_like(cache.cache[:, :, newcomer_block, 0])
    cache.cache[:, :, cow_dst, 1] = torch.randn_like(cache.cache[:, :, cow_dst, 1])

    assert torch.equal(cache.cache[:, :, cow_dst, 0], parent_last_kv[:, :, 0])
    swapped_cpu_blocks = [cpu for _, cpu in swap_out_plan]
    assert torch.equal(cache.swap_space[:, :, swapped_cpu_blocks], swapped_kv)
    # Run the other way round, the copy would have overwritten a block before it was saved.
    assert not torch.equal(out_of_order.swap_space[:, :, swapped_cpu_blocks], swapped_kv)

    manager.free("newcomer")
    manager.free("child")
    cache.swap_in(manager.swap_in("swapped"))
    assert torch.equal(cache.cache[:, :, manager.block_table("swapped")], swapped_kv)
    assert torch.equal(cache.cache[:, :, parent_last], parent_last_kv)
    manager.check_invariants()
