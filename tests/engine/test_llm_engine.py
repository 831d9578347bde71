"""LLMEngine: vLLM's `LLMEngine` loop runs as it does there.

The oracle is `LLM.generate` on the same model and parameters: vLLM's example loop (add
requests, step until none is unfinished, keep each output once finished) must end with the
same whole outputs, because vLLM's outputs are CUMULATIVE unless a request says otherwise.
"""

from __future__ import annotations

import time

import pytest

from pagedkv import LLMEngine
from pagedkv.engine import EngineArgs, RequestOutputKind, SamplingParams, TokensPrompt
from tests.engine.conftest import make_llm
from tests.model.tiny_models import random_prompt

PARAMS = [
    SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1, max_tokens=12),
    SamplingParams(n=2, temperature=0.8, top_p=0.9, seed=4, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
]


def summary(output) -> list[tuple]:
    """What a caller reads of a whole output: per sample its ids, text, logprob entries and
    cumulative logprob, and the prompt logprobs."""
    samples = [
        (
            list(o.token_ids),
            o.text,
            None if o.logprobs is None else [dict(entry) for entry in o.logprobs],
            o.cumulative_logprob,
            o.finish_reason,
        )
        for o in output.outputs
    ]
    return [samples, output.prompt_logprobs]


@pytest.fixture(scope="module")
def engine(engine_zoo) -> LLMEngine:
    args = EngineArgs(model=str(engine_zoo.folder("llama")), num_gpu_blocks=128)
    return LLMEngine.from_engine_args(args)


def test_vllms_example_loop_ends_with_what_generate_returns(engine, engine_zoo) -> None:
    prompts = [random_prompt(12 + 5 * i, seed=i) for i in range(len(PARAMS))]
    for index, (prompt, params) in enumerate(zip(prompts, PARAMS, strict=True)):
        added = engine.add_request(str(index), TokensPrompt(prompt_token_ids=prompt), params)
        assert added == str(index)  # the id, as vLLM's newer add_request returns it
    finished, seen = {}, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            ids = [list(o.token_ids) for o in output.outputs]
            # Each report is the whole output so far: it extends the one before.
            before = seen.get(output.request_id, [[] for _ in ids])
            assert all(now[: len(old)] == old for now, old in zip(ids, before, strict=False))
            seen[output.request_id] = ids
            if output.finished:
                finished[output.request_id] = output
    expected = make_llm(engine_zoo, "llama").generate(prompts, PARAMS, use_tqdm=False)
    for index, whole in enumerate(expected):
        assert summary(finished[str(index)]) == summary(whole)
    assert engine.get_num_unfinished_requests() == 0


def test_prompt_forms_salts_and_tokenization_kwargs(engine) -> None:
    tokenizer = engine.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=2)
    engine.add_request("text", {"prompt": "Paged attention"}, params)
    engine.add_request(
        "bare", "Paged attention", params, tokenization_kwargs={"add_special_tokens": False}
    )
    engine.add_request("salted", {"prompt_token_ids": [5, 6, 7], "cache_salt": "a"}, params)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs |= {o.request_id: o for o in engine.step() if o.finished}
    assert outputs["text"].prompt_token_ids == tokenizer.encode("Paged attention")
    assert outputs["bare"].prompt_token_ids == tokenizer.encode("Paged attention", False)
    assert outputs["bare"].prompt == outputs["text"].prompt == "Paged attention"
    assert engine._requests == {}  # every request ended
    for prompt in ("x", [5, 6]):  # checked whatever the prompt's form
        with pytest.raises(ValueError, match="tokenization_kwargs takes add_special_tokens"):
            engine.add_request("bad", prompt, params, tokenization_kwargs={"truncation": True})


def test_arrival_time_is_vllms_wall_clock_and_aborts_take_a_list(engine) -> None:
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    before = time.monotonic()
    ten_seconds_ago = time.time() - 10.0
    engine.add_request("early", [5, 6, 7], params, ten_seconds_ago)
    after = time.monotonic()
    engine.add_request("other", [5, 6, 8], params)
    engine.step()
    assert engine.get_num_unfinished_requests() == 2
    engine.abort_request(["early", "other"])
    assert engine.get_num_unfinished_requests() == 2  # until a step reports the aborts
    reports = {o.request_id: o for o in engine.step()}
    assert not engine.has_unfinished_requests()
    assert {o.finish_reason for r in reports.values() for o in r.outputs} == {"abort"}
    # The wall-clock time, on the engine's monotonic clock: 10 s before the call (1 ms spare
    # for the two clocks' readings).
    arrival = reports["early"].metrics.arrival_time
    assert before - 10.001 <= arrival <= after - 9.999


def test_a_request_that_asks_for_deltas_gets_deltas(engine) -> None:
    params = SamplingParams(max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    engine.add_request("d", [5, 6, 7], params)
    pieces = []
    while engine.has_unfinished_requests():
        pieces += [len(o.outputs[0].token_ids) for o in engine.step()]
    assert sum(pieces) == 6 and max(pieces) == 1


def test_engine_add_request_names_where_prompt_dicts_go(engine_zoo) -> None:
    from tests.engine.conftest import make_engine

    with pytest.raises(TypeError, match="LLMEngine's and LLM's forms"):
        make_engine(engine_zoo, "llama").add_request("a", {"prompt": "Hi"})


def test_a_tokens_prompt_reports_its_text_and_bad_arguments_are_named(engine, engine_zoo) -> None:
    """vLLM's TokensPrompt may carry the text its ids stand for: outputs report it, through
    LLMEngine and LLM alike; a request id that is no string, or params that are no
    SamplingParams, are TypeErrors naming them."""
    prompt = {"prompt_token_ids": random_prompt(6, seed=9), "prompt": "the text"}
    engine.add_request("texted", prompt, SamplingParams(max_tokens=2))
    reported = set()
    while engine.has_unfinished_requests():
        reported |= {output.prompt for output in engine.step()}
    assert reported == {"the text"}
    with pytest.raises(TypeError, match="request_id must be a string"):
        engine.add_request(7, "hi", SamplingParams(max_tokens=1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="params must be SamplingParams"):
        engine.add_request("p", "hi", "greedy")  # type: ignore[arg-type]
    llm = make_llm(engine_zoo, "llama")
    [one, two] = llm.generate([prompt, "words"], SamplingParams(max_tokens=1), use_tqdm=False)
    assert (one.prompt, two.prompt) == ("the text", "words")
