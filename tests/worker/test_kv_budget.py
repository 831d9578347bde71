"""kv_budget: the KV pool from a block count, a byte budget, or half the host's memory.

Bytes per block are worked out here from config.json (K and V, every layer, every KV head,
float32), and MemAvailable is read from /proc/meminfo by the test itself.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import replace

import pytest

from pagedkv.cli import main
from pagedkv.engine import Engine, EngineArgs
from pagedkv.worker import kv_budget as kv_budget_module
from pagedkv.worker.kv_budget import KVCacheTooSmallForModel, kv_budget
from pagedkv.worker.kv_request import PoolRequest

GIB = 1 << 30
BLOCK_SIZE = 16
DEFAULTS = PoolRequest(
    block_size=BLOCK_SIZE,
    swap_space_gb=0.0,
    num_gpu_blocks=None,
    kv_cache_memory=None,
    gpu_memory_utilization=0.9,
    max_num_batched_tokens=2048,
    max_model_len=1024,
)


@pytest.fixture(scope="module")
def per_block(zoo) -> int:
    """Bytes of one block of the tiny Llama, from its config.json."""
    config = json.loads((zoo.folder("llama") / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    return per_token * BLOCK_SIZE


def test_a_block_count_wins_over_a_byte_budget(zoo, per_block):
    request = replace(DEFAULTS, num_gpu_blocks=7, kv_cache_memory=100 * per_block)
    budget = kv_budget(request, zoo.ours("llama"))
    assert (budget.num_gpu_blocks, budget.bytes_per_block) == (7, per_block)


def test_the_start_up_line_counts_whole_requests_or_says_less_than_one(zoo):
    """max_model_len 1024 is 64 blocks a request: 130 blocks hold 2; a pool sized to a
    short request (as `generate` sizes its own) holds less than one, said so, not "0"."""
    two = kv_budget(replace(DEFAULTS, num_gpu_blocks=130), zoo.ours("llama")).describe(1024)
    assert two.endswith("max concurrency at max_model_len (1024 tokens): 2 requests")
    few = kv_budget(replace(DEFAULTS, num_gpu_blocks=3), zoo.ours("llama")).describe(1024)
    assert few.endswith("; less than one request at max_model_len (1024 tokens)")


def test_a_byte_budget_gives_the_whole_blocks_it_holds(zoo, per_block):
    request = replace(DEFAULTS, kv_cache_memory=10 * per_block + per_block - 1, swap_space_gb=0.5)
    budget = kv_budget(request, zoo.ours("llama"))
    assert (budget.num_gpu_blocks, budget.num_cpu_blocks) == (10, GIB // 2 // per_block)


@pytest.mark.parametrize(
    ("available", "pool_bytes"),
    [(2 * GIB, GIB), (3 * GIB + 2, 3 * GIB // 2 + 1), (64 * GIB, 4 * GIB)],
)
def test_on_a_cpu_the_pool_takes_half_the_available_memory_at_most_4_gib(
    zoo, per_block, monkeypatch, available, pool_bytes
):
    monkeypatch.setattr(kv_budget_module, "_available_host_memory", lambda: available)
    budget = kv_budget(DEFAULTS, zoo.ours("llama"))
    assert budget.num_gpu_blocks == pool_bytes // per_block


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc/meminfo")
def test_available_memory_is_memavailable_in_bytes():
    def mem_available() -> int:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        value, unit = fields["MemAvailable"].split()
        assert unit == "kB"  # the kernel's kB are KiB
        return int(value) * 1024

    before = mem_available()
    measured = kv_budget_module._available_host_memory()
    after = mem_available()
    slack = 64 << 20  # other processes allocate and free meanwhile
    assert min(before, after) - slack <= measured <= max(before, after) + slack


def test_a_budget_below_one_block_names_both_sizes(zoo, per_block):
    assert per_block == 8192
    request = replace(DEFAULTS, kv_cache_memory=100)
    message = r"^100 B left for the KV cache holds no block of 8.19 kB / 8.00 KiB \(block_size 16"
    with pytest.raises(KVCacheTooSmallForModel, match=message):
        kv_budget(request, zoo.ours("llama"))


def test_an_engine_sized_by_bytes_holds_that_many_blocks(zoo, per_block):
    args = EngineArgs(
        model=str(zoo.folder("llama")), kv_cache_memory=40 * per_block + 100, swap_space_gb=0.0
    )
    engine = Engine(args)
    assert engine.manager.num_gpu_blocks == engine.kv_cache.num_blocks == 40
    assert engine.kv_cache.cache.nbytes == 40 * per_block
    with pytest.raises(KVCacheTooSmallForModel, match="holds no block"):
        Engine(replace(args, kv_cache_memory=per_block - 1))


@pytest.mark.parametrize("host_ranks", [1, 2])
def test_cpu_pools_above_70_percent_of_the_host_are_refused_counting_every_rank(
    zoo, monkeypatch, host_ranks
):
    """vLLM's rule (swap space times the ranks on the node): 0.4 GiB a rank fits a 1 GiB host
    alone (0.4 <= 0.7) but not twice (0.8 > 0.7)."""
    monkeypatch.setattr(kv_budget_module, "_physical_host_memory", lambda: GIB)
    request = replace(DEFAULTS, num_gpu_blocks=4, swap_space_gb=0.3, kv_offloading_size=0.1)
    request = replace(request, host_ranks=host_ranks)
    if host_ranks == 1:
        assert kv_budget(request, zoo.ours("llama")).num_cpu_blocks > 0
        return
    with pytest.raises(ValueError, match=r"on each of 2 ranks, more than 70% of this host's 1\.00"):
        kv_budget(request, zoo.ours("llama"))


@pytest.mark.parametrize("sized_by", ["num_gpu_blocks", "kv_cache_memory"])
def test_a_cpu_pool_sized_by_hand_counts_as_host_memory(zoo, monkeypatch, sized_by):
    """On a CPU the KV pool is host memory too: 0.5 GiB of pool and 0.3 GiB of swap space
    pass 70% of a 1 GiB host, 0.3 + 0.3 does not; the error names the setting."""
    monkeypatch.setattr(kv_budget_module, "_physical_host_memory", lambda: GIB)
    model = zoo.ours("llama")
    per_block = kv_budget(replace(DEFAULTS, num_gpu_blocks=1, swap_space_gb=0), model)
    per_block = per_block.bytes_per_block

    def request(pool_gib: float) -> PoolRequest:
        size = int(pool_gib * GIB)
        pool = {"num_gpu_blocks": size // per_block} if sized_by == "num_gpu_blocks" else {}
        pool = pool or {"kv_cache_memory": size}
        return replace(DEFAULTS, swap_space_gb=0.3, **pool)

    assert kv_budget(request(0.3), model).num_cpu_blocks > 0
    with pytest.raises(ValueError, match=rf"{sized_by}, swap_space_gb and kv_offloading_size"):
        kv_budget(request(0.5), model)


def test_the_start_up_line_puts_a_draft_models_bytes_where_they_are(zoo, per_block):
    """With a draft model each block id also holds its K/V: in one process that is part of
    the block's bytes; under tensor parallelism only rank 0 holds it, so the line gives the
    model's per-rank bytes and the draft's apart."""
    model = zoo.ours("llama")
    budget = kv_budget(replace(DEFAULTS, num_gpu_blocks=8), model, draft=model)
    assert (budget.bytes_per_block, budget.draft_bytes_per_block) == (2 * per_block, per_block)
    assert "(0.00 GiB, 16.38 kB / 16.00 KiB per block, 8.19 kB / 8.00 KiB of it the draft" in (
        budget.describe(1024)
    )
    ranks = replace(budget, tensor_parallel_size=2).describe(1024)
    assert (
        "8.19 kB / 8.00 KiB per block, and 8.19 kB / 8.00 KiB of the draft model's on rank 0)"
        in ranks
    )
    assert "on each of 2 ranks" in ranks


def test_plan_on_a_cpu_sizes_a_bfloat16_checkpoint_as_the_engine_holds_it(
    zoo, per_block, tmp_path, capsys
):
    """dtype auto is float32 on a CPU whatever the checkpoint says: `plan --device cpu` states
    the engine's blocks for a bfloat16 config; without a device the plan sizes bfloat16, twice
    the blocks, and says which dtype it took and how to pick the device's."""
    folder = tmp_path / "bf16"
    shutil.copytree(zoo.folder("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    pool_bytes = 40 * per_block + per_block // 3
    engine = Engine(EngineArgs(str(folder), kv_cache_memory=pool_bytes, swap_space_gb=0.01))
    assert engine.manager.num_gpu_blocks == 40
    planned = {}
    for device in ("cpu", "cuda", None):
        flags = ["plan", "--model", str(folder), "--pool-gb", str(pool_bytes / 1e9), "--json"]
        assert main([*flags, *(["--device", device] if device else [])]) == 0
        planned[device] = json.loads(capsys.readouterr().out)
    assert planned["cpu"]["pool_blocks"] == 40 and planned["cpu"]["notes"] == []
    assert planned["cuda"]["pool_blocks"] == pool_bytes // (per_block // 2) == 80
    assert planned[None]["pool_blocks"] == 80 and "--device" in planned[None]["notes"][0]
