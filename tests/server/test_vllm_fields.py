"""What vLLM's clients send and expect: model lookup, stream shape, accepted fields, limits.

vLLM's OpenAI server is the reference: its clients pass fields such as `user`, `store` or
`echo`, rely on `finish_reason: null` in every chunk but the last, and get unknown fields
ignored (with a log line) unless the server is strict.
"""

from __future__ import annotations

import gzip
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pagedkv.server import ServerConfig
from tests.model.tiny_models import SPECIAL_TOKENS, train_tokenizer
from tests.server.conftest import RunningServer, one_prompt_body, start_server

PROMPT = "Paged attention stores keys and values in fixed-size blocks."
MESSAGES = [{"role": "user", "content": "Hi"}]
IGNORE_EOS = {"ignore_eos": True}
SHORT_CONTEXT = 48  # max_model_len of `short_context_server`
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's (and vLLM's) max_tokens when it is omitted


@pytest.fixture(scope="module")
def server(serve) -> RunningServer:
    return serve(num_gpu_blocks=256, seed=0)


@pytest.fixture(scope="module")
def short_context_server(serve) -> RunningServer:
    return serve(num_gpu_blocks=64, max_model_len=SHORT_CONTEXT)


@pytest.fixture(scope="module")
def strict_server(serve) -> RunningServer:
    return serve(ServerConfig(strict_fields=True), num_gpu_blocks=64)


@pytest.fixture(scope="module")
def small_queue_server(serve) -> RunningServer:
    return serve(ServerConfig(max_waiting=2), num_gpu_blocks=64, max_num_seqs=2)


def stream_events(server: RunningServer, path: str, body: dict) -> list[dict]:
    """Every JSON event of a server-sent stream, as sent (before any client parses it)."""
    with server.http() as http, http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


# 1. Models


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_an_unknown_model_is_404_model_not_found(client, endpoint: str) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        if endpoint == "completions":
            client.completions.create(model="gpt-4", prompt="Hi", max_tokens=1)
        else:
            client.chat.completions.create(model="gpt-4", messages=MESSAGES, max_tokens=1)
    assert raised.value.code == "model_not_found"
    assert "gpt-4" in raised.value.message


def test_models_retrieve_finds_the_served_model_and_404s_others(client, model_name: str) -> None:
    assert client.models.retrieve(model_name).id == model_name
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("gpt-4")
    assert raised.value.code == "model_not_found"


def test_models_with_a_trailing_slash_redirects_to_the_list(server: RunningServer) -> None:
    # vLLM serves only GET /v1/models: FastAPI answers "/v1/models/" with a 307 to it.
    with server.http() as http:
        response = http.get("/v1/models/")
        assert response.status_code == 307, response.text
        assert response.headers["location"].endswith("/v1/models")
        assert http.get(response.headers["location"]).json()["object"] == "list"


@pytest.mark.parametrize("path", ["/", "/health"])
def test_head_requests_are_answered(server: RunningServer, path: str) -> None:
    with server.http() as http:
        response = http.head(path)
    assert response.status_code == 200
    assert response.content == b""


# 2. Stream shape


def test_stream_options_without_stream_is_400(server: RunningServer) -> None:
    body = {"prompt": "Hi", "max_tokens": 1, "stream_options": {"include_usage": True}}
    response = server.post("/v1/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "stream_options"


def test_chat_chunks_carry_null_finish_reason_and_logprobs_until_the_end(
    server: RunningServer,
) -> None:
    body = {"messages": MESSAGES, "max_tokens": 4, "stream": True, **IGNORE_EOS}
    choices = [
        c for event in stream_events(server, "/v1/chat/completions", body) for c in event["choices"]
    ]
    assert len(choices) >= 2
    for choice in choices:
        assert "finish_reason" in choice and "logprobs" in choice
        assert choice["logprobs"] is None
    assert [c["finish_reason"] for c in choices[:-1]] == [None] * (len(choices) - 1)
    assert choices[-1]["finish_reason"] == "length"


def test_system_fingerprint_is_sent(client, model_name: str) -> None:
    chat = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=2)
    completion = client.completions.create(model=model_name, prompt="Hi", max_tokens=2)
    chunks = list(
        client.chat.completions.create(
            model=model_name, messages=MESSAGES, max_tokens=2, stream=True
        )
    )
    assert chat.system_fingerprint
    assert completion.system_fingerprint == chat.system_fingerprint
    assert all(chunk.system_fingerprint == chat.system_fingerprint for chunk in chunks)


