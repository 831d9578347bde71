"""KVCache: sized by blocks or bytes; a step's plan moves whole blocks in every layer, in order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from pagedkv.attention.errors import KVCacheDtypeMismatch
from pagedkv.memory import BlockMove, KVCacheManager, MemoryPlan, MoveKind
from pagedkv.model.config import ModelConfig
from pagedkv.model.llama import LlamaModel
from pagedkv.worker.errors import KVCacheTooSmall
from pagedkv.worker.kv_cache import KVCache, bytes_per_block

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


def cpu_blocks(cache: KVCache, block_ids: list[int]) -> torch.Tensor:
    """Swap-space blocks laid out like `cache.cache[:, :, block_ids]`."""
    return cache.swap_space[block_ids].movedim(0, 2)


def test_copies_move_keys_and_values_of_every_layer():
    cache = random_cache()
    before = cache.cache.clone()
    cache.execute(MemoryPlan.of(MoveKind.COPY, [(1, 5), (2, 6)]))
    assert torch.equal(cache.cache[:, :, [5, 6]], before[:, :, [1, 2]])
    untouched = [0, 1, 2, 3, 4, 7]
    assert torch.equal(cache.cache[:, :, untouched], before[:, :, untouched])
    after = cache.cache.clone()
    cache.execute(MemoryPlan())
    assert torch.equal(cache.cache, after)


def test_swap_out_then_in_restores_blocks_into_new_places():
    cache = random_cache(num_cpu_blocks=5)
    original = cache.cache[:, :, [3, 5, 4]].clone()
    cache.execute(MemoryPlan.of(MoveKind.SWAP_OUT, [(3, 1), (5, 0), (4, 4)]))  # three CPU runs
    assert torch.equal(cpu_blocks(cache, [1, 0, 4]), original)
    cache.cache.zero_()  # the device blocks are reused by others meanwhile

    cache.execute(MemoryPlan.of(MoveKind.SWAP_IN, [(1, 6), (0, 2), (4, 0)]))

    assert torch.equal(cache.cache[:, :, [6, 2, 0]], original)
    assert not cache.cache[:, :, [1, 3, 4, 5, 7]].any()


def test_the_swap_space_keeps_each_block_contiguous_so_a_run_is_one_copy():
    cache = random_cache(num_cpu_blocks=4)
    assert cache.swap_space.shape == (4, 3, 2, 2, 1, 4)
    assert cache.swap_space[1:3].is_contiguous()
    swap_space = cache.swap_space.data_ptr()
    cache.execute(MemoryPlan.of(MoveKind.SWAP_OUT, [(6, 1), (2, 2)]))
    assert cache.swap_space.data_ptr() == swap_space  # written in place, never replaced
    assert torch.equal(cpu_blocks(cache, [1, 2]), cache.cache[:, :, [6, 2]])


moves = st.lists(
    st.tuples(st.sampled_from(list(MoveKind)), st.integers(0, 5), st.integers(0, 5)), max_size=12
)


@settings(max_examples=150, deadline=None)
@given(moves)
def test_execute_equals_running_the_moves_one_by_one(raw_moves):
    cache = random_cache(num_blocks=6, num_cpu_blocks=6)
    cache.swap_space.copy_(torch.randn_like(cache.swap_space))
    check_execute_runs_the_moves_one_by_one(cache, raw_moves)


def check_execute_runs_the_moves_one_by_one(cache: KVCache, raw_moves) -> None:
    """`cache.execute` of the moves leaves what copying them one block at a time would."""
    device, cpu = cache.cache.clone(), cache.swap_space.movedim(0, 2).clone()
    spaces = {MoveKind.COPY: (device, device), MoveKind.SWAP_OUT: (device, cpu)}
    for kind, src, dst in raw_moves:
        source, target = spaces.get(kind, (cpu, device))
        target[:, :, dst] = source[:, :, src]

    cache.execute(MemoryPlan([BlockMove(*move) for move in raw_moves]))

    assert torch.equal(cache.cache, device)
    assert torch.equal(cache.swap_space.movedim(0, 2), cpu)


class IndexDevices(TorchFunctionMode):
    """Records the device of every integer (index) tensor a torch call receives.

    Copies out of a `meta` tensor have no data to copy; they are skipped so a `meta` cache can
    run a whole plan and show where each index tensor was made.
    """

    def __init__(self) -> None:
        super().__init__()
        self.devices: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for arg in [*args, *kwargs.values()]:
            if isinstance(arg, torch.Tensor) and arg.dtype == torch.int64:
                self.devices.add(arg.device.type)
        if func is torch.Tensor.copy_ and args[1].is_meta and not args[0].is_meta:
            return args[0]
        return func(*args, **kwargs)


def test_plan_execution_makes_every_index_on_the_cache_device():
    cache = KVCache(
        num_layers=2,
        num_blocks=6,
        block_size=2,
        num_kv_heads=1,
        head_dim=4,
        device="meta",
        num_cpu_blocks=4,
    )
    plan = MemoryPlan.of(MoveKind.SWAP_OUT, [(0, 0), (1, 1), (4, 3)])
    plan.extend(MemoryPlan.of(MoveKind.COPY, [(2, 0), (3, 1)]))
    plan.extend(MemoryPlan.of(MoveKind.SWAP_IN, [(3, 5), (0, 4)]))
    with IndexDevices() as recorded:
        cache.execute(plan)
    assert recorded.devices == {"meta"}


def test_a_step_plan_saves_a_swapped_block_before_a_later_move_reuses_it():
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
    # copy-on-write and to a new request. The step's plan keeps the order they happened in.
    step = manager.swap_out("swapped")
    step.extend(manager.append("child", [24]))
    manager.allocate("newcomer", [31])
    newcomer_block = manager.block_table("newcomer")[0]
    [*_, cow] = step
    assert [move.kind for move in step] == [MoveKind.SWAP_OUT] * 2 + [MoveKind.COPY]
    assert cow.src == parent_last
    assert {cow.dst, newcomer_block} == set(swapped_blocks)

    cache.execute(step)
    # The forward pass then writes the new tokens' K/V into the reused blocks.
    cache.cache[:, :, newcomer_block, 0] = torch.randn_like(cache.cache[:, :, newcomer_block, 0])
    cache.cache[:, :, cow.dst, 1] = torch.randn_like(cache.cache[:, :, cow.dst, 1])

    assert torch.equal(cache.cache[:, :, cow.dst, 0], parent_last_kv[:, :, 0])
    assert torch.equal(cpu_blocks(cache, [move.dst for move in step][:2]), swapped_kv)

    manager.free("newcomer")
    manager.free("child")
    cache.execute(manager.swap_in("swapped"))
    assert torch.equal(cache.cache[:, :, manager.block_table("swapped")], swapped_kv)
    assert torch.equal(cache.cache[:, :, parent_last], parent_last_kv)
    manager.check_invariants()


def test_there_is_no_per_kind_entry_point_to_run_moves_out_of_order():
    public = {name for name in dir(KVCache) if not name.startswith("_")}
    assert {"copy_blocks", "swap_out", "swap_in"}.isdisjoint(public)
    assert "execute" in public


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_cache_for_a_model_takes_the_models_dtype(dtype):
    model = LlamaModel(TINY).to(dtype)
    cache = KVCache.for_model(model, block_size=2, num_blocks=3, num_cpu_blocks=1)
    assert cache.dtype == cache.swap_space.dtype == dtype
    assert cache.cache.device == model.embed_tokens.weight.device
    assert KVCache.for_model(model, block_size=2, num_blocks=3, dtype=dtype).dtype == dtype


def test_a_kv_dtype_mismatch_is_an_error_naming_both_dtypes():
    model = LlamaModel(TINY).to(torch.bfloat16)
    with pytest.raises(KVCacheDtypeMismatch, match="K/V are torch.bfloat16 .* holds torch.float32"):
        KVCache.for_model(model, block_size=2, num_blocks=3, dtype=torch.float32)
    cache = KVCache.for_model(TINY, block_size=2, num_blocks=3)  # a bare config: float32
    cache.check_dtype(torch.float32)
    with pytest.raises(KVCacheDtypeMismatch, match="K/V are torch.float16 .* holds torch.float32"):
        cache.check_dtype(torch.float16)


class CopyLengths(TorchFunctionMode):
    """Records how many blocks each swap copy moves: the index length of every gather from the
    device cache (`index_select`) and every scatter into it (`index_copy_`)."""

    def __init__(self) -> None:
        super().__init__()
        self.lengths: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.index_select, torch.Tensor.index_select, torch.Tensor.index_copy_):
            self.lengths.append(len(args[2]))
        return func(*args, **kwargs)


def test_a_long_swap_is_copied_in_bounded_runs(monkeypatch):
    monkeypatch.setattr("pagedkv.worker.kv_cache.MAX_BLOCKS_PER_SWAP_COPY", 2)
    cache = random_cache(num_blocks=8, num_cpu_blocks=6)
    original = cache.cache[:, :, [7, 6, 5, 4, 3]].clone()
    with CopyLengths() as swap_out:
        cache.execute(MemoryPlan.of(MoveKind.SWAP_OUT, zip([7, 6, 5, 4, 3], range(5), strict=True)))
    assert torch.equal(cpu_blocks(cache, list(range(5))), original)
    cache.cache.zero_()
    with CopyLengths() as swap_in:
        cache.execute(MemoryPlan.of(MoveKind.SWAP_IN, zip(range(5), [0, 1, 2, 3, 4], strict=True)))
    assert torch.equal(cache.cache[:, :, [0, 1, 2, 3, 4]], original)
    # Five consecutive CPU blocks, at most two per copy: runs of 2, 2 and 1, in plan order.
    assert swap_out.lengths == swap_in.lengths == [2, 2, 1]
