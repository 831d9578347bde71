"""`pagedkv demo`: the serving demo on a tiny model, and the memory walk-through."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from pagedkv.cli import main
from pagedkv.commands.memory_walkthrough import NUM_CPU_BLOCKS, NUM_GPU_BLOCKS, MemoryDemo
from pagedkv.commands.serving_demo import QUESTIONS


def test_memory_walkthrough_covers_every_stage(capsys) -> None:
    assert main(["demo", "--memory"]) == 0
    out = capsys.readouterr().out
    # C's 10-token prompt repeats A's first 8 tokens: two blocks of 4 come from the cache.
    assert "8 were already computed" in out
    assert "copy-on-write [(" in out
    assert "swap_out plan" in out and "swap_in plan" in out


def test_memory_walkthrough_ends_with_every_block_free() -> None:
    """The state after the walk-through, not its closing line (printed whatever happened)."""
    demo = MemoryDemo(Console(file=io.StringIO()))
    demo.run()
    manager = demo.manager
    assert manager.seq_ids == []
    assert manager.num_free_blocks == NUM_GPU_BLOCKS
    assert manager.num_free_cpu_blocks == NUM_CPU_BLOCKS
    manager.check_invariants()
    stats = manager.stats
    assert (stats.prefix_hit_tokens, stats.cow_copies) == (8, 1)
    assert stats.blocks_swapped_out > 0


def test_serving_demo_answers_every_request_and_frees_every_block(capsys, tmp_path) -> None:
    from tests.model.tiny_models import build_model_folder

    folder = build_model_folder("llama", tmp_path / "llama")
    # 40 blocks of 16 hold a few of the requests at once: they queue, share and preempt.
    argv = ["demo", "--model", str(folder), "--num-gpu-blocks", "40", "--max-tokens", "24"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for question, _, _ in QUESTIONS:
        assert question in out
    for figure in ("KV utilisation", "peak concurrency", "prefix cache", "forks", "preemptions"):
        assert figure in out
    assert "slab allocator, same pool" in out
    assert "every block is free again, invariants hold" in out


def test_the_serving_demo_sizes_its_pool_from_kv_cache_memory_when_given(capsys, tmp_path) -> None:
    """Its small default pool applies only when neither size is given."""
    from tests.model.tiny_models import build_model_folder

    folder = build_model_folder("llama", tmp_path / "llama")
    argv = ["demo", "--model", str(folder), "--max-tokens", "4", "--kv-cache-memory", "800000"]
    assert main(argv) == 0
    assert "every block is free again, invariants hold" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags", [["--model", "elsewhere"], ["--max-tokens", "5"], ["--num-gpu-blocks", "8"]]
)
def test_memory_walkthrough_refuses_flags_it_has_nothing_to_act_on(flags, capsys):
    """A flag silently ignored reads as one that acted: --memory runs no model."""
    assert main(["demo", "--memory", *flags]) == 2
    assert f"{flags[0]} does not apply to --memory" in capsys.readouterr().err
