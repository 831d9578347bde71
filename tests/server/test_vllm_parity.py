"""Where a client written against vLLM's server would notice a difference, checked the way vLLM's
own server tests check it: the openai client against a running server.

Each test names vLLM's (and OpenAI's) behaviour it holds the server to; the oracles are
transformers' tokenizer, the JSON schema a tool declares, and arithmetic on the requests sent.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import transformers
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.server import ServerConfig
from tests.server.conftest import RunningServer

PROMPT = "Paged attention stores keys and values in fixed-size blocks."
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(serve) -> RunningServer:
    return serve(num_gpu_blocks=256, seed=0)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model):
    return transformers.AutoTokenizer.from_pretrained(tiny_model)


def post(server: RunningServer, path: str, body: dict):
    with server.http() as http:
        return http.post(path, json=body)


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


@pytest.mark.parametrize("seed", [2**63, 2**64 - 1, -(2**63) - 1])
def test_a_seed_outside_int64_is_refused(server: RunningServer, seed: int) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        response = post(server, path, {**body, "max_tokens": 1, "seed": seed})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "seed"


def test_the_largest_int64_seeds_are_accepted(server: RunningServer) -> None:
    for seed in (2**63 - 1, -(2**63)):
        response = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "seed": seed})
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
    message = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert "tool_calls" not in message
    with_tools = post(server, "/v1/chat/completions", {**body, "tools": [PLAIN_TOOL],
                                                      "tool_choice": "none"})  # fmt: skip
    assert "tool_calls" not in with_tools.json()["choices"][0]["message"]


def scrape(server: RunningServer) -> dict[tuple[str, frozenset], float]:
    with server.http() as http:
        text = http.get("/metrics").text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


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
