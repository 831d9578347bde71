"""OpenAI's Responses API (`/v1/responses`), driven by the `openai` client. The oracle for
every output is the same conversation sent to /v1/chat/completions at temperature 0 (a
response is a chat completion in another shape); the client's own stream accumulator checks
the events' shapes and order."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.conftest import RunningServer, fail_next_step

GREEDY = {"temperature": 0.0}
LONG = {"ignore_eos": True}  # a fixed length: random weights rarely sample EOS, but may
ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two numbers.",
    "parameters": {
        "type": "object",
        # bounded, so that every call ends by its schema whatever the random model prefers
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99},
            "b": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["a", "b"],
    },
}


@pytest.fixture(scope="module")
def server(serve) -> RunningServer:
    return serve(num_gpu_blocks=256, seed=0)


def chat_text(client, model: str, messages: list[dict], max_tokens: int, **extra) -> str:
    reply = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, **GREEDY,
        extra_body={**LONG, **extra},
    )  # fmt: skip
    return reply.choices[0].message.content, reply.usage


def test_a_response_is_the_chat_completion_of_its_input_and_instructions(client, model_name):
    response = client.responses.create(
        model=model_name, input="Hi there", instructions="Be brief.", max_output_tokens=6,
        **GREEDY, extra_body=LONG,
    )  # fmt: skip
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text, usage = chat_text(client, model_name, messages, 6)
    assert response.output_text == text
    assert response.id.startswith("resp_") and response.object == "response"
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    # cut by max_output_tokens: OpenAI's "incomplete"
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == usage.prompt_tokens
    assert response.usage.output_tokens == usage.completion_tokens == 6
    assert response.usage.total_tokens == usage.total_tokens
    assert (response.temperature, response.top_p, response.max_output_tokens) == (0.0, 1.0, 6)


def test_the_settings_that_ran_are_echoed(serve) -> None:
    """vLLM echoes what ran: a max_output_tokens left out is the room the context left, a
    temperature and top_p left out their defaults (the model's generation config, else 1)."""
    server = serve(num_gpu_blocks=64, max_model_len=48, seed=0)
    with server.client() as client:
        model = client.models.list().data[0].id
        response = client.responses.create(model=model, input="Hi", extra_body={"seed": 1})
    assert response.max_output_tokens == 48 - response.usage.input_tokens
    assert (response.temperature, response.top_p) == (1.0, 1.0)


def test_message_items_and_content_parts_are_the_chat_messages(client, model_name):
    items = [
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": "you"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Bonjour"}]},
        {"role": "user", "content": "Again"},
    ]  # fmt: skip
    response = client.responses.create(
        model=model_name, input=items, max_output_tokens=5, **GREEDY, extra_body=LONG
    )
    messages = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": [
            {"type": "text", "text": "Hello"}, {"type": "text", "text": "you"}]},
        {"role": "assistant", "content": "Bonjour"},
        {"role": "user", "content": "Again"},
    ]  # fmt: skip
    assert response.output_text == chat_text(client, model_name, messages, 5)[0]


def test_the_stream_accumulates_to_the_same_response(client, model_name):
    """The client's `responses.stream` accumulator rebuilds the response from the events; its
    text, and the deltas', equal the unstreamed response's; events are numbered from 0."""
    fields = dict(model=model_name, input="Tell me", max_output_tokens=7, **GREEDY)
    plain = client.responses.create(**fields, extra_body=LONG)
    with client.responses.stream(**fields, extra_body=LONG) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert final.status == "incomplete"  # cut by max_output_tokens, as vLLM ends any stream
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == plain.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens == 7


