"""Greedy outputs equal transformers' `generate`, whatever the engine does to get them.

Each test changes one thing the engine must hide from the output: batch composition and
arrival order, prefix caching, preemption by swap and by recompute under a pool far too
small for the batch, chunked prefill under a tiny token budget, and parallel sampling.
"""

from __future__ import annotations

import pytest

from pagedkv.engine import Engine, SamplingParams
from tests.conftest import TinyZoo
from tests.engine.conftest import make_engine, run_to_completion
from tests.model.tiny_models import TINY_MODELS, random_prompt

FAMILIES = list(TINY_MODELS)
MAX_NEW_TOKENS = 24
LONG_OUTPUT = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
PROMPT_LENGTHS = [5, 17, 33, 64, 100, 150, 230, 300]
PROMPTS = [random_prompt(length, seed=length) for length in PROMPT_LENGTHS]


def expected(zoo: TinyZoo, name: str, prompts: list[list[int]]) -> list[list[int]]:
    return [zoo.hf_greedy(name, tuple(prompt), MAX_NEW_TOKENS) for prompt in prompts]


def generate(engine: Engine, prompts: list[list[int]], params=GREEDY) -> dict[str, list]:
    """Run prompts to completion (ids "0", "1", ...); token ids of every sample by request."""
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    tokens: dict[str, dict[int, list[int]]] = {}
    for deltas in run_to_completion(engine):
        for delta in deltas:
            for output in delta.outputs:
                tokens.setdefault(delta.request_id, {}).setdefault(output.index, []).extend(
                    output.token_ids
                )
    assert engine.manager.num_free_blocks == engine.manager.num_gpu_blocks
    return {rid: [samples[i] for i in sorted(samples)] for rid, samples in tokens.items()}


def first_samples(outputs: dict[str, list]) -> list[list[int]]:
    return [outputs[str(index)][0] for index in range(len(outputs))]


@pytest.mark.parametrize("name", FAMILIES)
def test_batch_of_mixed_lengths_matches_transformers(engine_zoo, name):
    engine = make_engine(engine_zoo, name)
    assert first_samples(generate(engine, PROMPTS)) == expected(engine_zoo, name, PROMPTS)


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_staggered_arrivals_match_transformers(engine_zoo, name):
    engine = make_engine(engine_zoo, name)
    order = [5, 0, 7, 2, 6, 1, 3, 4]
    tokens: dict[str, list[int]] = {}
    pending = list(order)
    while pending or engine.has_unfinished():
        if pending:  # one new request every other step, while others decode
            index = pending.pop(0)
            engine.add_request(str(index), PROMPTS[index], GREEDY)
        for _ in range(2):
            for delta in engine.step():
                tokens.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
            engine.manager.check_invariants()
    got = [tokens[str(index)] for index in range(len(PROMPTS))]
    assert got == expected(engine_zoo, name, PROMPTS)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("caching", [True, False])
def test_prefix_caching_on_and_off_match_transformers(engine_zoo, name, caching):
    shared = random_prompt(70, seed=99)
    prompts = [shared + random_prompt(length, seed=length) for length in (1, 9, 40)]
    engine = make_engine(engine_zoo, name, enable_prefix_caching=caching)
    first = first_samples(generate(engine, prompts[:1]))  # fills the cache with the prefix
    rest = first_samples(generate(engine, prompts[1:]))
    assert first + rest == expected(engine_zoo, name, prompts)
    hits = engine.stats.prefix_hit_tokens
    assert hits >= (2 * 64 if caching else 0) and (hits > 0) == caching


# Recompute runs each family's prefill again; swap copies blocks whatever the family, so it runs
# beside a KV layout of each kind: one KV head (llama3), head_dim 32 (mistral), q/k/v biases
# with a window on one layer (qwen2). (Every family swaps in the batch-invariance tests.)
@pytest.mark.parametrize(
    ("mode", "name"),
    [
        *(("recompute", name) for name in FAMILIES),
        *(("swap", name) for name in ("llama3", "mistral", "qwen2")),
    ],
)
def test_preemption_under_a_tiny_pool_matches_transformers(engine_zoo, name, mode):
    # Sixteen short prompts that each grow to 3-4 blocks, in a pool of 8 blocks: admitted
    # while they fit, they outgrow the pool as they decode, again and again.
    # (Seeds chosen so that no greedy step is a near-tie: `hf_greedy` checks.)
    prompts = [random_prompt(length, seed=length + 1) for length in range(3, 19)]
    engine = make_engine(engine_zoo, name, num_gpu_blocks=8, preemption_mode=mode)
    params = SamplingParams(temperature=0.0, max_tokens=LONG_OUTPUT)
    got = first_samples(generate(engine, prompts, params))
    assert got == [engine_zoo.hf_greedy(name, tuple(p), LONG_OUTPUT) for p in prompts]
    stats = engine.stats
    preemptions = stats.num_swap_preemptions if mode == "swap" else stats.num_recompute_preemptions
    other = stats.num_recompute_preemptions if mode == "swap" else stats.num_swap_preemptions
    assert preemptions >= 8 and other == 0


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2"])
def test_chunked_prefill_under_a_tiny_budget_matches_transformers(engine_zoo, name):
    engine = make_engine(engine_zoo, name, max_num_batched_tokens=16, max_num_seqs=4)
    assert first_samples(generate(engine, PROMPTS)) == expected(engine_zoo, name, PROMPTS)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_every_sample_of_n_4_at_temperature_0_is_the_greedy_output(engine_zoo, name):
    engine = make_engine(engine_zoo, name)
    params = SamplingParams(n=4, temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    outputs = generate(engine, PROMPTS[:4], params)
    for index, want in enumerate(expected(engine_zoo, name, PROMPTS[:4])):
        assert outputs[str(index)] == [want] * 4
