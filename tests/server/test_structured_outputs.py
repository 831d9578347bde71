"""Structured outputs and tool calls through the official `openai` client, on a tiny random
model: whatever the model would say, every output must parse and validate (`jsonschema`,
`re.fullmatch`, pydantic), streamed and not."""

from __future__ import annotations

import json
import math
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import RunningServer, all_blocks_free, wait_until
from tests.structured_schemas import SCHEMAS

MESSAGES = [{"role": "user", "content": "Answer in JSON."}]
MAX_TOKENS = 256  # far above any of the schemas: each output ends by its grammar
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city for some days.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def server(serve) -> RunningServer:
    return serve(num_gpu_blocks=512, seed=0)


def chat_texts(client, model: str, stream: bool, **kwargs: Any) -> list[tuple[str, str]]:
    """(text, finish_reason) of each choice, collected from the stream when `stream`;
    `kwargs` add to (or replace) the request's messages and max_tokens."""
    args = {"model": model, "messages": MESSAGES, "max_tokens": MAX_TOKENS, **kwargs}
    if not stream:
        response = client.chat.completions.create(**args)
        return [(c.message.content, c.finish_reason) for c in response.choices]
    texts: dict[int, list[str]] = {}
    reasons: dict[int, str] = {}
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            texts.setdefault(choice.index, []).append(choice.delta.content or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return [("".join(texts[i]), reasons[i]) for i in sorted(texts)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_every_schema_validates_for_every_choice(client, model_name, stream):
    def ask(index: int) -> list[tuple[str, str]]:
        schema = SCHEMAS[index]
        response_format = {
            "type": "json_schema",
            "json_schema": {"name": f"s{index}", "schema": schema},
        }
        return chat_texts(
            client, model_name, stream, n=3, seed=index, response_format=response_format
        )

    with ThreadPoolExecutor(8) as pool:
        assert_every_choice_validates(list(pool.map(ask, range(len(SCHEMAS)))))


def assert_every_choice_validates(results: list[list[tuple[str, str]]]) -> None:
    """Each schema's 3 choices (`results[i]` for `SCHEMAS[i]`) ended by the grammar and valid."""
    for schema, choices in zip(SCHEMAS, results, strict=True):
        assert len(choices) == 3
        for text, finish_reason in choices:
            assert finish_reason == "stop", (schema, text)
            jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_vllm_structured_outputs_regex_and_choice(client, model_name, stream):
    regex = r"[A-Z][a-z]{1,6} [0-9]{2}"
    choices = ["left", "right", "straight on"]
    texts = chat_texts(
        client, model_name, stream, n=3, extra_body={"structured_outputs": {"regex": regex}}
    )
    assert all(re.fullmatch(regex, text) for text, _ in texts)
    texts = chat_texts(
        client, model_name, stream, n=3, extra_body={"structured_outputs": {"choice": choices}}
    )
    assert all(text in choices for text, _ in texts)
    completion = client.completions.create(
        model=model_name,
        prompt="Pick one:",
        max_tokens=MAX_TOKENS,
        n=3,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    assert all(re.fullmatch(regex, c.text) for c in completion.choices)


def test_completions_take_response_format(client, model_name):
    schema = SCHEMAS[10]
    completion = client.completions.create(
        model=model_name,
        prompt="JSON:",
        max_tokens=MAX_TOKENS,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
    )
    jsonschema.validate(json.loads(completion.choices[0].text), schema)


def test_json_object_gives_an_object_or_is_cut_by_length(client, model_name):
    response = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_tokens=96,
        n=3,
        response_format={"type": "json_object"},
    )
    for text, finish_reason in [(c.message.content, c.finish_reason) for c in response.choices]:
        if finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert finish_reason == "length" and text.startswith("{")


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=130)
    tags: list[Annotated[str, Field(max_length=6)]] = Field(max_length=2)


def test_the_openai_clients_parse_with_a_pydantic_model(client, model_name):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    completion = parse(
        model=model_name, messages=MESSAGES, max_tokens=900, response_format=Person, seed=3
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, Person)
    assert Person.model_validate_json(message.content) == message.parsed


def tool_call_args(message_or_calls) -> list[tuple[str, dict]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in message_or_calls]


def streamed_tool_calls(client, **kwargs) -> tuple[list[tuple[str, dict]], str, str]:
    """The stream's tool calls put together from their deltas, its content and finish reason."""
    calls: dict[int, dict[str, Any]] = {}
    content, finish_reason = "", None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish_reason = chunk.choices[0].finish_reason or finish_reason
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"name": "", "arguments": "", "id": None})
            call["id"] = call["id"] or part.id
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
    assert all(call["id"] for call in calls.values())
    parsed = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    return parsed, content, finish_reason


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_a_required_tool_call_parses_into_the_declared_arguments(client, model_name, tool_choice):
    args = dict(
        model=model_name,
        messages=MESSAGES,  # no max_tokens: the room the context leaves past the tool list
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        seed=1,
    )
    response = client.chat.completions.create(**args, n=2)
    streamed, content, finish_reason = streamed_tool_calls(client, **args)
    # OpenAI's and vLLM's: "tool_calls" when the model chose to call, "stop" for a named one
    expected = "stop" if isinstance(tool_choice, dict) else "tool_calls"
    assert content == "" and finish_reason == expected
    for choice in response.choices:
        assert choice.finish_reason == expected and choice.message.content is None
        calls = tool_call_args(choice.message.tool_calls)
        for calls_of_one in (calls, streamed):
            assert calls_of_one
            for name, arguments in calls_of_one:
                if isinstance(tool_choice, dict):
                    assert name == "get_time"
                jsonschema.validate(arguments, PARAMETERS[name])


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_echo_leads_the_content_and_leaves_the_calls_whole(client, model_name, tool_choice):
    """vLLM's `echo` puts the last (assistant) message before the content; the calls are read
    from the output alone, so they parse as they would without it."""
    messages = [*MESSAGES, {"role": "assistant", "content": "Sure: "}]
    args = dict(
        model=model_name,
        messages=messages,
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        seed=3,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    plain = client.chat.completions.create(**args).choices[0]
    args["extra_body"] = {**args["extra_body"], "echo": True}
    echoed = client.chat.completions.create(**args).choices[0]
    assert echoed.message.content == "Sure: " and plain.message.content is None
    assert tool_call_args(echoed.message.tool_calls) == tool_call_args(plain.message.tool_calls)
    assert echoed.finish_reason == plain.finish_reason


def test_special_tokens_are_kept_in_outputs_read_for_tool_calls(client, model_name):
    """As vLLM's tool parsers ask: some checkpoints make `<tool_call>` a special token, so an
    output read for calls keeps special tokens (here the tokenizer's BOS, `<s>`, made likely
    by a logit bias); with tool_choice "none" they are skipped as usual."""
    args = dict(
        model=model_name,
        messages=MESSAGES,
        max_tokens=2,
        tools=[WEATHER],
        logit_bias={"1": 100},
        extra_body={"ignore_eos": True},
    )
    read = client.chat.completions.create(**args, tool_choice="auto").choices[0]
    skipped = client.chat.completions.create(**args, tool_choice="none").choices[0]
    assert read.message.content == "<s><s>" and skipped.message.content == ""


def test_parallel_tool_calls_false_makes_one_call(client, model_name):
    response = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,  # no max_tokens: the room the context leaves past the tool list
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        n=3,
        seed=2,
    )
    assert all(len(choice.message.tool_calls) == 1 for choice in response.choices)


