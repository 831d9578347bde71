"""Tool calling: tools rendered into the prompt, the output held to the tool-call schema when
a call is required, and tool calls read back from the output (whole, or streamed).

Rendering: a chat template that uses `tools` (Qwen's, Llama 3's, Hermes') gets them as the
template variable, with assistant `tool_calls` (arguments as objects) and `role: "tool"`
messages as Hugging Face templates expect. A template that ignores them, such as the built-in
SmolLM2's, would drop them silently, so the conversation is rewritten in the Hermes format
that SmolLM2 and Qwen were trained on: the tool list in the system message, each past call as
`<tool_call>{"name", "arguments"}</tool_call>` in its assistant turn, each tool result as a
user turn in `<tool_response>` tags (Qwen's own template renders them so).

Choices follow vLLM: "required" holds the output to a JSON array of `{"name", "parameters"}`
objects (one of the tools each), a named function to that function's arguments, "auto"
leaves the output free and reads Hermes `<tool_call>` blocks from it (vLLM's hermes parser),
"none" reads nothing. A named function's output is its call's arguments, cut off or not (as
vLLM returns it); a cut-off "required" or "auto" output that does not parse is returned as
content. With `parallel_tool_calls` false only the first call is returned (vLLM's rule), and
arguments are JSON with non-ASCII characters as they are.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedkv.engine import StructuredOutputsParams
from pagedkv.server.errors import APIError
from pagedkv.server.formats import (
    FunctionCall,
    FunctionCallDelta,
    NamedToolChoice,
    Tool,
    ToolCall,
    ToolCallDelta,
)
from pagedkv.server.protocol import ChatCompletionRequest, ChatMessage

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_ANY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}
_SYSTEM_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def render_messages(
    request: ChatCompletionRequest, template: str | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra template variables for the model's chat `template` (its text)."""
    if template is not None and "tools" in template:
        messages = [_with_reasoning(_template_message(m), m) for m in request.messages]
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools or []]
        return messages, ({"tools": tools} if tools else {})
    messages = [_with_reasoning(_hermes_message(m), m) for m in request.messages]
    if request.tools:
        prompt = _SYSTEM_PROMPT.format(tools="\n".join(_tool_json(t) for t in request.tools))
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = f"{request.messages[0].text()}\n\n{prompt}"
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages, {}


def _with_reasoning(rendered: dict[str, Any], message: ChatMessage) -> dict[str, Any]:
    """A past assistant turn's reasoning as thinking models' templates read it."""
    if message.thinking() is not None:
        rendered["reasoning_content"] = message.thinking()
    return rendered


def _role(message: ChatMessage) -> str:
    # Templates predate OpenAI's "developer" role: it plays the system prompt's part.
    return "system" if message.role == "developer" else message.role


def _template_message(message: ChatMessage) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": _role(message), "content": message.template_content()}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        rendered["name"] = message.name
    return rendered


def _hermes_message(message: ChatMessage) -> dict[str, Any]:
    if message.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.text()}\n</tool_response>"}
    if not message.tool_calls:  # as given: the content format joins its parts, or not
        return {"role": _role(message), "content": message.template_content()}
    blocks = [
        f"{CALL_START}\n{json.dumps({'name': c.function.name, 'arguments': _arguments(c)})}\n"
        f"{CALL_END}"
        for c in message.tool_calls or []
    ]
    content = "\n".join(part for part in (message.text(), *blocks) if part)
    return {"role": _role(message), "content": content}


def _arguments(call: ToolCall) -> Any:
    """A past call's arguments as an object (templates write them with tojson), or the text
    as sent when it is not JSON."""
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


def _tool_json(tool: Tool) -> str:
    return json.dumps({"type": "function", "function": tool.function.model_dump(exclude_none=True)})


