"""`bench/burst_bench.py`'s figures on a tiny model, against the block arithmetic of a burst:
without a prefix cache every request computes and holds its whole prompt; with it, the first
computes the system prompt and the others, admitted in that same step, only their questions."""

from __future__ import annotations

import argparse

import pytest

from pagedkv.engine import Engine, EngineArgs
from tests.bench import load_script

burst_bench = load_script("burst_bench")


@pytest.mark.parametrize("caching", [False, True])
def test_the_first_step_computes_the_system_prompt_once_with_the_cache(zoo, caching) -> None:
    requests, system, question = 4, 3 * 16, 8  # a system prompt of 3 full blocks
    args = argparse.Namespace(
        requests=requests, system_tokens=system, question_tokens=question, answer_tokens=3, seed=1
    )
    engine = Engine(
        EngineArgs(model=str(zoo.folder("llama")), num_gpu_blocks=64, enable_prefix_caching=caching)
    )
    result = burst_bench.run(engine, args, round_index=0)
    # All run at once; each ends with 56 + 3 tokens at most: 4 blocks, 3 of them the system's.
    blocks = -(-(system + question + 3) // 16)
    if caching:
        assert result.computed_prompt_tokens == system + requests * question
        assert result.peak_blocks == 3 + requests * (blocks - 3)
    else:
        assert result.computed_prompt_tokens == requests * (system + question)
        assert result.peak_blocks == requests * blocks
    assert len(result.ttfts) == requests
    assert engine.manager.num_free_blocks == engine.manager.num_gpu_blocks