def test_previous_response_id_continues_the_stored_conversation(client, model_name):
    """The follow-up runs on the first turn's input and output; the first turn's
    instructions are not carried over (OpenAI's rule), the follow-up's own apply."""
    first = client.responses.create(
        model=model_name, input="Name a colour", instructions="Be brief.", max_output_tokens=4,
        **GREEDY, extra_body=LONG,
    )  # fmt: skip
    second = client.responses.create(
        model=model_name, input="Another", previous_response_id=first.id,
        instructions="Be kind.", max_output_tokens=4, **GREEDY, extra_body=LONG,
    )  # fmt: skip
    messages = [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Name a colour"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Another"},
    ]
    assert second.output_text == chat_text(client, model_name, messages, 4)[0]
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_stored_responses_can_be_deleted_and_unstored_or_unknown_ids_are_404(client, model_name):
    kept = client.responses.create(model=model_name, input="a", max_output_tokens=2)
    unkept = client.responses.create(model=model_name, input="a", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.create(
            model=model_name, input="b", max_output_tokens=2, previous_response_id=unkept.id
        )
    with pytest.raises(openai.BadRequestError, match="synchronous"):  # vLLM's answer
        client.responses.cancel(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel(unkept.id)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_a_named_function_call_and_its_output_round_trip(client, model_name):
    """A named tool choice forces a call, whose arguments validate against the tool's
    schema; sent back as `function_call` and `function_call_output` items, the conversation
    runs as chat's tool_calls and tool messages would."""
    called = client.responses.create(
        model=model_name, input="Add 2 and 3", tools=[ADD],
        tool_choice={"type": "function", "name": "add"}, **GREEDY,
    )  # fmt: skip
    [call] = [item for item in called.output if item.type == "function_call"]
    assert call.name == "add" and call.id.startswith("fc_") and call.call_id
    jsonschema.validate(json.loads(call.arguments), ADD["parameters"])
    follow_up = [
        {"role": "user", "content": "Add 2 and 3"},
        {"type": "function_call", "call_id": call.call_id, "name": "add",
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "5"},
    ]  # fmt: skip
    answer = client.responses.create(
        model=model_name, input=follow_up, tools=[ADD], tool_choice="none", max_output_tokens=5,
        **GREEDY, extra_body=LONG,
    )  # fmt: skip
    chat_tool = {"type": "function", "function": {k: v for k, v in ADD.items() if k != "type"}}
    messages = [
        {"role": "user", "content": "Add 2 and 3"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": "add", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "5"},
    ]  # fmt: skip
    expected = chat_text(client, model_name, messages, 5, tools=[chat_tool], tool_choice="none")
    assert answer.output_text == expected[0]


def test_a_streamed_call_arrives_as_function_call_events(client, model_name):
    with client.responses.stream(
        model=model_name, input="Add 1 and 1", tools=[ADD],
        tool_choice={"type": "function", "name": "add"}, **GREEDY,
    ) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [call] = final.output
    assert call.type == "function_call" and call.arguments == deltas
    jsonschema.validate(json.loads(deltas), ADD["parameters"])


def test_text_format_json_schema_holds_the_output(client, model_name):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
    }
    response = client.responses.create(
        model=model_name, input="A number", max_output_tokens=40, temperature=1.0,
        extra_body={"seed": 7},
        text={"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)


def test_chat_only_fields_are_ignored_as_vllm_ignores_them(
    server: RunningServer, client, model_name
):
    """`n`, `max_completion_tokens`, `response_format` and `logprobs` are chat fields: a
    response ignores them (one sample, max_output_tokens holds); the client's own
    `stream_options` is taken; vLLM's sampling extras (`seed`, `ignore_eos`) pass on."""
    plain = client.responses.create(
        model=model_name, input="Hi", max_output_tokens=6, **GREEDY, extra_body=LONG
    )
    chat_only = {"n": 2, "max_completion_tokens": 2, "logprobs": True,
                 "response_format": {"type": "json_object"}, "use_beam_search": True}  # fmt: skip
    response = client.responses.create(
        model=model_name,
        input="Hi",
        max_output_tokens=6,
        **GREEDY,
        extra_body={**LONG, **chat_only},
    )
    assert response.output_text == plain.output_text
    assert response.usage.output_tokens == 6 and len(response.output) == 1
    with client.responses.stream(
        model=model_name, input="Hi", max_output_tokens=6, **GREEDY, extra_body=LONG,
        stream_options={"include_obfuscation": False},
    ) as stream:  # fmt: skip
        assert stream.get_final_response().output_text == plain.output_text


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"text": {"format": "json"}}, "text.format"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"input": []}, "input"),
        ({"input": [{"type": "reasoning", "encrypted_content": "x", "summary": []}]}, "input.0"),
        ({"max_output_tokens": 10**12}, "max_output_tokens"),
        ({"tools": [{"type": "function", "parameters": {}}]}, "tools.0.name"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"chat_template_kwargs": {"chat_template": 5}}, "chat_template_kwargs"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input.0.content.0"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
    ],
)  # fmt: skip
def test_what_is_not_served_is_a_400_naming_the_field(server: RunningServer, fields, param):
    response = server.post("/v1/responses", {"input": "Hi", **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_reasoning_comes_as_its_own_item_streamed_or_not(serve) -> None:
    """With a reasoning parser, a reply that opens in a think block gives a reasoning item
    (its text the chat completion's `reasoning`), and the same output items whether streamed
    or not: no empty message where nothing followed the reasoning (vLLM's)."""
    from pagedkv.server import ServerConfig
    from tests.server.test_reasoning import OPENING

    config = ServerConfig(reasoning_parser="qwen3", trust_request_chat_template=True)
    server = serve(config, num_gpu_blocks=64, seed=0)
    extra = {"chat_template": OPENING, **LONG}
    with server.client() as client:
        model = client.models.list().data[0].id
        fields = dict(model=model, input="Think", max_output_tokens=6, **GREEDY)
        response = client.responses.create(**fields, extra_body=extra)
        with client.responses.stream(**fields, extra_body=extra) as stream:
            deltas = "".join(e.delta for e in stream if e.type == "response.reasoning_text.delta")
            streamed = stream.get_final_response()
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Think"}], max_tokens=6,
            **GREEDY, extra_body=extra,
        ).choices[0].message  # fmt: skip
    assert [item.type for item in response.output] == [i.type for i in streamed.output]
    reasoning = response.output[0]
    assert reasoning.type == "reasoning" and reasoning.content[0].text == chat.reasoning
    assert streamed.output[0].content[0].text == deltas == chat.reasoning
    assert len(response.output) == (2 if chat.content else 1)


def test_a_failure_mid_stream_is_an_error_event(server: RunningServer) -> None:
    """OpenAI's error event (type "error", its code, message and param) ends a stream whose
    engine step failed; the next request runs."""
    fail_next_step(server, "simulated kernel fault")
    with server.http() as http:
        body = {"input": "Hi", "max_output_tokens": 4, "stream": True}
        lines = http.post("/v1/responses", json=body).text.splitlines()
        events = [
            json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")
        ]
        assert events[-1]["type"] == "error" and "simulated kernel fault" in events[-1]["message"]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        fine = http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2})
        assert fine.json()["status"] in ("completed", "incomplete")


