"""`pagedkv plan --lora-rank R --max-loras N`: the adapters' share of the pool, by the
arithmetic of the issue (A [R, in] and B [out, R] of the 7 projections, float32, per layer),
packed into whole blocks the way the engine packs them."""

from __future__ import annotations

import json

from pagedkv.cli import main

# Llama 3 8B: hidden 4096, 32 q heads and 8 KV heads of 128, MLP 14336, 32 layers.
IN_OUT = (
    [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096)] + [(4096, 14336)] * 2 + [(14336, 4096)]
)


def test_adapter_bytes_and_blocks_follow_the_arithmetic(capsys):
    argv = ["plan", "--model", "llama-3-8b", "--pool-gb", "53", "--json"]
    assert main(argv) == 0
    without = json.loads(capsys.readouterr().out)
    assert main([*argv, "--lora-rank", "16", "--max-loras", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    per_layer = sum(16 * i + o * 16 for i, o in IN_OUT)
    assert out["bytes_per_adapter"] == 32 * per_layer * 4
    block_bytes = 131_072 * 16
    # Per layer a block lends its K and its V chunk (block_bytes / 32 layers / 2 each): an
    # adapter takes at least its bytes' worth of blocks; packed whole, first fit into the two
    # regions fails only while both are fuller than capacity - largest matrix, so at most
    # (half a layer + the largest matrix) per chunk.
    chunk = block_bytes // 32 // 2 // 4
    largest = max(max(16 * i, o * 16) for i, o in IN_OUT)
    least = -(-out["bytes_per_adapter"] // block_bytes)
    most = -(-(per_layer // 2 + largest) // chunk)
    assert least <= out["blocks_per_adapter"] <= most
    assert out["adapter_blocks"] == 4 * out["blocks_per_adapter"]
    assert out["adapter_pool_bytes"] == out["adapter_blocks"] * block_bytes
    assert without["pool_blocks"] - out["pool_blocks"] == out["adapter_blocks"]


def test_adapters_larger_than_the_pool_are_a_one_line_error(capsys):
    argv = ["plan", "--model", "llama-3-8b", "--pool-gb", "0.1", "--lora-rank", "64"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv plan: error:") and "1 LoRA adapter of rank 64 takes" in err


def test_a_rank_holds_its_share_under_tensor_parallelism(capsys):
    """At TP=2 a rank keeps B's rows of its heads and channels for q/k/v and gate/up (A whole)
    and A's columns of its inputs for o and down (B whole), in blocks of its 4 KV heads."""
    argv = ["plan", "--model", "llama-3-8b", "--pool-gb", "53", "--json", "--lora-rank", "16"]
    assert main([*argv, "--tensor-parallel-size", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    column = [(4096, 2048), (4096, 512), (4096, 512)] + [(4096, 7168)] * 2
    row = [(2048, 4096), (7168, 4096)]
    per_layer = sum(16 * i + o * 16 for i, o in column + row)
    assert out["bytes_per_adapter"] == 32 * per_layer * 4
    block_bytes = 131_072 * 16 // 2
    least = -(-out["bytes_per_adapter"] // block_bytes)
    assert least <= out["blocks_per_adapter"]
    assert out["adapter_pool_bytes"] == out["blocks_per_adapter"] * block_bytes