# 3. Fields vLLM accepts


def test_chat_accepts_the_fields_vllm_clients_send(client, model_name: str) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "Again"},
    ]
    chat = client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=2,
        user="someone",
        store=False,
        parallel_tool_calls=False,
        response_format={"type": "text"},
    )
    assert chat.choices[0].finish_reason in ("length", "stop")


def test_an_unknown_response_format_is_refused(client, model_name: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=model_name,
            messages=MESSAGES,
            max_tokens=2,
            response_format={"type": "xml"},
        )
    assert raised.value.param == "response_format.type"


def test_echo_prepends_the_prompt(client, model_name: str) -> None:
    args = {"model": model_name, "prompt": PROMPT, "max_tokens": 5, "temperature": 0.0}
    plain = client.completions.create(**args, extra_body=IGNORE_EOS).choices[0].text
    echoed = client.completions.create(**args, echo=True, extra_body=IGNORE_EOS)
    streamed = client.completions.create(**args, echo=True, stream=True, extra_body=IGNORE_EOS)
    assert echoed.choices[0].text == PROMPT + plain
    assert "".join(chunk.choices[0].text for chunk in streamed) == PROMPT + plain


@pytest.mark.parametrize(
    "beams", [None, {"use_beam_search": True, "n": 2}], ids=["sampled", "beams"]
)
def test_completions_max_tokens_omitted_or_null_is_16_cut_to_the_room(
    short_context_server: RunningServer, beams: dict | None
) -> None:
    """vLLM's CompletionRequest: an omitted max_tokens is OpenAI's default of 16, and an
    explicit null is read as that default too (`normalize_null_max_tokens`); a prompt with
    less room than 16 gets what the context leaves."""
    body = {"return_token_ids": True, **IGNORE_EOS, **(beams or {})}
    for prompt_len, expected in [(10, DEFAULT_COMPLETION_MAX_TOKENS), (40, SHORT_CONTEXT - 40)]:
        for fields in [{}, {"max_tokens": None}]:
            request = {**body, "prompt": list(range(5, 5 + prompt_len)), **fields}
            response = short_context_server.post("/v1/completions", request)
            assert response.status_code == 200, response.text
            choices = response.json()["choices"]
            assert [len(c["token_ids"]) for c in choices] == [expected] * len(choices), fields


def choice_text(choice: dict) -> str:
    """A completions or chat choice's text."""
    return choice["text"] if "text" in choice else choice["message"]["content"]


def recommending(tiny_model, folder: Path, settings: dict, **engine_args) -> RunningServer:
    """A server of the tiny model with `settings` in its generation_config.json."""
    shutil.copytree(tiny_model, folder)
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **settings}))
    return start_server(folder, num_gpu_blocks=64, **engine_args)


@pytest.fixture(scope="module")
def recommending_server(tiny_model, tmp_path_factory) -> Iterator[RunningServer]:
    """The tiny model recommending top_k 1 (so greedy) and at most 3 new tokens."""
    folder = tmp_path_factory.mktemp("recommending") / "model"
    server = recommending(tiny_model, folder, {"top_k": 1, "max_new_tokens": 3})
    yield server
    server.stop()


