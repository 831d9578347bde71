"""The shapes of vLLM's outputs and request lifecycle, read the way vLLM users read them.

Oracles: vLLM's documented API (`CompletionOutput.finished()` is a method,
`RequestOutput.num_cached_tokens`, `RequestOutput.prompt` of `chat()` is the rendered text),
the tokenizer's own chat rendering, and the prefix cache's arithmetic (whole blocks only).
"""

from __future__ import annotations

import pytest

from pagedkv.engine import SamplingParams
from pagedkv.tokenizer import Tokenizer
from tests.engine.conftest import make_engine, make_llm, run_to_completion
from tests.model.tiny_models import copy_with_chat_template, random_prompt

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


def test_chat_content_reaches_the_template_in_vllms_content_format(llm):
    """vLLM's `chat_template_content_format`: "string" (and "auto", for a template that prints
    the content) render a list of text parts as their texts joined by newlines, the same
    prompt as that string; "auto" and "openai" hand a template that loops over the content
    the parts themselves."""
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    joined = [{"role": "user", "content": "a\nb"}]
    [expected] = llm.chat(joined, GREEDY, use_tqdm=False)
    for content_format in ("auto", "string"):
        [output] = llm.chat(
            parts, GREEDY, use_tqdm=False, chat_template_content_format=content_format
        )
        assert output.prompt == expected.prompt and "a\nb" in output.prompt
    looping = (
        "{% for m in messages %}{% for p in m['content'] %}<{{ p.text }}>{% endfor %}{% endfor %}"
    )
    for content_format in ("auto", "openai"):
        [output] = llm.chat(
            parts,
            GREEDY,
            use_tqdm=False,
            chat_template=looping,
            chat_template_content_format=content_format,
        )
        assert output.prompt == "<a><b>"
    with pytest.raises(ValueError, match="chat_template_content_format must be one of auto, s"):
        llm.chat(parts, GREEDY, use_tqdm=False, chat_template_content_format="parts")


def test_tokenization_kwargs_encode_text_prompts_as_told(llm):
    """vLLM's `tokenization_kwargs={"add_special_tokens": False}`: the text is encoded
    without BOS, as the same ids given directly; the output still reports the text."""
    tokenizer = llm.get_tokenizer()
    text = "Paged attention"
    bare = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.encode(text) == [1, *bare]
    [given_ids] = llm.generate([bare], GREEDY, use_tqdm=False)
    [told] = llm.generate(
        [text, bare], GREEDY, use_tqdm=False, tokenization_kwargs={"add_special_tokens": False}
    )[:1]
    assert told.prompt_token_ids == bare and told.prompt == text
    assert told.outputs[0].token_ids == given_ids.outputs[0].token_ids
    [default] = llm.generate(text, GREEDY, use_tqdm=False, tokenization_kwargs={})
    assert default.prompt_token_ids == [1, *bare]
    with pytest.raises(ValueError, match=r"add_special_tokens only, got \['truncation'\]"):
        llm.generate(text, GREEDY, tokenization_kwargs={"truncation": True})
    with pytest.raises(ValueError, match="add_special_tokens must be a bool, got 'false'"):
        llm.generate(text, GREEDY, tokenization_kwargs={"add_special_tokens": "false"})
    with pytest.raises(ValueError, match="add_special_tokens only"):  # checked for ids too
        llm.generate([bare], GREEDY, tokenization_kwargs={"truncation": True})


