"""Four ranks over a model of 4 query heads and 2 KV heads: each rank computes one query head
and keeps a replica of the KV head it reads (ranks 0-1 head 0, ranks 2-3 head 1), and the
greedy output, with logprobs, is the one-process output."""

from __future__ import annotations

import pytest

from pagedkv.engine import LLM, SamplingParams
from tests.model.tiny_models import random_prompt

SETTINGS = dict(num_gpu_blocks=24, swap_space_gb=0.01, max_model_len=256, threads=1)
PROMPTS = [random_prompt(length, seed=length) for length in (5, 17, 40, 70)]


@pytest.mark.slow
def test_four_ranks_replicating_two_kv_heads_match_one_rank(tp_folders):
    folder = str(tp_folders["llama"])
    params = SamplingParams(temperature=0.0, max_tokens=20, logprobs=2)
    single = LLM(folder, **SETTINGS)
    parallel = LLM(folder, tensor_parallel_size=4, **SETTINGS)
    try:
        want = single.generate(PROMPTS, params, use_tqdm=False)
        got = parallel.generate(PROMPTS, params, use_tqdm=False)
        assert parallel.engine.kv_bytes_per_block * 2 == single.engine.kv_bytes_per_block
    finally:
        parallel.engine.shutdown()
    assert [out.outputs[0].token_ids for out in got] == [out.outputs[0].token_ids for out in want]
    for ours, theirs in zip(got, want, strict=True):
        for mine, reference in zip(
            ours.outputs[0].logprobs, theirs.outputs[0].logprobs, strict=True
        ):
            assert mine.keys() == reference.keys()
            for token_id, entry in mine.items():
                assert entry.logprob == pytest.approx(reference[token_id].logprob, abs=1e-4)