def test_a_recommended_max_tokens_past_the_context_is_cut_to_the_room(tiny_model, tmp_path) -> None:
    """Only the client's own max_tokens is refused when the context cannot hold it; the
    model's recommended one is a cap, cut to the room as vLLM's get_max_tokens takes the
    least (a chat request without max_tokens runs to the context's end)."""
    server = recommending(tiny_model, tmp_path / "model", {"max_new_tokens": 500}, max_model_len=64)
    try:
        body = {"messages": MESSAGES, **IGNORE_EOS}
        response = server.post("/v1/chat/completions", body)
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 64
        asked = server.post("/v1/chat/completions", {**body, "max_tokens": 500})
        assert asked.status_code == 400 and asked.json()["error"]["param"] == "max_tokens"
    finally:
        server.stop()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_models_generation_config_is_the_default_of_what_a_request_leaves_out(
    recommending_server: RunningServer, path: str
) -> None:
    """vLLM's server: a field the request leaves out takes the model's recommended value, and
    the recommended max_tokens caps any asked for (vLLM's get_max_tokens takes the least)."""
    unset = recommending_server.post(path, one_prompt_body(path, max_tokens=10, **IGNORE_EOS))
    greedy = one_prompt_body(path, max_tokens=3, temperature=0.0, **IGNORE_EOS)
    expected = recommending_server.post(path, greedy)
    assert unset.status_code == expected.status_code == 200, unset.text
    assert unset.json()["usage"]["completion_tokens"] == 3
    assert unset.json()["choices"] == expected.json()["choices"]
    # The model's top_k is not the request's: beam search, which refuses a top_k it is
    # given, takes this one (and the request's own -1, "off").
    for beams in [{}, {"top_k": -1}]:
        body = one_prompt_body(path, max_tokens=2, use_beam_search=True, n=2, **beams)
        assert recommending_server.post(path, body).status_code == 200, beams
    sampled = one_prompt_body(path, top_k=0, temperature=1.0, seed=3, n=8, **IGNORE_EOS)
    answers = [choice_text(c) for c in recommending_server.post(path, sampled).json()["choices"]]
    assert len(set(answers)) > 1  # the request's own top_k 0 samples: not all greedy


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_null_settings_are_their_defaults(server, model_name: str, path: str) -> None:
    """Clients send null for every setting a caller left as None (OpenAI's and vLLM's servers
    read it as the default): the answer equals the one without those fields."""
    base = one_prompt_body(path, model=model_name, max_tokens=4, seed=7)
    nulls = dict.fromkeys(
        ["temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty"]
        + ["repetition_penalty", "n", "stream", "return_token_ids", "stop", "logit_bias"]
        + (["echo"] if path == "/v1/completions" else ["logprobs", "top_logprobs"])
    )
    plain, with_nulls = server.post(path, base), server.post(path, {**base, **nulls})
    assert plain.status_code == with_nulls.status_code == 200, with_nulls.text
    answer = [choice_text(c) for c in plain.json()["choices"]]
    assert answer == [choice_text(c) for c in with_nulls.json()["choices"]]


def test_suffix_is_refused_as_unsupported(client, model_name: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=model_name, prompt="Hi", suffix="end", max_tokens=2)
    assert raised.value.param == "suffix"
    assert "not supported" in raised.value.message


def hf_tokens(tiny_model, prompt: str | None) -> list[int]:
    """The prompt's token ids by transformers' tokenizer; None: MESSAGES through the chat
    template (which places any BOS itself)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model)
    if prompt is not None:
        return tokenizer(prompt)["input_ids"]
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def hf_prompt_logprobs(tiny_model, token_ids: list[int]) -> list[float]:
    """transformers' logprob of each prompt token after the first, without a cache."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        logprobs = model(torch.tensor([token_ids])).logits[0].log_softmax(-1)
    return [logprobs[i - 1, token_ids[i]].item() for i in range(1, len(token_ids))]


def test_echo_with_logprobs_scores_the_prompt_tokens_first(
    client, server, model_name: str, tiny_model
) -> None:
    args = {"model": model_name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0}
    args |= {"echo": True, "logprobs": 2, "extra_body": IGNORE_EOS}
    whole = client.completions.create(**args).choices[0]
    streamed = list(client.completions.create(**args, stream=True))
    prompt_ids = hf_tokens(tiny_model, PROMPT)
    expected = hf_prompt_logprobs(tiny_model, prompt_ids)
    logprobs = whole.logprobs
    assert len(logprobs.tokens) == len(prompt_ids) + 4
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1 : len(prompt_ids)] == pytest.approx(expected, abs=1e-4)
    assert whole.text.startswith(PROMPT)
    # Offsets count characters of the returned text, the echoed prompt's included.
    offsets = logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert offsets[len(prompt_ids)] == len(PROMPT)
    assert "".join(chunk.choices[0].text for chunk in streamed) == whole.text
    streamed_tokens = [
        t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens
    ]
    assert streamed_tokens == logprobs.tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("n", [1, 2])