def test_chat_takes_tokenization_kwargs_as_vllms_does(llm):
    """vLLM's `LLM.chat(tokenization_kwargs=...)`: the rendered text is encoded without
    special tokens unless `add_special_tokens` is true, when the tokenizer's BOS leads it."""
    tokenizer = llm.get_tokenizer()
    conversation = [{"role": "user", "content": "Hi"}]
    [plain] = llm.chat(conversation, GREEDY, use_tqdm=False)
    [same] = llm.chat(conversation, GREEDY, use_tqdm=False, tokenization_kwargs={})
    [bos] = llm.chat(
        conversation, GREEDY, use_tqdm=False, tokenization_kwargs={"add_special_tokens": True}
    )
    assert plain.prompt_token_ids == same.prompt_token_ids
    assert plain.prompt_token_ids == tokenizer.encode(plain.prompt, add_special_tokens=False)
    assert bos.prompt_token_ids == tokenizer.encode(plain.prompt, add_special_tokens=True)
    assert bos.prompt_token_ids != plain.prompt_token_ids
    with pytest.raises(ValueError, match="add_special_tokens only"):
        llm.chat(conversation, GREEDY, tokenization_kwargs={"truncation": True})


def test_detokenize_false_gives_the_same_tokens_without_text(llm):
    """vLLM's `detokenize=False`: the same token ids and logprobs, no text, and logprob entries
    whose decoded_token is None (with text, each is its token decoded alone)."""
    fields = dict(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    [with_text] = llm.generate("Paged attention", SamplingParams(**fields), use_tqdm=False)
    [ids_only] = llm.generate(
        "Paged attention", SamplingParams(**fields, detokenize=False), use_tqdm=False
    )
    a, b = with_text.outputs[0], ids_only.outputs[0]
    assert b.token_ids == a.token_ids and b.text == "" and a.text
    tokenizer = llm.get_tokenizer()
    for with_entries, without_entries in (
        (a.logprobs, b.logprobs),
        (with_text.prompt_logprobs[1:], ids_only.prompt_logprobs[1:]),
    ):
        for with_entry, without_entry in zip(with_entries, without_entries, strict=True):
            assert with_entry.keys() == without_entry.keys()
            for token_id, entry in without_entry.items():
                assert entry.decoded_token is None
                assert entry.logprob == with_entry[token_id].logprob
                assert with_entry[token_id].decoded_token == tokenizer.decode([token_id], False)


def test_vllms_trust_remote_code_and_enforce_eager_change_nothing(engine_zoo, llm):
    """Accepted as vLLM's LLM takes them (its examples pass both); the output is the same."""
    prompt = random_prompt(12, seed=4)
    [expected] = llm.generate([prompt], GREEDY, use_tqdm=False)
    other = make_llm(engine_zoo, "llama", block_size=BLOCK_SIZE, trust_remote_code=True)
    eager = make_llm(engine_zoo, "llama", block_size=BLOCK_SIZE, enforce_eager=True)
    for each in (other, eager):
        [output] = each.generate([prompt], GREEDY, use_tqdm=False)
        assert output.outputs[0].token_ids == expected.outputs[0].token_ids
    with pytest.raises(ValueError, match="trust_remote_code must be a bool, got 'yes'"):
        make_llm(engine_zoo, "llama", trust_remote_code="yes")


def test_chat_tools_reach_the_template_as_its_tools_variable(llm):
    """vLLM's `LLM.chat(tools=...)`: the definitions render where the template puts them."""
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": {}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {}}},
    ]
    template = (
        "{% for tool in tools or [] %}[{{ tool.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    messages = [{"role": "user", "content": "Hello"}]
    [with_tools] = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=template, tools=tools)
    [without] = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=template)
    assert with_tools.prompt == "[get_weather][get_time]Hello"
    assert without.prompt == "Hello"


def test_priority_must_be_a_list_per_prompt(llm):
    with pytest.raises(TypeError, match="priority must be a list of ints, one per prompt"):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=5)


def test_a_tokenizer_of_its_own_folder_renders_and_encodes_for_the_model(engine_zoo, tmp_path):
    """vLLM's `tokenizer=`: the files of another folder (here the model's own tokenizer with
    another chat template) are what prompts are rendered and encoded with."""
    template = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"
    folder = copy_with_chat_template(engine_zoo.folder("llama"), tmp_path / "tokenizer", template)
    llm = make_llm(engine_zoo, "llama", tokenizer=str(folder))
    [output] = llm.chat([{"role": "user", "content": "Hello"}], GREEDY, use_tqdm=False)
    assert output.prompt == "<<Hello>>"
    assert output.prompt_token_ids == Tokenizer.from_folder(folder).encode("<<Hello>>", False)