def tool_constraint(request: ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The schema a "required" or named tool choice holds the output to (None otherwise);
    a 400 for a tool choice without tools, or naming a function not among them."""
    choice = request.resolved_tool_choice
    if choice != "none" and not request.tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    names = {tool.function.name for tool in request.tools or []}
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise APIError(
            400,
            f"tool_choice names '{choice.function.name}', not among the tools",
            param="tool_choice",
        )
    if isinstance(choice, NamedToolChoice):
        return StructuredOutputsParams(json=_parameters(_tool(request, choice.function.name)))
    if choice != "required":
        return None
    definitions: dict[str, Any] = {}
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"enum": [tool.function.name]},
                "parameters": _hoisted(_parameters(tool), f"tool{index}", definitions),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for index, tool in enumerate(request.tools or [])
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if request.parallel_tool_calls is False:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return StructuredOutputsParams(json=schema)


def _hoisted(parameters: dict[str, Any], key: str, definitions: dict[str, Any]) -> Any:
    """A tool's parameters as a part of the combined schema: references inside it point at
    its own root (`#`, `#/$defs/x`, `#/definitions/x`, `#/properties/...`), which there is the
    combined schema's, so its definitions move to the root's `$defs` under names prefixed by
    `key` and every reference is rewritten to match. Without references it stays as it is."""
    if not _has_refs(parameters):
        return parameters
    moved = {
        f"#/{section}/{name}": f"#/$defs/{key}__{name}"
        for section in ("$defs", "definitions")
        for name in parameters.get(section) or {}
    }

    def ref(target: str) -> str:
        for old, new in moved.items():
            if target == old or target.startswith(old + "/"):
                return new + target[len(old) :]
        return f"#/$defs/{key}{target[1:]}" if target.startswith("#") else target

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                name: ref(value) if name == "$ref" and isinstance(value, str) else rewrite(value)
                for name, value in node.items()
            }
        return [rewrite(item) for item in node] if isinstance(node, list) else node

    for section in ("$defs", "definitions"):
        for name, definition in (parameters.get(section) or {}).items():
            definitions[f"{key}__{name}"] = rewrite(definition)
    # The root's `$id` (and `$schema`) would make its references resolve against the tool's
    # own document, not the combined schema they now point into.
    body = {
        name: value
        for name, value in parameters.items()
        if name not in ("$defs", "definitions", "$id", "$schema")
    }
    definitions[key] = rewrite(body)
    return {"$ref": f"#/$defs/{key}"}


def _has_refs(node: Any) -> bool:
    if isinstance(node, dict):
        return "$ref" in node or any(_has_refs(value) for value in node.values())
    return isinstance(node, list) and any(_has_refs(item) for item in node)


def _tool(request: ChatCompletionRequest, name: str) -> Tool:
    return next(tool for tool in request.tools or [] if tool.function.name == name)


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or _ANY_OBJECT


@dataclass
class ParsedMessage:
    """A choice's output read as content and tool calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


def parse_output(request: ChatCompletionRequest, text: str) -> ParsedMessage:
    """The content and tool calls of a whole output, under the request's tool choice."""
    choice = request.resolved_tool_choice
    if isinstance(choice, NamedToolChoice):
        return ParsedMessage(None, [_call(choice.function.name, text)])
    if choice == "required":
        try:
            calls = json.loads(text)
            parsed = ParsedMessage(None, [_call(c["name"], _json(c["parameters"])) for c in calls])
        except (ValueError, TypeError, KeyError):
            return ParsedMessage(text)
    elif choice == "auto":
        parsed = _parse_hermes(text)
    else:
        return ParsedMessage(text)
    if request.parallel_tool_calls is False:
        parsed.tool_calls = parsed.tool_calls[:1]
    return parsed


def _parse_hermes(text: str) -> ParsedMessage:
    """Hermes `<tool_call>` blocks (the last may lack its closing tag), each one call or a
    list of calls (SmolLM2's own format); text before the first is content, as it came.
    Blocks that are not JSON calls leave the whole text as content."""
    start = text.find(CALL_START)
    if start == -1:
        return ParsedMessage(text)
    calls = []
    for body in _HERMES_CALL.findall(text[start:]):
        try:
            block = json.loads(body)
            for call in block if isinstance(block, list) else [block]:
                arguments = call.get("arguments", call.get("parameters", {}))
                calls.append(_call(call["name"], _json(arguments)))
        except (ValueError, TypeError, KeyError, AttributeError):
            return ParsedMessage(text)
    return ParsedMessage(text[:start] or None, calls)


def _json(arguments: Any) -> str:
    """Arguments as a call carries them: JSON, non-ASCII characters kept (vLLM's parsers)."""
    return json.dumps(arguments, ensure_ascii=False)


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name, arguments=arguments)
    )


class ToolCallStream:
    """One streamed choice's text turned into content and tool-call deltas, as OpenAI streams
    them: a named function's arguments as they come (its name and id first); "required"
    calls, and "auto" calls once a `<tool_call>` begins, when the output ends (their text is
    only a call once whole). Content before an "auto" call streams, less any tail that could
    still begin `<tool_call>`."""

    def __init__(self, request: ChatCompletionRequest) -> None:
        self.request = request
        self.choice = request.resolved_tool_choice
        self.text = ""
        self.content_sent = 0
        self.calls_sent = 0

    def feed(self, text: str, finished: bool) -> tuple[str | None, list[ToolCallDelta]]:
        """The content and tool-call deltas of the next piece of the output."""
        self.text += text
        if isinstance(self.choice, NamedToolChoice):
            return None, self._named(text)
        if not finished:
            return self._content_so_far(), []
        parsed = parse_output(self.request, self.text)
        content = None
        if parsed.content is not None or not parsed.tool_calls:
            content = self._content_so_far(everything=not parsed.tool_calls)
        deltas = [
            ToolCallDelta(
                index=index,
                id=call.id,
                type="function",
                function=FunctionCallDelta(
                    name=call.function.name, arguments=call.function.arguments
                ),
            )
            for index, call in enumerate(parsed.tool_calls)
        ]
        self.calls_sent = len(deltas)
        return content, deltas

    def _named(self, text: str) -> list[ToolCallDelta]:
        if self.calls_sent:
            return [ToolCallDelta(index=0, function=FunctionCallDelta(arguments=text))]
        assert isinstance(self.choice, NamedToolChoice)
        self.calls_sent = 1
        first = _call(self.choice.function.name, text)
        return [
            ToolCallDelta(
                index=0,
                id=first.id,
                type="function",
                function=FunctionCallDelta(name=first.function.name, arguments=text),
            )
        ]

    def _content_so_far(self, everything: bool = False) -> str | None:
        """Content not sent yet: none under "required"; under "auto", text before a
        `<tool_call>` (all of it, `everything`, once the output is known to hold no call)."""
        if self.choice == "required" and not everything:
            return None
        end = len(self.text)
        if not everything:
            start = self.text.find(CALL_START)
            end = start if start != -1 else len(self.text) - _partial_start(self.text)
        piece = self.text[self.content_sent : max(end, self.content_sent)]
        self.content_sent = max(end, self.content_sent)
        return piece or None

    @property
    def called(self) -> bool:
        """True once tool calls were sent."""
        return self.calls_sent > 0


def _partial_start(text: str) -> int:
    """How many characters at the end of `text` could begin `<tool_call>`."""
    for length in range(min(len(CALL_START) - 1, len(text)), 0, -1):
        if CALL_START.startswith(text[-length:]):
            return length
    return 0
