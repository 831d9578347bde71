"""The KV pool is allocated, never zero-filled: outputs must not depend on what it held.

Each engine's pool (and swap space) is filled with NaN before any request runs, the worst
value an uninitialised page can hold: a NaN that reached a softmax or a `weight * value` sum
would turn the logits to NaN. Outputs must equal those of the same engine over a zeroed pool,
and transformers' greedy tokens where the dtype is float32, through every attention path the
CPU takes: the C decode kernel (float32), the fused decode layer (quantised weights), and the
PyTorch block-wise decode with its padded, masked chunks (16-bit caches), with a sliding window,
and under swap preemption (whole blocks, unwritten tails included, move to and from swap).
"""

from __future__ import annotations

import math

import pytest

from pagedkv.engine import SamplingParams
from tests.engine.conftest import make_engine, run_to_completion
from tests.model.tiny_models import random_prompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, logprobs=1)
PROMPTS = [random_prompt(length, seed=length) for length in (3, 17, 40, 71, 130)]
CASES = [
    ("llama", "float32", "none"),
    ("mistral", "float32", "none"),
    ("llama", "bfloat16", "none"),
    ("mistral", "bfloat16", "none"),
    ("llama", "float32", "int4"),
]


def _greedy(engine) -> list[list[int]]:
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(str(index), prompt, GREEDY)
    tokens: dict[str, list[int]] = {}
    for deltas in run_to_completion(engine):
        for delta in deltas:
            assert not math.isnan(delta.outputs[0].cumulative_logprob)
            tokens.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
    return [tokens[str(index)] for index in range(len(PROMPTS))]


@pytest.mark.parametrize(("name", "dtype", "quantization"), CASES)
def test_a_nan_filled_pool_changes_no_output(engine_zoo, name, dtype, quantization):
    outputs = []
    for fill in (0.0, float("nan")):
        # 12 blocks for 5 prompts of up to 150 tokens: requests are swapped out and back in.
        engine = make_engine(
            engine_zoo, name, dtype=dtype, quantization=quantization, num_gpu_blocks=12
        )
        engine.kv_cache.cache.fill_(fill)
        engine.kv_cache.swap_space.fill_(fill)
        outputs.append(_greedy(engine))
        assert engine.stats.num_swap_preemptions > 0
    assert outputs[1] == outputs[0]
    if dtype == "float32" and quantization == "none":
        expected = [engine_zoo.hf_greedy(name, tuple(p), GREEDY.max_tokens) for p in PROMPTS]
        assert outputs[1] == expected
