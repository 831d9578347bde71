"""Per-rank KV arithmetic: each rank's cache holds its share of the KV heads, or one
replicated head when there are fewer heads than ranks; `pagedkv plan` prints those figures."""

from __future__ import annotations

import json

import pytest

from pagedkv.cli import main
from pagedkv.kvmath.parallel import kv_heads_per_rank, per_rank_spec
from pagedkv.kvmath.presets import MODEL_PRESETS
from pagedkv.kvmath.spec import ConfigError, KVSpec


@pytest.mark.parametrize(
    ("kv_heads", "ranks", "per_rank"), [(8, 1, 8), (8, 2, 4), (8, 8, 1), (2, 4, 1), (1, 2, 1)]
)
def test_heads_split_evenly_or_replicate_one_per_rank(kv_heads, ranks, per_rank):
    assert kv_heads_per_rank(kv_heads, ranks) == per_rank


@pytest.mark.parametrize(
    ("kv_heads", "ranks", "message"),
    [
        (8, 3, r"8 KV heads are not divisible by tensor_parallel_size \(3\)"),
        (2, 3, r"tensor_parallel_size \(3\) is not a multiple of the 2 KV heads"),
        (8, 0, r"tensor_parallel_size must be >= 1, got 0"),
    ],
)
def test_heads_that_cannot_be_split_are_refused_with_the_numbers(kv_heads, ranks, message):
    with pytest.raises(ConfigError, match=message):
        kv_heads_per_rank(kv_heads, ranks)


def test_a_rank_holds_half_the_bytes_at_two_ranks_and_one_head_past_the_heads():
    spec = KVSpec(num_layers=32, kv_dtype="bf16", num_kv_heads=8, head_dim=128)
    assert per_rank_spec(spec, 2).bytes_per_block(16) * 2 == spec.bytes_per_block(16)
    assert per_rank_spec(spec, 16).bytes_per_token * 8 == spec.bytes_per_token


def test_plan_shows_per_rank_bytes_and_a_pool_of_twice_the_blocks(capsys):
    argv = ["plan", "--model", "llama-3-8b", "--pool-gb", "20", "--json"]
    assert main(argv) == 0
    single = json.loads(capsys.readouterr().out)
    assert main([*argv, "--tensor-parallel-size", "2"]) == 0
    double = json.loads(capsys.readouterr().out)
    assert double["kv_heads_per_rank"] == 4
    assert double["bytes_per_token_per_rank"] * 2 == single["bytes_per_token_per_rank"]
    assert double["bytes_per_token_all_ranks"] == single["bytes_per_token_all_ranks"]
    assert double["pool_blocks"] // 2 == single["pool_blocks"]  # twice, up to rounding


def test_plan_refuses_ranks_the_heads_cannot_split(capsys):
    argv = ["plan", "--model", "llama-3-8b", "--pool-gb", "20", "--tensor-parallel-size", "3"]
    assert main(argv) == 2
    assert "8 KV heads are not divisible by tensor_parallel_size (3)" in capsys.readouterr().err


def test_plan_refuses_ranks_the_query_heads_cannot_split(capsys):
    """Qwen2.5-7B: 4 KV heads replicate over 8 ranks, but 28 query heads do not split in 8
    (vLLM refuses it too; so does the engine's splitter). 4 ranks take 7 each."""
    argv = ["plan", "--model", "qwen2.5-7b", "--pool-gb", "20", "--tensor-parallel-size"]
    assert main([*argv, "8"]) == 2
    message = "28 attention heads are not divisible by tensor_parallel_size (8)"
    assert message in capsys.readouterr().err
    assert main([*argv, "4"]) == 0


def test_plan_refuses_ranks_the_mlp_cannot_split(capsys, tmp_path):
    """Llama 3 8B with 14338 MLP channels: 2 ranks take 7169 each, 4 cannot split them (the
    engine's splitter refuses gate_proj's rows), with or without LoRA adapters to plan."""
    config = dict(MODEL_PRESETS["llama-3-8b"].config, intermediate_size=14338)
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["plan", "--model", str(tmp_path), "--pool-gb", "20", "--tensor-parallel-size"]
    assert main([*argv, "2"]) == 0
    capsys.readouterr()
    for extra in ([], ["--lora-rank", "8"]):
        assert main([*argv, "4", *extra]) == 2
        message = "14338 MLP channels (intermediate_size) are not divisible by tensor_parallel_size"
        assert message in capsys.readouterr().err


def test_plan_from_a_gpu_counts_each_ranks_share_of_the_weights(capsys):
    argv = ["plan", "--model", "llama-3-8b", "--gpu", "h100-80gb", "--json"]
    assert main(argv) == 0
    single = json.loads(capsys.readouterr().out)["pool"]
    assert main([*argv, "--tensor-parallel-size", "2"]) == 0
    double = json.loads(capsys.readouterr().out)["pool"]
    assert double["weight_bytes"] == single["weight_bytes"] // 2
    assert double["pool_bytes"] == single["pool_bytes"] + single["weight_bytes"] // 2