def test_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing(
    client, model_name: str, tiny_model, stream: bool, n: int
) -> None:
    """vLLM's echo without generation (how evaluation harnesses score a text): each choice is
    the prompt, its logprobs are the prompt's (transformers' values), no token is generated,
    and the choice ends on "length"."""
    args = {"model": model_name, "prompt": PROMPT, "max_tokens": 0, "echo": True, "n": n}
    args |= {"logprobs": 1, "temperature": 0.0, "extra_body": IGNORE_EOS}
    prompt_ids = hf_tokens(tiny_model, PROMPT)
    expected = hf_prompt_logprobs(tiny_model, prompt_ids)
    if stream:
        chunks = list(client.completions.create(**args, stream=True))
        by_choice = [[c.choices[0] for c in chunks if c.choices[0].index == i] for i in range(n)]
        texts = ["".join(part.text for part in parts) for parts in by_choice]
        logprobs = [
            [lp for part in parts if part.logprobs for lp in part.logprobs.token_logprobs]
            for parts in by_choice
        ]
        reasons = [
            [part.finish_reason for part in parts if part.finish_reason] for parts in by_choice
        ]
        assert reasons == [["length"]] * n
    else:
        response = client.completions.create(**args)
        texts = [choice.text for choice in response.choices]
        logprobs = [choice.logprobs.token_logprobs for choice in response.choices]
        assert [choice.finish_reason for choice in response.choices] == ["length"] * n
        assert response.usage.completion_tokens == 0
        assert response.usage.prompt_tokens == len(prompt_ids)
    assert texts == [PROMPT] * n
    for scores in logprobs:
        assert len(scores) == len(prompt_ids) and scores[0] is None
        assert scores[1:] == pytest.approx(expected, abs=1e-4)


def test_echo_only_without_logprobs_returns_the_prompt(client, model_name: str) -> None:
    args = {"model": model_name, "prompt": [PROMPT, "Hi"], "max_tokens": 0, "echo": True}
    response = client.completions.create(**args)
    assert [choice.text for choice in response.choices] == [PROMPT, "Hi"]
    assert all(choice.logprobs is None for choice in response.choices)


@pytest.mark.parametrize(
    ("fields", "param"),
    [({}, "max_tokens"), ({"echo": True, "min_tokens": 1}, "min_tokens")],
    ids=["without-echo", "min-tokens"],
)
def test_max_tokens_0_needs_echo_and_no_min_tokens(
    server, model_name: str, fields: dict, param: str
) -> None:
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 0, **fields}
    response = server.post("/v1/completions", body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_logprobs_minus_one_is_every_token(serve, tiny_model) -> None:
    """vLLM's -1 for logprobs, top_logprobs and prompt_logprobs: the whole vocabulary (with a
    server started with --max-logprobs -1, as vLLM needs too)."""
    unlimited = serve(num_gpu_blocks=64, max_logprobs=-1)
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]  # the logits'
    completion = unlimited.post(
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 1, "logprobs": -1, "prompt_logprobs": -1}
        | {"return_tokens_as_token_ids": True},  # distinct keys: many tokens share a text
    ).json()["choices"][0]
    assert len(completion["logprobs"]["top_logprobs"][0]) == vocab
    assert [len(p) for p in completion["prompt_logprobs"][1:3]] == [vocab, vocab]
    chat = unlimited.post(
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 1, "logprobs": True, "top_logprobs": -1},
    ).json()["choices"][0]
    assert len(chat["logprobs"]["content"][0]["top_logprobs"]) == vocab


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/completions", {"prompt": PROMPT, "logprobs": -1}, "logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": -1},
         "top_logprobs"),
    ],
)  # fmt: skip
def test_minus_one_beyond_max_logprobs_is_refused_as_asked(
    server, tiny_model, path: str, fields: dict, param: str
) -> None:
    """Under the default cap of 20, -1 is refused naming the -1 sent, the vocabulary it means
    and the start option that allows it (not "logprobs is <vocab>, raise max_logprobs")."""
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    response = server.post(path, {"max_tokens": 1, **fields})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param
    assert error["message"].startswith(f"{param}=-1 (every token: {vocab}), but the engine")
    assert "max_logprobs=-1 when starting" in error["message"]


