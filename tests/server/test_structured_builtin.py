"""Structured outputs on the built-in model (SmolLM2-135M-Instruct, pulled from the package
index), through the official `openai` client: the 20 schemas with n=3 (half streamed, half
whole, all in flight at once), and a required tool call. Oracle: `jsonschema`."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from pagedkv.hub import DEFAULT_MODEL
from tests.server.conftest import start_server
from tests.server.test_structured_outputs import (
    PARAMETERS,
    WEATHER,
    assert_every_choice_validates,
    chat_texts,
    streamed_tool_calls,
)
from tests.structured_schemas import SCHEMAS

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "Give me an example as JSON."}]


@pytest.fixture(scope="module")
def builtin(builtin_gguf):
    server = start_server(DEFAULT_MODEL, num_gpu_blocks=512)  # type: ignore[arg-type]
    with server.client() as client:
        yield client, client.models.list().data[0].id
    server.stop()


def test_every_schema_validates_on_the_builtin_model(builtin):
    client, model = builtin

    def ask(index: int) -> list[tuple[str, str]]:
        response_format = {"type": "json_schema", "json_schema": {"schema": SCHEMAS[index]}}
        return chat_texts(
            client,
            model,
            index % 2 == 1,  # half streamed
            messages=MESSAGES,
            max_tokens=160,
            n=3,
            temperature=0.8,
            seed=index,
            response_format=response_format,
        )

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        assert_every_choice_validates(list(pool.map(ask, range(len(SCHEMAS)))))


def test_a_required_tool_call_on_the_builtin_model(builtin):
    """A required call (one, `parallel_tool_calls` false) completes and parses against its
    schema whatever the model prefers: the schema bounds the output (a city of at most 10
    characters, days 1-7, no free whitespace) well inside max_tokens. The streamed request,
    served from the prefix cache the first one filled, gives the very same call and finish
    reason: greedy decoding gives one answer per request (README, "One request, one answer")."""
    client, model = builtin
    messages = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
    args = dict(
        model=model,
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
    )
    response = client.chat.completions.create(**args)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS["get_weather"])
    streamed, content, finish_reason = streamed_tool_calls(client, **args)
    assert (streamed, content or None, finish_reason) == (
        [(call.function.name, json.loads(call.function.arguments))],
        choice.message.content,
        choice.finish_reason,
    )