def test_include_entries_that_change_nothing_are_taken_and_reasoning_effort_reaches_the_template(
    serve,
) -> None:
    """vLLM's: `include` entries other than logprobs change no output; `reasoning.effort`
    is the template's `reasoning_effort`, as chat's chat_template_kwargs would give it."""
    from pagedkv.server import ServerConfig

    template = "{{ reasoning_effort }}{% for m in messages %}|{{ m.content }}{% endfor %}"
    server = serve(ServerConfig(chat_template=template), num_gpu_blocks=64, seed=0)
    with server.client() as client:
        model = client.models.list().data[0].id
        response = client.responses.create(
            model=model, input="Hi", max_output_tokens=4, reasoning={"effort": "high"},
            include=["reasoning.encrypted_content"], **GREEDY, extra_body=LONG,
        )  # fmt: skip
        text, usage = chat_text(
            client, model, [{"role": "user", "content": "Hi"}], 4,
            chat_template_kwargs={"reasoning_effort": "high"},
        )  # fmt: skip
        plain = client.responses.create(model=model, input="Hi", max_output_tokens=4, **GREEDY)
    assert response.output_text == text
    assert response.usage.input_tokens == usage.prompt_tokens > plain.usage.input_tokens


def test_the_store_forgets_the_least_recently_used_first() -> None:
    """Bounded by count: past the capacity the entry least recently put or read goes."""
    from pagedkv.server.response_store import ResponseStore, StoredResponse

    def stored(name: str) -> StoredResponse:
        return StoredResponse({"id": name}, [])

    store = ResponseStore(capacity=2)
    store.put(stored("a"))
    store.put(stored("b"))
    assert store.get("a") is not None  # now the newest
    store.put(stored("c"))
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert store.delete("a") and not store.delete("a") and store.get("a") is None
