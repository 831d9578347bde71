"""`POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}` and `POST .../{id}/cancel`:
OpenAI's Responses API, as vLLM serves it, over the chat completions pipeline.

Why a translation: a response is one chat completion in another shape. Its `input` (a string,
or message, `function_call` and `function_call_output` items) and `instructions` become chat
messages; `max_output_tokens`, `text.format` and the flat function `tools` become the chat
fields they mean; and the chat pipeline (template, tools, reasoning parser, structured
outputs, sampling defaults) runs it unchanged. The answer is built in `response_items.py`,
streamed in `response_stream.py`.

`store` (on by default, as OpenAI's) keeps the response for `previous_response_id`, which
continues its conversation: the inputs it continued, its own, and its output, under the new
request's `instructions` (OpenAI's: the old ones are not carried over). vLLM's sampling extras
(`SAMPLING_EXTRAS`) pass on to the chat request; a Responses field that changes no output here
is taken and left (`metadata`, `user`, `reasoning`, `top_logprobs` without `include`, ...);
one that would (`background`, `truncation: auto`, `include`'s logprobs, `prompt`,
`conversation`, other tool types, images and files) is a 400 naming it; any other field is
ignored with one log line (a 400 under `--strict-fields`), as vLLM ignores chat-only fields
such as `n` here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedkv.server.chat import start_chat
from pagedkv.server.errors import APIError
from pagedkv.server.protocol import ChatCompletionRequest, ResponsesRequest, pass_over_unknown
from pagedkv.server.response_items import ResponseShell, assistant_turn, output_items
from pagedkv.server.response_store import StoredResponse
from pagedkv.server.response_stream import response_events
from pagedkv.server.responses import ChatCompletionResponse
from pagedkv.server.serving import (
    CLIENT_CLOSED_REQUEST,
    EventStream,
    ServingContext,
    parse_body,
    until_disconnect,
)

# vLLM's sampling and template extras, passed on to the chat request as they are.
SAMPLING_EXTRAS = frozenset(
    {
        "seed", "top_k", "min_p", "stop", "stop_token_ids", "repetition_penalty",
        "presence_penalty", "frequency_penalty", "ignore_eos", "min_tokens", "logit_bias",
        "bad_words", "allowed_token_ids", "skip_special_tokens", "include_stop_str_in_output",
        "structured_outputs", "priority", "chat_template", "chat_template_kwargs",
        "cache_salt", "request_id",
    }
)  # fmt: skip
# The chat fields a Responses field becomes: a refusal names the request's own field.
_RESPONSES_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format"}
_TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS = "message.output_text.logprobs"


async def create_response(context: ServingContext, raw: Request) -> Response:
    """Translate, run the chat pipeline, and answer in the Responses API's shape."""
    request = parse_body(await raw.body(), ResponsesRequest)
    _refuse_unsupported(context, request)
    history: list[dict[str, Any]] = []
    if request.previous_response_id is not None:
        previous = context.stored_responses.get(request.previous_response_id)
        if previous is None:
            raise _not_found(request.previous_response_id, param="previous_response_id")
        history = previous.conversation
    conversation = history + input_messages(request.input)
    with _named_for_responses():
        chat = _chat_request(context, request, conversation)
        completion = await start_chat(context, chat)
    generation = completion.generation
    params = generation.params
    assert params is not None  # set when the generation started
    room = context.max_model_len - len(generation.prompts[0])
    shell = ResponseShell(
        request,
        generation.served_name(context.model_name),
        temperature=params.temperature,
        top_p=params.top_p,
        max_output_tokens=min(params.max_tokens or room, room),
    )

    def keep(response: dict[str, Any]) -> None:
        """Store a finished response (with store=true) with the conversation it continues."""
        if request.store:
            reply = assistant_turn(response["output"])
            context.stored_responses.put(StoredResponse(response, [*conversation, reply]))

    if request.stream:
        events = response_events(shell, completion.chunk_choices(), generation, keep)
        return EventStream(events, on_close=generation.close)
    try:
        body = await until_disconnect(raw, completion.collect())
    finally:
        generation.close()
    if not isinstance(body, ChatCompletionResponse):  # None: the client hung up
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    response = shell.finished(output_items(body), body.choices[0].finish_reason, body.usage)
    keep(response)
    return JSONResponse(response)


def retrieve_response(context: ServingContext, response_id: str) -> JSONResponse:
    """A stored response as it was returned; vLLM's 404 when none has that id."""
    stored = context.stored_responses.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return JSONResponse(stored.body)


def cancel_response(context: ServingContext, response_id: str) -> JSONResponse:
    """vLLM's answers: only a background response can be cancelled, and none runs here."""
    if context.stored_responses.get(response_id) is None:
        raise _not_found(response_id)
    raise APIError(400, "Cannot cancel a synchronous response.", param="response_id")


def delete_response(context: ServingContext, response_id: str) -> JSONResponse:
    """Forget a stored response (OpenAI's answer); 404 when none has that id."""
    if not context.stored_responses.delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _not_found(response_id: str, param: str = "response_id") -> APIError:
    return APIError(404, f"Response with id {response_id!r} not found.", param=param)


