"""`LLM.generate` reads prompts as vLLM does, and one call never keeps or takes another's work.

Prompts may be text, token ids, vLLM's `{"prompt": ...}` (TextPrompt) and
`{"prompt_token_ids": [...]}` (TokensPrompt) dicts, or lists of any of them; the oracle for a
dict is the same prompt given plainly. Anything else is a TypeError naming the prompt.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine import SamplingParams
from tests.engine.conftest import make_engine, make_llm
from tests.model.tiny_models import random_prompt

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
TEXT = "The capital of France is"
IDS = random_prompt(10, seed=8)


@pytest.fixture(scope="module")
def llm(engine_zoo):
    return make_llm(engine_zoo, "llama")


def answers(outputs) -> list[tuple[list[int], list[int]]]:
    return [(output.prompt_token_ids, output.outputs[0].token_ids) for output in outputs]


def test_a_tokens_prompt_dict_is_its_token_ids(llm):
    [output] = llm.generate({"prompt_token_ids": IDS}, GREEDY, use_tqdm=False)
    assert output.prompt_token_ids == IDS and output.prompt is None
    assert answers([output]) == answers(llm.generate([IDS], GREEDY, use_tqdm=False))


def test_a_text_prompt_dict_is_its_text(llm):
    [output] = llm.generate({"prompt": TEXT}, GREEDY, use_tqdm=False)
    assert output.prompt == TEXT
    assert output.prompt_token_ids == llm.get_tokenizer().encode(TEXT)
    assert answers([output]) == answers(llm.generate(TEXT, GREEDY, use_tqdm=False))


def test_lists_mix_every_prompt_form_in_order(llm):
    prompts = [{"prompt": TEXT}, IDS, {"prompt_token_ids": IDS[:4]}, TEXT]
    plain = [TEXT, IDS, IDS[:4], TEXT]
    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert answers(got) == answers(llm.generate(plain, GREEDY, use_tqdm=False))


@pytest.mark.parametrize(
    ("prompts", "named"),
    [
        pytest.param(None, "None is NoneType", id="none"),
        pytest.param(5, "5 is int", id="int"),
        pytest.param(2.5, "2.5 is float", id="float"),
        pytest.param(b"hello", "b'hello' is bytes", id="bytes"),
        pytest.param(torch.tensor([5, 6, 7]), "is Tensor", id="tensor"),
        pytest.param([TEXT, None], "None is NoneType", id="none-in-list"),
        pytest.param([[5, 6], 7.5], "7.5 is float", id="float-in-list"),
        pytest.param({"text": TEXT}, "{'text': ", id="dict-without-either-key"),
        pytest.param({"prompt": [5, 6]}, "{'prompt': [5, 6]} is dict", id="prompt-not-text"),
        pytest.param({"prompt_token_ids": 5}, "{'prompt_token_ids': 5}", id="ids-not-a-list"),
        pytest.param({"prompt_token_ids": "5 6"}, "'5 6'", id="ids-as-text"),
    ],
)
def test_anything_else_is_a_type_error_naming_the_prompt(llm, prompts, named):
    with pytest.raises(TypeError, match=named.replace("[", r"\[").replace("]", r"\]")):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()


class Interrupt:
    """Raises KeyboardInterrupt once, at the third engine step, inside or after the step."""

    def __init__(self, llm, inside: bool) -> None:
        self.llm = llm
        self.steps = 0
        self.inside = inside
        self.real_step = llm.engine.step
        self.real_execute = llm.engine.runner.execute
        llm.engine.step = self.step

    def step(self):
        self.steps += 1
        if self.steps != 3:
            return self.real_step()
        self.llm.engine.step = self.real_step
        if self.inside:  # mid-step, in the forward pass
            self.llm.engine.runner.execute = self.execute
            return self.real_step()
        self.real_step()
        raise KeyboardInterrupt

    def execute(self, output):
        self.llm.engine.runner.execute = self.real_execute
        raise KeyboardInterrupt


@pytest.mark.parametrize("inside", [True, False], ids=["in-the-forward", "between-steps"])
def test_ctrl_c_aborts_the_calls_requests_and_the_next_call_is_whole(llm, inside):
    prompts = [IDS, random_prompt(7, seed=9)]
    want = answers(llm.generate(prompts, GREEDY, use_tqdm=False))
    interrupt = Interrupt(llm, inside)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:  # unpatched even if no interrupt came, so later tests see a plain engine
        llm.engine.step = interrupt.real_step
        llm.engine.runner.execute = interrupt.real_execute
    assert not llm.engine.has_unfinished()
    manager = llm.engine.manager
    assert manager.num_free_blocks == manager.num_gpu_blocks
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(output.finished for output in again)
    assert answers(again) == want


def test_generate_counts_only_its_own_requests(llm):
    want = answers(llm.generate([IDS], GREEDY, use_tqdm=False))
    short = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.engine.add_request("someone-else", random_prompt(5, seed=1), short)
    got = llm.generate([IDS], GREEDY, use_tqdm=False)
    assert [output.request_id for output in got] != ["someone-else"]
    assert got[0].finished and answers(got) == want


def test_ctrl_c_in_a_step_aborts_that_steps_requests_in_the_engine(engine_zoo, monkeypatch):
    """Whoever drives the engine: an interrupted step leaves no half-updated request."""
    engine = make_engine(engine_zoo, "llama")
    engine.add_request("a", random_prompt(20, 1), GREEDY)
    engine.add_request("b", random_prompt(30, 2), GREEDY)
    engine.step()
    real_execute = engine.runner.execute

    def interrupted(output):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.runner, "execute", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    monkeypatch.setattr(engine.runner, "execute", real_execute)
    assert engine.manager.num_free_blocks == engine.manager.num_gpu_blocks
    reported = {d.request_id: d.outputs[0].finish_reason for d in engine.step() if d.finished}
    assert reported == {"a": "abort", "b": "abort"}
    assert not engine.has_unfinished()
