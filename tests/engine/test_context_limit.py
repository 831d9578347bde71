"""The context limit, as vLLM draws it: only a prompt of at least `max_model_len` tokens is
refused; a longer `max_tokens` is honoured up to the limit, where the output stops with
finish_reason "length". A request that could never fit the KV pool is still refused."""

from __future__ import annotations

import pytest

from pagedkv.engine import SamplingParams
from pagedkv.engine.errors import PromptTooLong, RequestTooLarge
from tests.engine.conftest import make_engine, run_to_completion
from tests.model.tiny_models import random_prompt

MAX_MODEL_LEN = 200


def run_alone(engine, prompt: list[int], params: SamplingParams) -> tuple[list[int], set[str]]:
    """Token ids and finish reasons of one request run to completion."""
    engine.add_request("r", prompt, params)
    tokens, reasons = [], set()
    for deltas in run_to_completion(engine):
        for delta in deltas:
            for output in delta.outputs:
                tokens += output.token_ids
                if output.finish_reason is not None:
                    reasons.add(output.finish_reason)
    return tokens, reasons


@pytest.mark.parametrize("max_tokens", [11, 20, 10**6])
def test_max_tokens_beyond_the_context_stops_at_the_limit(engine_zoo, max_tokens):
    engine = make_engine(engine_zoo, "llama", num_gpu_blocks=64, max_model_len=MAX_MODEL_LEN)
    prompt = random_prompt(190, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens, reasons = run_alone(engine, prompt, params)
    assert len(prompt) + len(tokens) == MAX_MODEL_LEN and reasons == {"length"}
    exact = SamplingParams(temperature=0.0, max_tokens=MAX_MODEL_LEN - 190, ignore_eos=True)
    assert run_alone(engine, prompt, exact) == (tokens, reasons)
    assert engine.manager.num_free_blocks == engine.manager.num_gpu_blocks


def test_a_prompt_that_fills_the_context_is_still_refused(engine_zoo):
    engine = make_engine(engine_zoo, "llama", num_gpu_blocks=64, max_model_len=MAX_MODEL_LEN)
    with pytest.raises(PromptTooLong, match="prompt has 200 tokens, model allows 200"):
        engine.add_request("r", random_prompt(200, seed=3), SamplingParams(max_tokens=1))


def test_a_request_the_pool_can_never_hold_is_still_refused(engine_zoo):
    engine = make_engine(
        engine_zoo, "llama", num_gpu_blocks=4, block_size=4, max_model_len=MAX_MODEL_LEN
    )
    params = SamplingParams(max_tokens=10**6)  # up to the context: 200 tokens, 50 blocks
    with pytest.raises(RequestTooLarge, match="request needs up to 50 KV blocks, .* has 4"):
        engine.add_request("r", random_prompt(10, seed=3), params)
