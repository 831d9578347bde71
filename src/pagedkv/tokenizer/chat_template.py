"""Chat templates as transformers renders them, and messages as vLLM hands them over.

A template is a jinja program from the model's files. It runs in a sandbox with the
environment transformers gives templates (trimmed blocks, loop controls, `raise_exception`,
`tojson` without HTML escaping, `strftime_now`, and the `{% generation %}` block that marks
assistant text for training), so a Hub template renders the same text here as there, and one
that uses `{% generation %}` loads at all.

A message's content reaches the template in one of vLLM's two content formats:
- "string": one string (text parts joined by newlines), what most text templates print;
- "openai": a list of `{"type": "text", "text": ...}` parts (a string is one part), what
  templates written for images and audio loop over.
"auto" picks "openai" exactly when the template loops over a message's content, as vLLM's
detection reads the template's syntax tree; otherwise "string". Only text parts are taken: the
models here read text. An assistant's past tool calls reach the template with their arguments
as objects, not OpenAI's JSON text, as vLLM hands them over.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pagedkv.model.errors import ChatTemplateError

CONTENT_FORMATS = ("auto", "string", "openai")

logger = logging.getLogger(__name__)


class _GenerationBlock(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}`: it marks which rendered text
    the assistant wrote (for training masks); rendering, its body is printed as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any
) -> str:
    # jinja's own tojson escapes HTML characters, which would change what the model sees.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


ENVIRONMENT = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationBlock]
)
ENVIRONMENT.filters["tojson"] = _tojson
ENVIRONMENT.globals["raise_exception"] = _raise_exception
ENVIRONMENT.globals["strftime_now"] = _strftime_now


def compile_template(chat_template: str) -> jinja2.Template:
    """A template given with a request or a call; bad jinja is a `ChatTemplateError`."""
    try:
        return ENVIRONMENT.from_string(chat_template)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(f"chat_template is not valid jinja: {error}") from error


def resolve_content_format(content_format: str, chat_template: str) -> str:
    """ "string" or "openai": the one given, or for "auto" the one `chat_template` reads."""
    if content_format not in CONTENT_FORMATS:
        raise ValueError(
            f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, "
            f"got {content_format!r}"
        )
    if content_format != "auto":
        return content_format
    return "openai" if _loops_over_content(chat_template) else "string"


@lru_cache(maxsize=32)
def _loops_over_content(chat_template: str) -> bool:
    """Whether the template has `{% for part in message['content'] %}` (through filters,
    tests or slices), `message` being the target of a loop over `messages` or a variable
    set from it, as vLLM's detection finds it (it follows no other aliases)."""
    tree = ENVIRONMENT.parse(chat_template)
    lists = _aliases(tree, "messages")
    loops = list(tree.find_all(jinja2.nodes.For))
    messages = {
        loop.target.name
        for loop in loops
        if isinstance(loop.target, jinja2.nodes.Name)
        and any(_reads(loop.iter, name) for name in lists)
    }
    return any(_reads(loop.iter, name, "content") for loop in loops for name in messages)


def _aliases(tree: jinja2.nodes.Template, name: str) -> set[str]:
    """`name` and every variable `{% set %}` from it or from such a variable, transitively."""
    found, pending = {name}, [name]
    while pending:
        source = pending.pop()
        for assign in tree.find_all(jinja2.nodes.Assign):
            target = assign.target
            if (
                isinstance(target, jinja2.nodes.Name)
                and target.name not in found
                and _reads(assign.node, source)
            ):
                found.add(target.name)
                pending.append(target.name)
    return found


def _reads(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """Whether `node` is `name` (or `name[key]` / `name.key`), seen through filters, tests
    and slices."""
    if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name
    if isinstance(node, jinja2.nodes.Getitem):
        keyed = isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    elif isinstance(node, jinja2.nodes.Getattr):
        keyed = node.attr == key
    else:
        return False
    return keyed and _reads(node.node, name)


def template_message(message: object, content_format: str | None) -> dict[str, Any]:
    """A message as templates take it, its content in `content_format` ("string" or
    "openai"; None or missing content is "" or no parts) and its past tool calls' arguments
    as objects, as vLLM hands them over; with no format (None), as given, as transformers
    hands it. A part that is not text (an image, audio) is refused: the models here read
    text only."""
    if not isinstance(message, Mapping) or "role" not in message:
        raise ValueError(f"a chat message must be a dict with a 'role', got {message!r:.100}")
    rendered = dict(message)
    if content_format is None:
        return rendered
    texts = list(_texts(rendered.get("content")))
    if content_format == "openai":
        rendered["content"] = [{"type": "text", "text": text} for text in texts]
    else:
        rendered["content"] = "\n".join(texts)
    calls = rendered.get("tool_calls")
    if rendered["role"] == "assistant" and isinstance(calls, list):
        if calls:
            rendered["tool_calls"] = [_with_object_arguments(call) for call in calls]
        else:  # an empty list keeps templates on the plain assistant path (Llama 3.1's fails)
            del rendered["tool_calls"]
    return rendered


def _with_object_arguments(call: object) -> dict[str, Any]:
    """A past tool call with its arguments as vLLM hands them to templates (they write them
    with tojson): OpenAI's JSON text parsed; an object kept; none is {}; anything else, or
    text that is no JSON object, is {} with a warning (vLLM's rule: templates expect a
    mapping), so one bad turn in a history does not fail every later one."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or call.get("type", "function") != "function":
        raise ValueError(
            f"an assistant's tool_calls entry must be a function call, got {call!r:.100}"
        )
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = function.get("arguments")
    if not arguments:
        arguments = {}
    elif not isinstance(arguments, Mapping):
        logger.warning(
            "the arguments of tool call %r are no JSON object: rendered as {}", function.get("name")
        )
        arguments = {}
    return {**call, "function": {**function, "arguments": arguments}}


def _texts(content: object) -> Iterator[str]:
    if content is None:
        return
    if isinstance(content, str):
        yield content
        return
    if not isinstance(content, Sequence):  # (a dict is not one)
        raise ValueError(
            f"a message's content must be a string or a list of text parts, got {content!r:.100}"
        )
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(
                f"content part of type {kind!r} is not supported: the model reads text"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"a text part needs a string 'text', got {text!r:.100}")
        yield text


def cut_after_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """The text up to the end of the last message's content (its last text part, in the
    "openai" format), as transformers cuts it: where the template kept the message as given,
    just after it; where it trimmed it, after the trimmed content."""
    final = messages[-1].get("content") if messages else None
    if isinstance(final, list):
        final = final[-1]["text"] if final else None
    if not isinstance(final, str) or not final.strip():
        raise ChatTemplateError(
            "continue_final_message is set, but the last message has no text to continue"
        )
    if final.strip() not in text:
        raise ChatTemplateError(
            "continue_final_message is set, but the last message's content does not appear "
            "in the rendered conversation"
        )
    start = text.rindex(final.strip())
    if text[start : start + len(final.lstrip())] == final:
        return text[: start + len(final.lstrip())]
    return text[: start + len(final.strip())]


# transformers' apply_chat_template options about padded tensors, which have no meaning here.
TENSOR_OPTIONS = (
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
)


def is_conversation(value: object) -> bool:
    """Whether `value` is a conversation (a list of messages), not one message (a dict):
    what tells a list of conversations from one conversation."""
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)
