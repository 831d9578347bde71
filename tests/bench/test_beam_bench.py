"""`bench/beam_bench.py`'s two figures, on a tiny model: without sharing, every beam's own
table (arithmetic on the beams' lengths); with sharing, at most one copy of the prompt's
full blocks."""

from __future__ import annotations

import pytest

from pagedkv.engine import BeamSearchParams, Engine, EngineArgs
from tests.bench import load_script

beam_bench = load_script("beam_bench")


@pytest.mark.parametrize("width", [2, 5])
def test_unshared_is_one_table_per_beam_and_shared_holds_the_prompt_once(zoo, width) -> None:
    prompt_length, max_tokens, block_size = 100, 20, 16
    engine = Engine(
        EngineArgs(model=str(zoo.folder("llama")), num_gpu_blocks=64, swap_space_gb=0.01)
    )
    prompt = beam_bench.prompt_ids(prompt_length, engine.config.vocab_size, seed=1)
    params = BeamSearchParams(width, max_tokens, ignore_eos=True)
    memory = beam_bench.measure(engine, prompt, params)
    # The last step holding beams: each has computed all but its last token.
    one_table = -(-(prompt_length + max_tokens - 1) // block_size)
    assert memory.unshared[-1] == max(memory.unshared) == width * one_table
    # After the first step the beams are the prompt's forks: one set of blocks, W tables.
    prompt_blocks = -(-prompt_length // block_size)
    assert (memory.shared[0], memory.unshared[0]) == (prompt_blocks, width * prompt_blocks)
    full_prompt_blocks = prompt_length // block_size
    for shared, unshared in zip(memory.shared, memory.unshared, strict=True):
        assert shared <= unshared
    assert max(memory.shared) <= max(memory.unshared) - (width - 1) * full_prompt_blocks
    assert memory.saving == max(memory.unshared) / max(memory.shared) > 1
    assert engine.manager.num_free_blocks == engine.manager.num_gpu_blocks