def test_a_tokenizer_with_more_ids_than_the_model_is_refused(engine_zoo, builtin_gguf):
    with pytest.raises(ValueError, match="has 49152 ids, more than the model's vocabulary of 320"):
        make_llm(engine_zoo, "llama", tokenizer=str(builtin_gguf))
    with pytest.raises(ValueError, match="is not a model folder"):
        make_llm(engine_zoo, "llama", tokenizer="/nowhere/tokenizer")


def test_vllms_prompt_dicts_by_name_read_as_the_plain_forms(llm):
    from pagedkv import TextPrompt, TokensPrompt

    ids = random_prompt(9, seed=4)
    by_name = llm.generate(
        [TextPrompt(prompt="Paged attention"), TokensPrompt(prompt_token_ids=ids)],
        GREEDY,
        use_tqdm=False,
    )
    plain = llm.generate(["Paged attention", {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in by_name] == [o.outputs[0].token_ids for o in plain]
    image = {"prompt": "Describe <image>", "multi_modal_data": {"image": object()}}
    with pytest.raises(ValueError, match="multi_modal_data is not supported"):
        llm.generate([image], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_output_fields_are_in_vllms_order():
    """Code that builds outputs positionally (mocks, adapters) means what it means in vLLM:
    `vllm/outputs.py` orders CompletionOutput (index, text, token_ids, cumulative_logprob,
    logprobs, finish_reason, stop_reason, ...) and RequestOutput (request_id, prompt,
    prompt_token_ids, prompt_logprobs, outputs, finished, metrics, lora_request, ...)."""
    from dataclasses import fields

    from pagedkv import CompletionOutput, RequestOutput

    completion = [f.name for f in fields(CompletionOutput)]
    assert completion[:7] == [
        "index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason",
        "stop_reason",
    ]  # fmt: skip
    request = [f.name for f in fields(RequestOutput)]
    assert request[:8] == [
        "request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished",
        "metrics", "lora_request",
    ]  # fmt: skip


def test_generate_and_chat_take_vllms_positional_order():
    """vLLM's `LLM.generate(prompts, sampling_params, *, use_tqdm, lora_request, priority)`
    and `LLM.chat(messages, sampling_params, use_tqdm, lora_request, *, ...)`: positional
    calls written for vLLM pass each argument where it means the same."""
    import inspect

    from pagedkv import LLM

    def positional(method) -> list[str]:
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        parameters = inspect.signature(method).parameters.values()
        return [p.name for p in parameters if p.kind in kinds][1:]  # after self

    assert positional(LLM.generate) == ["prompts", "sampling_params"]
    assert positional(LLM.chat) == ["messages", "sampling_params", "use_tqdm", "lora_request"]


@pytest.mark.parametrize(
    ("path", "names"),
    [
        (
            "pagedkv.sampling_params",
            [
                "SamplingParams",
                "RequestOutputKind",
                "BeamSearchParams",
                "GuidedDecodingParams",
                "StructuredOutputsParams",
            ],
        ),
        ("pagedkv.outputs", ["RequestOutput", "CompletionOutput"]),
        ("pagedkv.inputs", ["TextPrompt", "TokensPrompt"]),
    ],
)
def test_vllms_import_paths_hold_the_engines_names(path, names):
    """`from vllm.sampling_params import StructuredOutputsParams` (vLLM's documented import),
    `from vllm.inputs import TokensPrompt` and `from vllm.outputs import RequestOutput` port by
    renaming the package: each path holds those of vLLM's names that pagedkv has, the very
    objects `pagedkv.engine` exports."""
    import importlib

    import pagedkv.engine

    module = importlib.import_module(path)
    for name in names:
        assert getattr(module, name) is getattr(pagedkv.engine, name), name
    assert sorted(module.__all__) == sorted(names)
