"""Tool calls read from outputs and written into prompts (`server/tools.py`), checked against
calls and conversations built by hand."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedkv.server.protocol import ChatCompletionRequest
from pagedkv.server.tools import ToolCallStream, parse_output, render_messages, tool_constraint

TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
]


def request(tool_choice=None, **fields) -> ChatCompletionRequest:
    body = {"messages": CONVERSATION, "tools": [TOOL], **fields}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    return ChatCompletionRequest.model_validate_json(json.dumps(body))


def calls(parsed) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls]


def test_auto_reads_hermes_tool_calls_and_the_content_before_them():
    text = (
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        '\n<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}'
    )
    parsed = parse_output(request(), text)
    assert parsed.content == "Let me add.\n"  # as it came, vLLM's hermes parser's content
    assert calls(parsed) == [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
    assert parse_output(request(), "no call here").content == "no call here"
    listed = '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 1}}]</tool_call>'
    assert calls(parse_output(request(), listed)) == [("add", {"a": 1, "b": 1})]
    broken = "<tool_call>{not json</tool_call>"
    assert parse_output(request(), broken).content == broken
    assert not parse_output(request("none"), text).tool_calls


def test_required_and_named_outputs_parse_and_cut_required_ones_stay_content():
    required = '[{"name": "add", "parameters": {"a": 1, "b": 2}}]'
    assert calls(parse_output(request("required"), required)) == [("add", {"a": 1, "b": 2})]
    assert parse_output(request("required"), required[:20]).content == required[:20]
    named = request({"type": "function", "function": {"name": "add"}})
    assert calls(parse_output(named, '{"a": 5, "b": 6}')) == [("add", {"a": 5, "b": 6})]
    cut = parse_output(named, '{"a": 5')  # the named function's arguments, cut off (vLLM's)
    assert cut.content is None
    assert [(c.function.name, c.function.arguments) for c in cut.tool_calls] == [("add", '{"a": 5')]


def test_parallel_tool_calls_false_keeps_the_first_call_whole_and_streamed():
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
    )
    one = request("auto", parallel_tool_calls=False)
    assert calls(parse_output(one, text)) == [("add", {"a": 1, "b": 2})]
    assert len(parse_output(request("auto"), text).tool_calls) == 2
    _, deltas = ToolCallStream(one).feed(text, True)
    assert [(d.index, json.loads(d.function.arguments)) for d in deltas] == [(0, {"a": 1, "b": 2})]


def test_arguments_keep_non_ascii_characters():
    text = '<tool_call>{"name": "add", "arguments": {"city": "Z\\u00fcrich"}}</tool_call>'
    [call] = parse_output(request(), text).tool_calls
    assert call.function.arguments == '{"city": "Zürich"}'


def test_streamed_auto_content_then_calls_add_up_to_the_whole_parse():
    text = 'Sure <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    stream = ToolCallStream(request())
    content, deltas = "", []
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    for index, piece in enumerate(pieces):
        part, new = stream.feed(piece, index == len(pieces) - 1)
        content += part or ""
        deltas += new
    assert content.strip() == "Sure" and "<" not in content
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        ("add", {"a": 1, "b": 2})
    ]
    plain = ToolCallStream(request())
    held = [plain.feed("a <tool", False)[0], plain.feed("kit", True)[0]]
    assert held == ["a ", "<toolkit"]  # held back while it could begin a call


def test_a_template_without_tools_gets_them_in_hermes_form():
    messages, variables = render_messages(request(), "{{ messages }}")
    assert variables == {}
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.")
    assert '"name": "add"' in messages[0]["content"] and "<tools>" in messages[0]["content"]
    call = json.loads(messages[2]["content"].split("<tool_call>")[1].split("</tool_call>")[0])
    assert call == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert messages[3] == {"role": "user", "content": "<tool_response>\n5\n</tool_response>"}


def test_a_template_with_tools_gets_them_as_variables():
    messages, variables = render_messages(request(), "{% for t in tools %}{{ t }}{% endfor %}")
    assert variables["tools"] == [TOOL]
    assert messages[2]["tool_calls"][0]["function"] == {
        "name": "add",
        "arguments": {"a": 2, "b": 3},
    }
    assert messages[3] == {"role": "tool", "content": "5", "tool_call_id": "c1"}


def test_required_schema_names_each_tool_and_its_parameters():
    schema = tool_constraint(request("required", parallel_tool_calls=False)).json
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    [item] = schema["items"]["anyOf"]
    assert item["properties"]["name"] == {"enum": ["add"]}
    assert item["properties"]["parameters"] == TOOL["function"]["parameters"]
    assert tool_constraint(request("auto")) is None


@pytest.mark.parametrize("root", [{}, {"$id": "https://example.com/tool.json"}], ids=["", "$id"])
def test_required_schema_accepts_what_each_tools_own_schema_accepts(root):
    """The combined "required" schema holds each call's parameters to its tool's own schema,
    `$defs` references and a root `$id` (which re-bases references) included."""
    parameters = {
        **root,
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/P"}},
        "required": ["p"],
        "$defs": {"P": {"type": "integer", "minimum": 3}},
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    schema = tool_constraint(request("required", tools=[tool])).json
    for arguments in ({"p": 4}, {"p": 2}, {"p": "x"}, {}):
        own = jsonschema.Draft202012Validator(parameters).is_valid(arguments)
        combined = jsonschema.Draft202012Validator(schema)
        assert combined.is_valid([{"name": "f", "parameters": arguments}]) == own
