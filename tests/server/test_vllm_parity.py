"""Where a client written against vLLM's server would notice a difference, checked the way vLLM's
own server tests check it: the openai client against a running server.

Each test names vLLM's (and OpenAI's) behaviour it holds the server to; the oracles are
transformers' tokenizer, the JSON schema a tool declares, and arithmetic on the requests sent.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch
import transformers

from pagedkv.engine import BeamSearchParams
from pagedkv.server import ServerConfig
from tests.engine.test_beam_search import MIN_MARGIN, reference_beam_search, without_eos
from tests.model.tiny_models import random_prompt
from tests.server.conftest import RunningServer, one_prompt_body
from tests.server.test_metrics import scrape

PROMPT = "Paged attention stores keys and values in fixed-size blocks."
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(serve) -> RunningServer:
    return serve(ServerConfig(trust_request_chat_template=True), num_gpu_blocks=256, seed=0)


# 1. Wrong answers to fields the server accepts


@pytest.mark.parametrize("echo", [False, True])
def test_completion_logprobs_always_include_the_sampled_token(
    client, model_name: str, echo: bool
) -> None:
    """`logprobs=k` gives k or k+1 entries per position, the sampled token's among them: for
    k = 0 exactly it; with echo, the prompt's tokens likewise (its first, which nothing
    predicts, None)."""
    for k in (0, 2):
        choice = client.completions.create(
            model=model_name, prompt=PROMPT, max_tokens=4, logprobs=k, echo=echo,
            temperature=0.0, extra_body=IGNORE_EOS,
        ).choices[0]  # fmt: skip
        logprobs = choice.logprobs
        positions = list(
            zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True)
        )
        if echo:
            assert positions[0][1] is None and positions[0][2] is None
            positions = positions[1:]
        assert len(positions) >= 4
        for token, token_logprob, top in positions:
            # k or k + 1 texts; fewer where alternatives decode alike (a dict keyed by text)
            assert 1 <= len(top) <= k + 1 and top[token] == token_logprob


def test_echo_of_token_ids_decodes_them_with_their_special_tokens(
    client, model_name: str, hf_tokenizer
) -> None:
    """As vLLM: the echoed text of a token-id prompt is `tokenizer.decode(ids)`, special tokens
    included, and the generated tokens' offsets start after it."""
    ids = [1, 5, 2, 2, 17, 40, 0, 0]  # <s>, text, </s> twice, text, <unk> twice
    expected = hf_tokenizer.decode(ids)
    assert "<s>" in expected and "</s>" in expected
    choice = client.completions.create(
        model=model_name, prompt=ids, max_tokens=3, echo=True, logprobs=1, temperature=0.0,
        extra_body=IGNORE_EOS,
    ).choices[0]  # fmt: skip
    assert choice.text.startswith(expected)
    offsets = choice.logprobs.text_offset
    assert offsets[len(ids)] == len(expected)
    streamed = client.completions.create(
        model=model_name, prompt=ids, max_tokens=3, echo=True, stream=True,
        temperature=0.0, extra_body=IGNORE_EOS,
    )  # fmt: skip
    assert "".join(chunk.choices[0].text for chunk in streamed) == choice.text