def test_engine_refusals_name_the_field_the_client_sent(
    serve, short_context_server: RunningServer
) -> None:
    """best_of, not the n it became; chat's max_completion_tokens, not max_tokens."""
    two_seqs = serve(num_gpu_blocks=64, max_num_seqs=2)
    response = two_seqs.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "best_of": 3})
    assert response.status_code == 400 and response.json()["error"]["param"] == "best_of"
    body = {"messages": MESSAGES, "max_completion_tokens": 500}
    response = short_context_server.post("/v1/chat/completions", body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_completion_tokens"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_logprobs_cannot_stream(server, model_name: str, path: str) -> None:
    """As vLLM: a stream has no place for them, so the request is a 400 naming the field."""
    body = one_prompt_body(path, model=model_name, max_tokens=2, prompt_logprobs=1, stream=True)
    response = server.post(path, body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt_logprobs"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_prompt_logprobs_is_vllms_extra_field(
    server, model_name: str, tiny_model, endpoint
) -> None:
    body = {"model": model_name, "max_tokens": 2, "prompt_logprobs": 3}
    if endpoint == "completions":
        body["prompt"] = PROMPT
        response = server.post("/v1/completions", body).json()
        prompt_logprobs = response["choices"][0]["prompt_logprobs"]
        prompt_ids = hf_tokens(tiny_model, PROMPT)
    else:
        body["messages"] = MESSAGES
        response = server.post("/v1/chat/completions", body).json()
        prompt_logprobs = response["prompt_logprobs"]
        prompt_ids = hf_tokens(tiny_model, None)
    assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    expected = hf_prompt_logprobs(tiny_model, prompt_ids)
    for position, entry in enumerate(prompt_logprobs[1:], start=1):
        token = entry[str(prompt_ids[position])]
        assert token["logprob"] == pytest.approx(expected[position - 1], abs=1e-4)
        assert {1, 2, 3} <= {e["rank"] for e in entry.values()}  # the top 3, and the token
        assert len(entry) in (3, 4)


def test_best_of_equal_to_n_is_accepted(client, model_name: str) -> None:
    completion = client.completions.create(
        model=model_name, prompt="Hi", n=2, best_of=2, max_tokens=2
    )
    assert len(completion.choices) == 2


def test_best_of_below_n_is_400_naming_the_limit(client, model_name: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=model_name, prompt="Hi", n=2, best_of=1, max_tokens=2)
    assert raised.value.param == "best_of"
    assert "n (2)" in raised.value.message


def test_best_of_returns_the_n_samples_of_highest_cumulative_logprob(
    client, model_name: str
) -> None:
    args = {"model": model_name, "max_tokens": 6, "temperature": 1.0, "seed": 11}
    prompts = ["Hi", PROMPT]
    every = client.completions.create(**args, prompt=prompts, n=4, logprobs=0)
    best = client.completions.create(**args, prompt=prompts, n=2, best_of=4)
    for prompt_index in range(2):
        samples = every.choices[prompt_index * 4 : prompt_index * 4 + 4]
        ranked = sorted(samples, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
        chosen = best.choices[prompt_index * 2 : prompt_index * 2 + 2]
        assert [c.text for c in chosen] == [c.text for c in ranked[:2]]
        assert [c.index for c in chosen] == [prompt_index * 2, prompt_index * 2 + 1]
        assert all(c.logprobs is None for c in chosen)  # computed to rank, not asked for
    assert best.usage.completion_tokens == every.usage.completion_tokens  # all 4 are generated


def test_best_of_above_n_cannot_stream(client, model_name: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(
            model=model_name, prompt="Hi", best_of=2, max_tokens=2, stream=True
        )
    assert raised.value.param == "best_of"
    assert "stream" in raised.value.message


def test_unknown_fields_are_ignored_with_one_log_line(
    server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    body = {"messages": [{"role": "user", "content": "Hi", "frob": 1}], "max_tokens": 1}
    with caplog.at_level(logging.WARNING, logger="pagedkv.server"):
        response = server.post("/v1/chat/completions", {**body, "frobnicate": True})
    assert response.status_code == 200, response.text
    lines = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(lines) == 1
    assert "frobnicate" in lines[0] and "messages.0.frob" in lines[0]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "Hi", "frobnicate": 1}, "frobnicate"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi", "frob": 1}]},
            "messages.0.frob",
        ),
    ],
)
def test_strict_fields_refuses_unknown_fields(
    strict_server: RunningServer, path: str, body: dict, param: str
) -> None:
    response = strict_server.post(path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert param in error["message"]


# 4. A request larger than the waiting queue


def test_more_prompts_than_seats_and_waiting_room_is_400_not_503(
    small_queue_server: RunningServer,
) -> None:
    """Two seats (--max-num-seqs) and two waiting (--max-waiting): five prompts could never
    be queued at once; four can."""
    response = small_queue_server.post("/v1/completions", {"prompt": ["a", "b", "c", "d", "e"]})
    assert response.status_code == 400, response.text
    assert "--max-waiting" in response.json()["error"]["message"]
    four = small_queue_server.post("/v1/completions", {"prompt": ["a", "b", "c", "d"]})
    assert four.status_code == 200


# 5. Logprobs in real bytes and characters

NON_ASCII_SEED = 3  # a seed whose sample emits tokens holding only part of a character


def test_chat_logprob_bytes_are_the_tokens_own_bytes(client, model_name: str) -> None:
    chat = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_tokens=48,
        temperature=1.5,
        seed=NON_ASCII_SEED,
        logprobs=True,
        top_logprobs=3,
        extra_body=IGNORE_EOS,
    )
    entries = chat.choices[0].logprobs.content
    token_bytes = [bytes(entry.bytes) for entry in entries]
    assert any(b"\xef\xbf\xbd" not in b and _partial(b) for b in token_bytes)  # the hard case
    in_text = [bytes(entry.bytes) for entry in entries if entry.token not in SPECIAL_TOKENS]
    joined = b"".join(in_text).decode("utf-8", errors="replace")  # special tokens: not in text
    assert joined.rstrip("\ufffd") == chat.choices[0].message.content  # less a cut character
    for entry in entries:
        for alt in entry.top_logprobs:
            assert bytes(alt.bytes).decode("utf-8", errors="replace") == alt.token or _partial(
                bytes(alt.bytes)
            )


