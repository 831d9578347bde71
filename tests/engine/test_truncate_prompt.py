"""`truncate_prompt_tokens` keeps the prompt's last k tokens, as vLLM's does.

The oracle: the same request given only those tokens, and transformers' greedy continuation
of them.
"""

from __future__ import annotations

import pytest

from pagedkv import SamplingParams
from pagedkv.engine import TruncationTooLong
from tests.engine.conftest import make_llm
from tests.model.tiny_models import random_prompt

PROMPT = random_prompt(60, seed=11)


def greedy(**extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, **extra)


def test_the_last_k_tokens_are_the_prompt(engine_zoo) -> None:
    llm = make_llm(engine_zoo, "llama")
    [truncated] = llm.generate([PROMPT], greedy(truncate_prompt_tokens=17))
    assert truncated.prompt_token_ids == PROMPT[-17:]
    [alone] = llm.generate([PROMPT[-17:]], greedy())
    assert truncated.outputs[0].token_ids == alone.outputs[0].token_ids
    expected = engine_zoo.hf_greedy("llama", tuple(PROMPT[-17:]), 6)
    assert list(truncated.outputs[0].token_ids) == expected


def test_minus_one_keeps_what_the_context_holds(engine_zoo) -> None:
    llm = make_llm(engine_zoo, "llama", max_model_len=32)
    [output] = llm.generate([PROMPT], greedy(truncate_prompt_tokens=-1))
    assert output.prompt_token_ids == PROMPT[-31:]
    assert output.outputs[0].finish_reason == "length"  # one token of room


@pytest.mark.parametrize("bad", [0, -2, True, 2.5, "3"])
def test_a_bad_value_names_the_parameter(bad) -> None:
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=bad)


def test_keeping_more_than_the_context_holds_is_refused_naming_both(engine_zoo) -> None:
    """As vLLM: a truncation past max_model_len could never run; keeping exactly
    max_model_len is allowed (and then refused as a prompt leaving no room only if it is
    that long)."""
    llm = make_llm(engine_zoo, "llama", max_model_len=32)
    refused = r"truncate_prompt_tokens is 33.*max_model_len \(32\)"
    with pytest.raises(TruncationTooLong, match=refused):
        llm.generate([PROMPT[:5]], greedy(truncate_prompt_tokens=33))
    [output] = llm.generate([PROMPT[:5]], greedy(truncate_prompt_tokens=32))
    assert output.prompt_token_ids == PROMPT[:5]
