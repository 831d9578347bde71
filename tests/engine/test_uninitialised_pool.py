"""The KV pool is allocated, never zero-filled: outputs must not depend on what it held.

Each engine's pool (and swap space) is filled with NaN before any request runs, the worst
value an uninitialised page can hold: a NaN that reached a softmax or a `weight * value` sum
would turn the logits to NaN. Outputs must equal those of the same engine over a zeroed pool,
and transformers' greedy tokens where the dtype is float32, through every attention path the
CPU takes: the C attention kernel (float32 and 16-bit caches), the fused decode layer
(quantised weights), with a sliding window, and under swap preemption (whole blocks,
unwritten tails included, move to and from swap).
An fp8 pool is filled with NaN bytes (0xFF in both formats) and read by the same paths: the
C kernels through their byte table and the fused layer.
"""

from __future__ import annotations

import math

import pytest

from pagedkv.engine import SamplingParams
from tests.engine.conftest import make_engine, run_to_completion
from tests.model.tiny_models import random_prompt

# ignore_eos: every request runs its 20 tokens, so the pool runs out (and swaps) whatever
# tokens the model picks.
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, logprobs=1, ignore_eos=True)
PROMPTS = [random_prompt(length, seed=length) for length in (3, 17, 40, 71, 130)]
CASES = [
    ("llama", "float32", "none", "auto"),
    ("mistral", "float32", "none", "auto"),
    ("llama", "bfloat16", "none", "auto"),
    ("mistral", "bfloat16", "none", "auto"),
    ("llama", "float32", "int4", "auto"),
    ("llama", "float32", "none", "fp8"),
    ("mistral", "bfloat16", "none", "fp8"),
    ("llama", "float32", "int4", "fp8"),
    ("mistral", "float32", "none", "fp8_e5m2"),
]
NAN_BYTE = 0xFF  # NaN in float8_e4m3fn and in float8_e5m2


def _greedy(engine) -> list[list[int]]:
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(str(index), prompt, GREEDY)
    tokens: dict[str, list[int]] = {}
    for deltas in run_to_completion(engine):
        for delta in deltas:
            assert not math.isnan(delta.outputs[0].cumulative_logprob)
            tokens.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
    return [tokens[str(index)] for index in range(len(PROMPTS))]


@pytest.mark.parametrize(("name", "dtype", "quantization", "kv_cache_dtype"), CASES)
def test_a_nan_filled_pool_changes_no_output(engine_zoo, name, dtype, quantization, kv_cache_dtype):
    outputs = []
    nan = float("nan") if kv_cache_dtype == "auto" else NAN_BYTE
    for fill in (0, nan):
        # 12 blocks for 5 prompts of up to 150 tokens: requests are swapped out and back in.
        engine = make_engine(
            engine_zoo,
            name,
            dtype=dtype,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            num_gpu_blocks=12,
        )
        engine.kv_cache.cache.fill_(fill)
        engine.kv_cache.swap_space.fill_(fill)
        outputs.append(_greedy(engine))
        assert engine.stats.num_swap_preemptions > 0
    assert outputs[1] == outputs[0]
    if dtype == "float32" and quantization == "none" and kv_cache_dtype == "auto":
        expected = [engine_zoo.hf_greedy(name, tuple(p), GREEDY.max_tokens) for p in PROMPTS]
        # transformers stops at EOS; ours runs on past it
        pairs = zip(outputs[1], expected, strict=True)
        assert [ours[: len(theirs)] for ours, theirs in pairs] == expected