def test_completion_text_offset_counts_real_characters(client, model_name: str) -> None:
    completion = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=48,
        temperature=1.5,
        seed=NON_ASCII_SEED,
        logprobs=1,
        extra_body=IGNORE_EOS,
    )
    text = completion.choices[0].text
    logprobs = completion.choices[0].logprobs
    assert any("\ufffd" in token for token in logprobs.tokens)  # the hard case
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    for token, offset in zip(logprobs.tokens, logprobs.text_offset, strict=True):
        if "\ufffd" not in token and token not in SPECIAL_TOKENS:  # skipped in the text
            assert text[offset : offset + len(token)] == token


def _partial(token: bytes) -> bool:
    """True for bytes that are not valid UTF-8 on their own (part of a character)."""
    try:
        token.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_logit_bias_makes_its_token_the_greedy_choice(client, model_name):
    piece = train_tokenizer().decode([77])
    response = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0.0,
        logit_bias={"77": 100},
        logprobs=0,
        extra_body=IGNORE_EOS,
    )
    assert response.choices[0].logprobs.tokens == [piece] * 4


def test_allowed_token_ids_confine_every_sampled_token(client, model_name):
    pieces = {train_tokenizer().decode([token]) for token in (77, 78)}
    response = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=8,
        temperature=1.0,
        seed=3,
        logprobs=0,
        extra_body={"allowed_token_ids": [77, 78], **IGNORE_EOS},
    )
    assert set(response.choices[0].logprobs.tokens) <= pieces


def test_bad_logit_bias_is_a_400_naming_it(server):
    for bias in ({"abc": 1.0}, {"5": 101.0}, {"999999": 1.0}):
        response = server.post("/v1/completions", {"prompt": PROMPT, "logit_bias": bias})
        assert response.status_code == 400, bias
        assert "logit_bias" in response.json()["error"]["message"]


def test_profile_routes_trace_the_requests_between_when_a_profiler_is_set(
    serve, server: RunningServer, tmp_path: Path
) -> None:
    """vLLM's /start_profile and /stop_profile: served only with profiler_config; the trace
    they write holds the steps of the completion between them."""
    assert server.post("/start_profile", {}).status_code == 404
    config = {"profiler": "torch", "torch_profiler_dir": str(tmp_path)}
    profiled = serve(
        num_gpu_blocks=64, profiler_config={**config, "torch_profiler_with_stack": False}
    )
    assert profiled.post("/start_profile", {}).status_code == 200
    body = one_prompt_body("/v1/completions", max_tokens=3, **IGNORE_EOS)
    assert profiled.post("/v1/completions", body).status_code == 200
    assert profiled.post("/stop_profile", {}).status_code == 200
    [trace] = list(tmp_path.glob("pagedkv_*.pt.trace.json.gz"))
    with gzip.open(trace, "rt", encoding="utf-8") as file:
        names = [event.get("name") for event in json.load(file)["traceEvents"]]
    assert names.count("step") >= 3 and names.count("execute") == names.count("step")
    assert profiled.post("/start_profile", {}).status_code == 200
    assert profiled.post("/v1/completions", body).status_code == 200
    profiled.stop()  # still recording: the engine thread writes it as the server stops
    assert not profiled.thread.is_alive()
    assert len(list(tmp_path.glob("pagedkv_*.pt.trace.json.gz"))) == 2