def _refuse_unsupported(context: ServingContext, request: ResponsesRequest) -> None:
    """A 400 for each field whose meaning is not served here (it would change the output);
    fields neither API knows are logged, or refused under --strict-fields."""
    refused = {  # each field: whether the request sets it, and why that is refused
        "background": (request.background, "background responses are not supported"),
        "truncation": (
            request.truncation == "auto",
            "truncation 'auto' is not supported: a conversation longer than the context is "
            "refused, as with 'disabled'",
        ),
        "prompt": (bool(request.prompt), "prompt templates are not supported"),
        "conversation": (
            bool(request.conversation),
            "conversations are not supported: continue one with previous_response_id",
        ),
    }
    for name, (given, message) in refused.items():
        if given:
            raise APIError(400, message, param=name)
    if LOGPROBS in (request.include or []):  # the other entries change no output here
        raise APIError(400, f"include {LOGPROBS!r} is not supported", param="include")
    if not request.input:
        raise APIError(400, "input must not be empty", param="input")
    unknown = [name for name in request.model_extra or {} if name not in SAMPLING_EXTRAS]
    pass_over_unknown(unknown, context.strict_fields)


def input_messages(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a Responses `input`: a user message for a string; otherwise each
    message item as itself, each run of `function_call` items as one assistant message with
    those tool calls (parallel calls), each `function_call_output` as a tool message;
    reasoning items are left out (the template renders past turns without them)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(given):
        kind = item.get("type", "message")
        where = f"input.{index}"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role: {role!r} is not a message role", param=where)
            content = _content(item.get("content"), f"{where}.content")
            messages.append({"role": role, "content": content})
        elif kind == "function_call":
            name, arguments = _text(item, "name", where), _text(item, "arguments", where)
            call = {"id": _text(item, "call_id", where), "type": "function",
                    "function": {"name": name, "arguments": arguments}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _content(output, f"{where}.output")
            call_id = _text(item, "call_id", where)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            if item.get("encrypted_content") is not None:  # vLLM's refusal
                raise APIError(400, "Encrypted content is not supported.", param=where)
        else:
            raise APIError(
                400, f"{where}: input items of type {kind!r} are not supported", param=where
            )
    return messages


def _content(content: Any, where: str) -> str | list[dict[str, str]]:
    """Content (at `where` in the request) as chat takes it: a string, or its text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of parts", param=where)
    parts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(
                400,
                f"{where}.{index}: only text parts ({', '.join(_TEXT_PARTS)}) are supported, "
                f"got {kind!r}",
                param=f"{where}.{index}",
            )
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _text(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


def _chat_request(
    context: ServingContext, request: ResponsesRequest, conversation: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """The chat completion a response runs as (validated as any chat request is)."""
    extras = {k: v for k, v in (request.model_extra or {}).items() if k in SAMPLING_EXTRAS}
    effort = (request.reasoning or {}).get("effort")
    if effort is not None:  # vLLM's: for templates that read it (gpt-oss's, ...)
        kwargs = extras.get("chat_template_kwargs")
        kwargs = dict(kwargs) if isinstance(kwargs, dict) else {}
        extras["chat_template_kwargs"] = {"reasoning_effort": effort, **kwargs}
    instructions = [{"role": "system", "content": request.instructions}]
    body: dict[str, Any] = {
        **extras,
        "model": request.model,
        "messages": (instructions if request.instructions else []) + conversation,
        "max_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "parallel_tool_calls": request.parallel_tool_calls,
    }
    if request.tools:
        body["tools"] = [_chat_tool(tool, index) for index, tool in enumerate(request.tools)]
    choice = request.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":  # a named function
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        body["tool_choice"] = choice
    text_format = request.text.format if request.text is not None else None
    if text_format is not None and text_format.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif text_format is not None and text_format.type == "json_schema":
        schema = text_format.model_dump(exclude_none=True, by_alias=True, exclude={"type"})
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    return context.parse(json.dumps(body).encode(), ChatCompletionRequest)


def _chat_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    """A flat Responses function tool as chat's `{"type", "function": {...}}`."""
    if tool.get("type") != "function":
        raise APIError(
            400,
            f"tools.{index}: only function tools are supported, got {tool.get('type')!r}",
            param=f"tools.{index}.type",
        )
    function = {key: value for key, value in tool.items() if key != "type"}
    return {"type": "function", "function": function}


@contextmanager
def _named_for_responses() -> Iterator[None]:
    """Within it, a refusal of the chat request names the Responses field the chat field came
    from (`max_tokens` is `max_output_tokens`, `tools.0.function.name` is `tools.0.name`)."""
    try:
        yield
    except APIError as error:
        old = error.info.param
        if old is not None:
            new = _responses_name(old)
            error.info.param = new
            error.info.message = error.info.message.replace(old, new, 1)
        raise


def _responses_name(param: str) -> str:
    """The Responses field a chat request's field came from. A message's index is not the
    input's (instructions and earlier turns come first, function calls merge), so any
    message field is `input`."""
    head, _, rest = param.partition(".")
    if head == "messages":
        return "input"
    if head in ("tools", "tool_choice"):
        rest = rest.replace("function.", "", 1)
    if head == "response_format":
        rest = rest.removeprefix("json_schema.")
    return ".".join(filter(None, (_RESPONSES_NAMES.get(head, head), rest)))