@pytest.mark.parametrize(
    ("prompt", "extra"),
    [
        (PROMPT, {"skip_special_tokens": False}),  # the BOS the tokenizer adds is not in it
        ("</s> " + PROMPT + " <s>", {}),  # special tokens typed in the text are
        ("</s> " + PROMPT, {"skip_special_tokens": False}),
        (PROMPT, {"truncate_prompt_tokens": 5}),  # cut: the echo is the prompt that ran
        ([1, 5, 2, 17, 40, 9, 11], {"truncate_prompt_tokens": 4}),
    ],
    ids=["bos", "typed-specials", "typed-specials-shown", "cut-text", "cut-ids"],
)
def test_echo_with_logprobs_puts_each_token_where_the_text_holds_it(
    server: RunningServer, hf_tokenizer, prompt, extra
) -> None:
    """Every echoed prompt token's logprob entry is the text at its offset
    (`text[offset:][:len(token)]`), and the echo is the prompt that ran: the text as given,
    or once cut, its ids decoded as vLLM decodes a token-id prompt (special tokens too),
    streamed or not. (Generated tokens are left out: a sample that ends inside a character
    keeps its last bytes out of the text, as vLLM's, while their entries name them.)"""
    body = {"prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0.0}
    body |= {"return_token_ids": True, **IGNORE_EOS, **extra}
    [choice] = server.post("/v1/completions", body).json()["choices"]
    ran = choice["prompt_token_ids"]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ran) + 3
    prompt_entries = zip(logprobs["tokens"], logprobs["text_offset"][: len(ran)], strict=False)
    for token, offset in prompt_entries:
        assert choice["text"][offset : offset + len(token)] == token
    if "truncate_prompt_tokens" in extra:
        given = prompt if isinstance(prompt, list) else hf_tokenizer(prompt)["input_ids"]
        assert ran == given[-extra["truncate_prompt_tokens"] :]
        assert choice["text"].startswith(hf_tokenizer.decode(ran))
    else:
        assert choice["text"].startswith(prompt)
    with server.http() as http:
        events = [
            json.loads(line.removeprefix("data: "))
            for line in http.post("/v1/completions", json=body | {"stream": True}).iter_lines()
            if line.startswith("data: {")
        ]
    assert "".join(event["choices"][0]["text"] for event in events) == choice["text"]


@pytest.mark.parametrize("seed", [2**63, 2**64 - 1, -(2**63) - 1])
def test_a_seed_outside_int64_is_refused(server: RunningServer, seed: int) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        response = server.post(path, {**body, "max_tokens": 1, "seed": seed})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "seed"


def test_the_largest_int64_seeds_are_accepted(server: RunningServer) -> None:
    for seed in (2**63 - 1, -(2**63)):
        response = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "seed": seed})
        assert response.status_code == 200, response.text


def test_an_empty_model_name_is_the_served_model(client, model_name: str) -> None:
    reply = client.completions.create(model="", prompt="Hi", max_tokens=2)
    assert reply.model == model_name
    chat = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert chat.model == model_name


DEFS_TOOL = {
    "type": "function",
    "function": {
        "name": "book",
        "description": "Book a room",
        "parameters": {
            "type": "object",
            "properties": {"guest": {"$ref": "#/$defs/person"}, "nights": {"type": "integer"}},
            "required": ["guest", "nights"],
            "$defs": {
                "person": {
                    "type": "object",
                    "properties": {"name": {"type": "string", "maxLength": 12}},
                    "required": ["name"],
                }
            },
        },
    },
}
PLAIN_TOOL = {
    "type": "function",
    "function": {
        "name": "ping",
        "parameters": {"type": "object", "properties": {"host": {"$ref": "#/$defs/host"}},
                       "required": ["host"],
                       "$defs": {"host": {"type": "string", "maxLength": 8}}},
    },
}  # fmt: skip


def test_required_tool_choice_resolves_each_tools_own_definitions(client, model_name: str) -> None:
    """tool_choice "required" over tools whose parameters use `$defs`/`$ref` (each its own)
    makes a call whose arguments validate against that tool's schema."""
    reply = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Book a room for Ann."}],
        tools=[DEFS_TOOL, PLAIN_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0.0,
    )
    [call] = reply.choices[0].message.tool_calls
    tool = {t["function"]["name"]: t for t in (DEFS_TOOL, PLAIN_TOOL)}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_tool_calls_are_left_out_of_an_answer_without_any(server: RunningServer) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    message = server.post("/v1/chat/completions", body).json()["choices"][0]["message"]
    assert "tool_calls" not in message
    with_tools = server.post("/v1/chat/completions", {**body, "tools": [PLAIN_TOOL],
                                                      "tool_choice": "none"})  # fmt: skip
    assert "tool_calls" not in with_tools.json()["choices"][0]["message"]


def total(samples: dict, name: str) -> float:
    return sum(value for (n, _), value in samples.items() if n == name)


