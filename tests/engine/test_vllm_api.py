"""The shapes of vLLM's outputs and request lifecycle, read the way vLLM users read them.

Oracles: vLLM's documented API (`CompletionOutput.finished()` is a method,
`RequestOutput.num_cached_tokens`, `RequestOutput.prompt` of `chat()` is the rendered text),
the tokenizer's own chat rendering, and the prefix cache's arithmetic (whole blocks only).
"""

from __future__ import annotations

import pytest

from pagedkv.engine import SamplingParams
from tests.engine.conftest import make_engine, make_llm, run_to_completion
from tests.model.tiny_models import random_prompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def llm(engine_zoo):
    return make_llm(engine_zoo, "llama", block_size=BLOCK_SIZE)


def test_completion_finished_is_a_method_as_in_vllm(llm):
    [output] = llm.generate("Paged attention", GREEDY, use_tqdm=False)
    assert output.outputs[0].finished() is True


def test_chat_output_prompt_is_the_rendered_conversation(llm):
    messages = [{"role": "user", "content": "Hello world!"}]
    [output] = llm.chat(messages, GREEDY, use_tqdm=False)
    rendered = llm.get_tokenizer().apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert output.prompt == rendered
    assert output.prompt_token_ids == llm.get_tokenizer().encode(rendered, False)


def test_num_cached_tokens_counts_whole_cached_blocks(llm):
    prompt = random_prompt(2 * BLOCK_SIZE + 5, seed=3)
    [first] = llm.generate([prompt], GREEDY, use_tqdm=False)
    [second] = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 2 * BLOCK_SIZE  # full blocks of the prompt only


def test_a_request_id_reused_after_abort_is_the_new_request(engine_zoo):
    engine = make_engine(engine_zoo, "llama")
    engine.add_request("r", random_prompt(8, seed=1), GREEDY)
    engine.step()
    engine.abort("r")
    engine.add_request("r", random_prompt(8, seed=2), GREEDY)
    deltas = [d for ds in run_to_completion(engine) for d in ds if d.request_id == "r"]
    reasons = [o.finish_reason for d in deltas for o in d.outputs if o.finish_reason]
    assert reasons == ["length"]
    tokens = [t for d in deltas for o in d.outputs for t in o.token_ids]
    assert len(tokens) == GREEDY.max_tokens


def test_the_tokenizer_is_used_as_a_transformers_one(llm):
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Hello world!"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    [output] = llm.generate(
        {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)},
        GREEDY,
        use_tqdm=False,
    )
    [chat] = llm.chat(messages, GREEDY, use_tqdm=False)
    assert output.outputs[0].token_ids == chat.outputs[0].token_ids
    assert tokenizer.eos_token_id == 2
    assert tokenizer.decode(tokenizer.encode("Hi"), skip_special_tokens=False) == "<s>Hi"


CUSTOM = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{{ tail }}"


def test_chat_takes_a_template_its_kwargs_and_continues_a_final_message(llm):
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Paged"}]
    [custom] = llm.chat(
        messages, GREEDY, use_tqdm=False, chat_template=CUSTOM, chat_template_kwargs={"tail": ">"}
    )
    assert custom.prompt == "user: Hello\nassistant: Paged\n>"
    [continued] = llm.chat(
        messages,
        GREEDY,
        use_tqdm=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert continued.prompt == "<s><|user|>\nHello</s>\n<|assistant|>\nPaged"
    assert continued.prompt == tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        llm.chat(messages, GREEDY, use_tqdm=False, continue_final_message=True)
