"""Prompts that arrive together share their common prefix from the first step (vLLM V1's rule).

The scheduler publishes the full blocks a step's chunks will compute before it admits more
prompts (`KVCacheManager.mark_scheduled`), so a prompt admitted later in the same step hits
them; the forward pass writes every sequence's K/V of a layer before that layer's attention
reads. Oracles: the block arithmetic of the shared prefix (hit tokens, blocks held), and the
same requests on an engine without a prefix cache, whose tokens and logprobs must be equal bit
for bit. A step that fails takes back what it shared: the next prompts are answered as a fresh
engine answers them.
"""

from __future__ import annotations

import pytest

from pagedkv.engine import SamplingParams
from pagedkv.engine.errors import StepFailed
from tests.engine.conftest import interrupt_the_second_admission, make_engine, run_to_completion
from tests.model.tiny_models import TINY_MODELS, random_prompt

BLOCK = 16
SYSTEM = random_prompt(3 * BLOCK + 5, seed=40)  # 3 full blocks, then 5 tokens of a 4th
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
# One request samples twice (forks of its prompt), seeded: its draws are its own either way.
SAMPLED = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=10, ignore_eos=True, logprobs=2)
NUM_REQUESTS = 4


def burst() -> list[tuple[str, list[int]]]:
    """Requests with the system prompt and a question of their own, added before any step."""
    return [(f"r{i}", SYSTEM + random_prompt(7 + i, seed=50 + i)) for i in range(NUM_REQUESTS)]


def add(engine, requests) -> None:
    for request_id, prompt in requests:
        engine.add_request(request_id, prompt, SAMPLED if request_id[:2] == "r2" else GREEDY)


def answers(engine, requests) -> tuple[dict[tuple[str, int], tuple], dict[str, int]]:
    """Each sample's (token ids, logprobs) run to the end, and each request's cached prompt
    tokens."""
    add(engine, requests)
    samples: dict[tuple[str, int], tuple[list, list]] = {}
    cached: dict[str, int] = {}
    for deltas in run_to_completion(engine):
        for delta in deltas:
            for output in delta.outputs:
                tokens, logprobs = samples.setdefault((delta.request_id, output.index), ([], []))
                tokens.extend(output.token_ids)
                logprobs.extend(output.logprobs or [])
            if delta.finished:
                cached[delta.request_id] = delta.num_cached_tokens
    return samples, cached


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("family", sorted(TINY_MODELS))
def test_a_burst_shares_its_system_prompt_in_the_first_step(engine_zoo, family, kv_cache_dtype):
    engine = make_engine(engine_zoo, family, kv_cache_dtype=kv_cache_dtype)
    add(engine, burst())
    engine.step()  # all four prompts, whole, in one step
    # The first computes the 3 full system blocks; the other three hit them in that step.
    assert engine.manager.stats.prefix_hit_tokens == (NUM_REQUESTS - 1) * 3 * BLOCK
    own_blocks = [-(-len(prompt) // BLOCK) for _, prompt in burst()]
    held = engine.manager.num_gpu_blocks - engine.manager.num_free_blocks
    assert held == sum(own_blocks) - (NUM_REQUESTS - 1) * 3
    engine.manager.check_invariants()
    for _ in run_to_completion(engine):
        pass

    shared, cached = answers(
        make_engine(engine_zoo, family, kv_cache_dtype=kv_cache_dtype), burst()
    )
    alone, _ = answers(
        make_engine(engine_zoo, family, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False),
        burst(),
    )
    assert shared == alone
    assert len(shared) == NUM_REQUESTS + 1
    assert cached == {"r0": 0, **{f"r{i}": 3 * BLOCK for i in range(1, NUM_REQUESTS)}}


def fail_the_first_step(engine, monkeypatch) -> None:
    real_execute = engine.runner.execute
    failed: list[bool] = []

    def execute(output):
        if not failed:
            failed.append(True)
            raise RuntimeError("device lost")
        return real_execute(output)

    monkeypatch.setattr(engine.runner, "execute", execute)


def test_a_failed_step_takes_back_the_blocks_it_shared(engine_zoo, monkeypatch):
    """The burst's step fails before its forward pass: all four are aborted, and the blocks
    published for it hold no KV, so the same prompts again compute them (no hit) and answer
    as a fresh engine does."""
    engine = make_engine(engine_zoo, "llama")
    fail_the_first_step(engine, monkeypatch)
    add(engine, burst())
    with pytest.raises(StepFailed, match="aborted 4 request"):
        engine.step()
    engine.manager.check_invariants()
    assert not any(map(engine.manager.is_cached, range(engine.manager.num_gpu_blocks)))
    engine.step()  # reports the aborts
    again = [(f"{rid}+", prompt) for rid, prompt in burst()]
    got, cached = answers(engine, again)
    expected, _ = answers(make_engine(engine_zoo, "llama"), again)
    assert got == expected
    assert cached["r0+"] == 0


def test_scheduling_that_fails_part_way_takes_back_what_it_shared(engine_zoo, monkeypatch):
    """Ctrl-C while the burst's second prompt is admitted, after the first published its
    blocks: those blocks never get their KV, so they leave the cache with the first request
    (aborted), and the same prompts again answer as a fresh engine does."""
    engine = make_engine(engine_zoo, "llama")
    interrupt_the_second_admission(engine, monkeypatch)
    add(engine, burst())
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert not any(map(engine.manager.is_cached, range(engine.manager.num_gpu_blocks)))
    for request_id, _ in burst():  # what LLM.generate does with its requests on Ctrl-C
        engine.abort(request_id)
    for _ in run_to_completion(engine):
        pass
    assert engine.manager.num_free_blocks == engine.manager.num_gpu_blocks
    again = [(f"{rid}+", prompt) for rid, prompt in burst()]
    got, _ = answers(engine, again)
    expected, _ = answers(make_engine(engine_zoo, "llama"), again)
    assert got == expected


@pytest.mark.parametrize("quantization", ["none", "int8"])  # int8: the one-call C layers
def test_a_block_a_decode_completes_is_shared_in_that_step(engine_zoo, quantization):
    """A conversation's next turn arrives as its answer's first token fills a block: the
    decode that writes that token is scheduled first, so the new prompt hits the block."""
    settings = dict(quantization=quantization)
    first = random_prompt(2 * BLOCK - 1, seed=60)
    engine = make_engine(engine_zoo, "llama", **settings)
    engine.add_request("turn-1", first, GREEDY)
    [delta] = engine.step()  # the prompt, and the first answer token
    turn_2 = first + delta.outputs[0].token_ids + random_prompt(5, seed=61)
    engine.add_request("turn-2", turn_2, GREEDY)
    # turn-1's decode completes block 2; turn-2, admitted after it, samples its first token.
    [first_token] = [d.outputs[0] for d in engine.step() if d.request_id == "turn-2"]
    assert engine.manager.stats.prefix_hit_tokens == 2 * BLOCK
    got, _ = answers(engine, [])
    alone, _ = answers(
        make_engine(engine_zoo, "llama", enable_prefix_caching=False, **settings),
        [("turn-2", turn_2)],
    )
    tokens, logprobs = got[("turn-2", 0)]
    assert (first_token.token_ids + tokens, first_token.logprobs + logprobs) == alone[("turn-2", 0)]