def test_metrics_count_what_vllm_counts(serve) -> None:
    """10 requests of 9 prompt tokens and 10 output tokens: 190 iteration tokens (each step's
    prompt tokens plus the tokens it sampled, the first one at prefill included), and the
    request parameter and inference time histograms vLLM keeps."""
    metrics_server = serve(ServerConfig(metrics_prefix="vllm"), num_gpu_blocks=128)
    before = scrape(metrics_server)
    with metrics_server.client() as client:
        model = client.models.list().data[0].id
        for index in range(10):
            client.completions.create(
                model=model, prompt=[3 + index] * 9, max_tokens=10, n=1 + index % 2,
                extra_body=IGNORE_EOS,
            )  # fmt: skip
    after = scrape(metrics_server)

    def delta(name: str) -> float:
        return total(after, name) - total(before, name)

    outputs = sum(10 * (1 + index % 2) for index in range(10))
    assert delta("vllm:iteration_tokens_total_sum") == 10 * 9 + outputs
    assert delta("vllm:request_params_n_count") == 10
    assert delta("vllm:request_params_n_sum") == sum(1 + index % 2 for index in range(10))
    assert delta("vllm:request_params_max_tokens_count") == 10
    assert delta("vllm:request_params_max_tokens_sum") == 100
    assert delta("vllm:request_inference_time_seconds_count") == 10
    inference = delta("vllm:request_inference_time_seconds_sum")
    assert 0 < inference <= delta("vllm:e2e_request_latency_seconds_sum")


# 2. Fields that change the output are never ignored


GUIDED = [
    ("guided_regex", r"(yes|no), [a-z]{3,8}\.", None),
    ("guided_choice", ["paged", "blocks", "swap"], None),
    (
        "guided_json",
        {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
        None,
    ),  # fmt: skip
    ("guided_grammar", 'start: "ab" | "cd" ("e")*', None),
]


@pytest.mark.parametrize(("name", "value", "_"), GUIDED)
def test_vllms_older_guided_fields_constrain_the_output(
    client, model_name: str, name: str, value, _
) -> None:
    """`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`: each output follows
    its constraint, in completions and chat."""
    import re

    for text in (
        client.completions.create(
            model=model_name, prompt="Answer:", max_tokens=40, extra_body={name: value}
        ).choices[0].text,
        client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "Answer"}], max_tokens=40,
            extra_body={name: value},
        ).choices[0].message.content,
    ):  # fmt: skip
        if name == "guided_regex":
            assert re.fullmatch(value, text), text
        elif name == "guided_choice":
            assert text in value
        elif name == "guided_json":
            jsonschema.validate(json.loads(text), value)
        else:
            assert re.fullmatch(r"ab|cde*", text), text


def test_two_constraints_at_once_are_refused(server: RunningServer) -> None:
    body = {"prompt": "Hi", "guided_regex": "a+", "guided_choice": ["a"]}
    response = server.post("/v1/completions", body)
    assert response.status_code == 400 and "not several" in response.json()["error"]["message"]


def test_return_token_ids_gives_the_prompts_and_the_outputs_ids(
    client, model_name: str, hf_tokenizer
) -> None:
    """vLLM's `return_token_ids`: the prompt's ids (transformers' tokenizer's) and the
    output's, whose text is the completion; streamed, the prompt's come first, once."""
    expected_prompt = hf_tokenizer(PROMPT)["input_ids"]
    args = dict(model=model_name, prompt=PROMPT, max_tokens=6, temperature=0.0,
                extra_body={"return_token_ids": True, **IGNORE_EOS})  # fmt: skip
    choice = client.completions.create(**args).choices[0]
    assert choice.prompt_token_ids == expected_prompt
    assert len(choice.token_ids) == 6
    text = hf_tokenizer.decode(choice.token_ids, skip_special_tokens=True)
    assert text.rstrip("\ufffd") == choice.text  # less a last character left incomplete
    chunks = list(client.completions.create(**args, stream=True))
    # Fields vLLM sends only where they are set (the openai client keeps them as extras).
    prompts = [
        ids for c in chunks if (ids := getattr(c.choices[0], "prompt_token_ids", None)) is not None
    ]
    assert prompts == [expected_prompt]
    assert [t for c in chunks for t in c.choices[0].token_ids] == choice.token_ids
    chat = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
        temperature=0.0, extra_body={"return_token_ids": True, **IGNORE_EOS},
    )  # fmt: skip
    rendered = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.prompt_token_ids == hf_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert len(chat.choices[0].token_ids) == 5
    plain = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2)
    assert "token_ids" not in plain.choices[0].model_dump(exclude_unset=True)


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client, model_name: str) -> None:
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True, **IGNORE_EOS}
    choice = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=5, logprobs=2, temperature=0.0,
        extra_body=extra,
    ).choices[0]  # fmt: skip
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.token_ids]
    assert all(key.startswith("token_id:") for top in choice.logprobs.top_logprobs for key in top)
    chat = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        logprobs=True, top_logprobs=2, temperature=0.0, extra_body=extra,
    ).choices[0]  # fmt: skip
    assert [e.token for e in chat.logprobs.content] == [f"token_id:{t}" for t in chat.token_ids]


