"""Penalties through the engine: greedy tokens equal an oracle that applies vLLM's formulas
to transformers' logits, recomputing the counts from the token lists at every step.

The engine keeps counts as tensors updated one token at a time (`engine/penalties.py`); the
oracle counts from scratch, so a count missed, doubled by a recompute preemption, or shared
between a request's samples would change the tokens.
"""

from __future__ import annotations

import pytest

from pagedkv.engine import SamplingParams
from tests.engine.conftest import make_engine, run_to_completion
from tests.model.tiny_models import random_prompt

MAX_TOKENS = 24
SETTINGS = [
    dict(repetition_penalty=1.6),
    dict(frequency_penalty=1.5),
    dict(presence_penalty=1.8, repetition_penalty=0.8),
]


def oracle(zoo, prompt: list[int], settings: dict) -> list[int]:
    output: list[int] = []
    for _ in range(MAX_TOKENS):
        logits = zoo.hf_logits("llama", prompt + output)[-1].tolist()
        for token in set(prompt + output):
            penalty = settings.get("repetition_penalty", 1.0)
            logits[token] = (
                logits[token] / penalty if logits[token] > 0 else logits[token] * penalty
            )
        for token in set(output):
            logits[token] -= settings.get("frequency_penalty", 0.0) * output.count(token)
            logits[token] -= settings.get("presence_penalty", 0.0)
        output.append(max(range(len(logits)), key=logits.__getitem__))
    return output


@pytest.mark.parametrize("settings", SETTINGS, ids=["repetition", "frequency", "presence"])
def test_penalised_greedy_tokens_follow_the_formulas_under_preemption(engine_zoo, settings):
    # Short prompts that each grow to 2-3 blocks, in a pool of 6: admitted while they fit,
    # they outgrow the pool as they decode and preempt one another (recompute).
    prompts = [random_prompt(length, seed=length) for length in (3, 9, 14, 17)]
    engine = make_engine(engine_zoo, num_gpu_blocks=6, preemption_mode="recompute")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **settings)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    tokens: dict[str, list[int]] = {}
    for deltas in run_to_completion(engine):
        for delta in deltas:
            tokens.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
    assert engine.stats.num_recompute_preemptions > 0
    for index, prompt in enumerate(prompts):
        assert tokens[str(index)] == oracle(engine_zoo, prompt, settings), index


def test_each_of_n_samples_counts_only_its_own_tokens(engine_zoo):
    """Greedy n=3: every sample must be the n=1 oracle's output; counts shared between the
    samples (or a prompt mask counted per sample) would penalise some tokens thrice."""
    prompt = random_prompt(30, seed=3)
    settings = dict(frequency_penalty=1.5, repetition_penalty=1.3)
    params = SamplingParams(
        n=3, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **settings
    )
    engine = make_engine(engine_zoo)
    engine.add_request("a", prompt, params)
    samples: dict[int, list[int]] = {}
    for deltas in run_to_completion(engine):
        for delta in deltas:
            for output in delta.outputs:
                samples.setdefault(output.index, []).extend(output.token_ids)
    expected = oracle(engine_zoo, prompt, settings)
    assert samples == {0: expected, 1: expected, 2: expected}