def test_a_conversation_with_tool_results_renders_and_answers(client, model_name):
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]
    response = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=4, tools=[WEATHER], tool_choice="none"
    )
    assert response.choices[0].finish_reason in ("stop", "length")
    assert response.choices[0].message.tool_calls in (None, [])


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "nope"}},
                }
            },
            None,
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, None),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        (
            {"structured_outputs": {"json_object": True, "whitespace_pattern": "[ ]*"}},
            "structured_outputs",
        ),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, None),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
    ],
)
def test_bad_constraints_are_400s_and_leave_nothing(server, client, model_name, body, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=model_name, messages=MESSAGES, max_tokens=4, extra_body=body
        )
    if param is not None:
        assert raised.value.param == param
    wait_until(lambda: all_blocks_free(server))
    assert server.app.state.engine_loop.engine.stats.num_waiting == 0


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "tag"}}],
    ids=["required", "named"],
)
def test_a_tool_schema_the_output_cannot_follow_is_named_as_the_tools(server, tool_choice):
    """A keyword llguidance cannot hold outputs to, in a tool's parameters: the 400 names the
    tools and the keyword, not a structured output the client never sent."""
    parameters = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    body = {
        "messages": MESSAGES,
        "max_tokens": 4,
        "tools": [{"type": "function", "function": {"name": "tag", "parameters": parameters}}],
        "tool_choice": tool_choice,
    }
    error = server.post("/v1/chat/completions", body).json()["error"]
    assert error["param"] == "tool_choice" and "uniqueItems" in error["message"]
    assert error["message"].startswith("the tools' parameters cannot hold a call")


def test_logprobs_under_a_constraint_are_json_numbers(client, model_name):
    """Tokens the grammar forbids have logprob -inf, which JSON cannot carry: they come back
    as vLLM's -9999.0, and the allowed ones renormalised over what the grammar allows."""
    response = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_tokens=8,
        logprobs=True,
        top_logprobs=20,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    choice = response.choices[0]
    assert choice.message.content in ("yes", "no")
    for entry in choice.logprobs.content:
        values = [top.logprob for top in entry.top_logprobs]
        assert -9999.0 in values and min(values) == -9999.0
        assert sum(math.exp(v) for v in values if v > -9999.0) == pytest.approx(1.0, abs=1e-4)