def test_continuous_usage_stats_put_the_usage_in_every_chunk(client, model_name: str) -> None:
    chunks = list(
        client.completions.create(
            model=model_name, prompt=PROMPT, max_tokens=6, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body=IGNORE_EOS,
        )
    )  # fmt: skip
    assert all(chunk.usage is not None for chunk in chunks)
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    assert counts == sorted(counts) and counts[-1] == 6
    echoed = list(
        client.completions.create(
            model=model_name, prompt=PROMPT, max_tokens=2, stream=True, echo=True, n=2,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body=IGNORE_EOS,
        )
    )  # fmt: skip
    assert all(chunk.usage is not None for chunk in echoed)
    opening = [chunk for chunk in echoed if chunk.choices and chunk.choices[0].text == PROMPT]
    assert len(opening) == 2 and all(chunk.usage.completion_tokens == 0 for chunk in opening)


def test_continuous_usage_stats_count_each_choice_and_need_include_usage(
    client, model_name: str, hf_tokenizer
) -> None:
    """vLLM's: a chunk's usage is its own choice's (its prompt, its tokens so far), and only
    with include_usage; the last chunk has the request's totals."""
    prompts = [PROMPT, "A longer second prompt about paged memory"]
    args = dict(
        model=model_name, prompt=prompts, n=2, max_tokens=5, temperature=0.8, seed=3,
        stream=True, extra_body={"return_token_ids": True, **IGNORE_EOS},
    )  # fmt: skip
    lengths = [len(hf_tokenizer(p)["input_ids"]) for p in prompts]
    chunks = list(
        client.completions.create(
            **args, stream_options={"include_usage": True, "continuous_usage_stats": True}
        )
    )
    seen = {index: 0 for index in range(4)}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        seen[choice.index] += len(choice.token_ids)
        assert chunk.usage.prompt_tokens == lengths[choice.index // 2]
        assert chunk.usage.completion_tokens == seen[choice.index]
    assert seen == {index: 5 for index in range(4)}
    assert chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == sum(lengths)
    alone = client.completions.create(**args, stream_options={"continuous_usage_stats": True})
    assert all(chunk.usage is None for chunk in alone)
    chat = list(
        client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=3,
            stream=True, extra_body=IGNORE_EOS,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )  # fmt: skip
    assert all(chunk.usage is not None for chunk in chat)
    opening = [chunk for chunk in chat if chunk.choices and chunk.choices[0].delta.role]
    assert len(opening) == 2 and all(chunk.usage.completion_tokens == 0 for chunk in opening)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(
    client, model_name: str, hf_tokenizer
) -> None:
    """The answer to a prompt cut to its last 5 tokens is the answer to those 5 tokens."""
    ids = hf_tokenizer(PROMPT)["input_ids"]
    args = dict(model=model_name, max_tokens=6, temperature=0.0, extra_body=IGNORE_EOS)
    cut = client.completions.create(
        prompt=PROMPT, **{**args, "extra_body": {"truncate_prompt_tokens": 5, **IGNORE_EOS}}
    )
    assert cut.usage.prompt_tokens == 5
    assert cut.choices[0].text == client.completions.create(prompt=ids[-5:], **args).choices[0].text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_truncate_prompt_tokens_past_max_model_len_is_a_400(server: RunningServer, path) -> None:
    """As vLLM: a 400 naming the field and the model's length, never a 500."""
    too_many = server.app.state.engine_loop.engine.max_model_len + 1
    body = one_prompt_body(path, max_tokens=2, truncate_prompt_tokens=too_many)
    response = server.post(path, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "truncate_prompt_tokens" and "max_model_len" in error["message"]


def test_chat_template_switches_render_as_transformers_renders(
    client, model_name: str, hf_tokenizer
) -> None:
    """`add_generation_prompt`, `continue_final_message` (with `echo`: the continued message
    comes back whole), `chat_template` and `chat_template_kwargs`: the prompt's ids equal
    transformers' rendering of the same switches."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Paged"}]
    extra = {"return_token_ids": True, "add_generation_prompt": False,
             "continue_final_message": True, "echo": True, **IGNORE_EOS}  # fmt: skip
    reply = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=4, temperature=0.0, extra_body=extra
    )
    rendered = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert reply.prompt_token_ids == hf_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert reply.choices[0].message.content.startswith("Paged")
    template = "{{ greeting }}{% for m in messages %} {{ m['content'] }}{% endfor %}"
    custom = client.chat.completions.create(
        model=model_name, messages=messages[:1], max_tokens=2,
        extra_body={"chat_template": template, "chat_template_kwargs": {"greeting": "Hello"},
                    "return_token_ids": True},
    )  # fmt: skip
    assert (
        custom.prompt_token_ids == hf_tokenizer("Hello Hi", add_special_tokens=False)["input_ids"]
    )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=model_name, messages=messages, max_tokens=2,
            extra_body={"continue_final_message": True},  # with add_generation_prompt true
        )  # fmt: skip


@pytest.mark.parametrize(
    "extra",
    [{"chat_template": "{{ 1 / 0 }}"}, {"chat_template": "{{ messages + 1 }}"},
     {"chat_template_kwargs": {"messages": []}}],
)  # fmt: skip
def test_a_template_that_fails_is_a_400_and_the_connection_lives_on(
    server: RunningServer, extra
) -> None:
    """A template's own error (any Python error while it renders) is the request's fault: 400
    with OpenAI's error body, and the same connection serves the next request."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **extra}
    with server.http() as http:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert "chat template failed" in message or "may not set 'messages'" in message
        fine = {"messages": body["messages"], "max_tokens": 1}
        assert http.post("/v1/chat/completions", json=fine).status_code == 200


def test_version_is_served(server: RunningServer) -> None:
    from importlib.metadata import version

    with server.http() as http:
        assert http.get("/version").json() == {"version": version("pagedkv")}


@pytest.mark.parametrize(
    ("field", "value"),
    [("logits_processors", ["x"]), ("structural_tag", "{}"), ("early_stopping", True),
     ("spaces_between_special_tokens", False), ("guided_whitespace_pattern", " "),
     ("reasoning_effort", "low"), ("modalities", ["text", "audio"]), ("functions", [])],
)  # fmt: skip
def test_a_field_that_would_change_the_output_is_refused_by_name(
    server: RunningServer, field: str, value
) -> None:
    response = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1, field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_fields_that_cannot_change_the_output_are_accepted(server: RunningServer) -> None:
    """OpenAI's user, store, metadata, service_tier; vLLM's request_id, cache_salt, and the
    refused fields sent with the value that changes nothing."""
    body = {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "user": "u",
        "store": False, "metadata": {"a": "b"}, "service_tier": "auto", "request_id": "r1",
        "cache_salt": "s", "guided_decoding_backend": "xgrammar", "modalities": ["text"],
        "early_stopping": False, "spaces_between_special_tokens": True,
    }  # fmt: skip
    response = server.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text


# 3. Beam search


@pytest.fixture(scope="module")
def beam_reference(tiny_model):
    """vLLM's beam search rule (tests/engine/test_beam_search.py) over transformers' logits
    of the served model: prompt ids -> the best beams' output ids, a final EOS left out."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model, attn_implementation="eager", dtype=torch.float32
    ).eval()

    def next_logprobs(token_ids):
        with torch.no_grad():
            return hf(torch.tensor([list(token_ids)])).logits[0, -1].double().log_softmax(-1)

    def best(prompt: list[int], params: BeamSearchParams) -> list[list[int]]:
        beams, margin = reference_beam_search(next_logprobs, prompt, params)
        assert margin > MIN_MARGIN, f"case hinges on a near-tie ({margin:.2e})"
        return [without_eos(beam) for beam in beams]

    return best


BEAM_PROMPTS = [random_prompt(19, seed=19), random_prompt(40, seed=43)]


@pytest.mark.parametrize("stream", [False, True])
def test_use_beam_search_gives_the_best_beams_of_each_prompt(
    client, model_name: str, hf_tokenizer, beam_reference, stream: bool
) -> None:
    """vLLM's `use_beam_search`: n beams per prompt (choices prompt by prompt, best first),
    ranked with `length_penalty`; logprobs, token ids and streaming as for sampled choices."""
    params = BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=0.7)
    response = client.completions.create(
        model=model_name, prompt=BEAM_PROMPTS, n=3, max_tokens=10, logprobs=1, stream=stream,
        extra_body={"use_beam_search": True, "length_penalty": 0.7, "return_token_ids": True},
    )  # fmt: skip
    texts: dict[int, str] = {}
    token_ids: dict[int, list[int]] = {}
    tokens: dict[int, list[str]] = {}
    for chunk in response if stream else [response]:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            token_ids.setdefault(choice.index, []).extend(choice.token_ids or [])
            tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
    expected = [ids for prompt in BEAM_PROMPTS for ids in beam_reference(prompt, params)]
    assert [token_ids[index] for index in range(6)] == expected
    assert [texts[index] for index in range(6)] == [
        hf_tokenizer.decode(ids, skip_special_tokens=True) for ids in expected
    ]
    assert [len(tokens[index]) for index in range(6)] == [len(ids) for ids in expected]


@pytest.mark.parametrize(
    ("field", "value"),
    [("stop", ["a"]), ("presence_penalty", 0.5), ("best_of", 4), ("top_p", 0.5),
     ("guided_choice", ["a", "b"]), ("prompt_logprobs", 1)],
)  # fmt: skip
def test_beam_search_refuses_what_it_would_ignore(server: RunningServer, field: str, value) -> None:
    body = {"prompt": "Hi", "max_tokens": 2, "n": 2, "use_beam_search": True, field: value}
    response = server.post("/v1/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


@pytest.mark.parametrize("stream", [False, True])
def test_chat_beam_search_gives_the_best_beams_of_the_conversation(
    client, model_name: str, hf_tokenizer, beam_reference, stream: bool
) -> None:
    """vLLM's `use_beam_search` on chat: n beams of the rendered conversation, best first,
    as the reference beam search over transformers' logits ranks them."""
    messages = [{"role": "user", "content": "Paged attention stores keys"}]
    params = BeamSearchParams(beam_width=2, max_tokens=8, length_penalty=0.7)
    response = client.chat.completions.create(
        model=model_name, messages=messages, n=2, max_tokens=8, stream=stream,
        extra_body={"use_beam_search": True, "length_penalty": 0.7, "return_token_ids": True},
    )  # fmt: skip
    texts: dict[int, str] = {}
    token_ids: dict[int, list[int]] = {}
    for chunk in response if stream else [response]:
        for choice in chunk.choices:
            content = choice.delta.content if stream else choice.message.content
            texts[choice.index] = texts.get(choice.index, "") + (content or "")
            # A stream's opening chunk (the role) carries no token ids.
            token_ids.setdefault(choice.index, []).extend(getattr(choice, "token_ids", None) or [])
    rendered = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    prompt = hf_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    expected = beam_reference(prompt, params)
    assert [token_ids[index] for index in range(2)] == expected
    assert [texts[index] for index in range(2)] == [
        hf_tokenizer.decode(ids, skip_special_tokens=True) for ids in expected
    ]


def test_chat_beam_search_refuses_a_required_tool_call(server: RunningServer) -> None:
    """A required tool call constrains the output, which beams ranked by logprobs would
    ignore: refused naming tool_choice, as completions name what they refuse."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "use_beam_search": True,
        "n": 2,
        "tools": [tool],
        "tool_choice": "required",
    }
    response = server.post("/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tool_choice"
