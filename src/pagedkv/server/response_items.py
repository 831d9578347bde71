"""The Responses API's objects: a response's body around its output, and its output items
(reasoning, a message of `output_text`, function calls) built from a chat completion.

A response is one chat completion in another shape (`responses_api.py`), so every field here
is a chat field renamed: the choice's reasoning, content and tool calls become items, its
finish reason the status ("incomplete" where `max_output_tokens` cut it), its usage the
`input_tokens` / `output_tokens` counts. Items have OpenAI's ids (`msg_`, `rs_`, `fc_` and
hex), which a stream's events and the final output share.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedkv.server.protocol import ResponsesRequest
    from pagedkv.server.responses import ChatCompletionResponse, Usage


def item_id(prefix: str) -> str:
    """An id as OpenAI's look: the object's prefix, an underscore, then unique hex."""
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponseShell:
    """What every form of one response carries, its output and status aside: the request's
    settings echoed, as OpenAI's responses echo them."""

    request: ResponsesRequest
    model: str
    # The settings that ran, as vLLM echoes them: the defaults a request left out filled in,
    # max_output_tokens the room the context left where it asked for none.
    temperature: float
    top_p: float
    max_output_tokens: int
    id: str = field(default_factory=lambda: item_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The response object with this status and output, usage not yet known."""
        request = self.request
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": request.instructions,
            "max_output_tokens": self.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": request.previous_response_id,
            "reasoning": request.reasoning,
            "store": request.store,
            "temperature": self.temperature,
            "text": request.text.model_dump(exclude_none=True, by_alias=True)
            if request.text is not None
            else {"format": {"type": "text"}},
            "tool_choice": request.tool_choice or "auto",
            "tools": request.tools or [],
            "top_p": self.top_p,
            "truncation": request.truncation,
            "usage": None,
            "user": request.user,
            "metadata": request.metadata or {},
        }

    def finished(
        self, output: list[dict[str, Any]], finish_reason: str | None, usage: Usage | None
    ) -> dict[str, Any]:
        """The whole response: "incomplete" where max_output_tokens (or the context) cut it,
        "failed" where its constraint could not be met ("abort"), else "completed"."""
        body = self.body("completed", output)
        if finish_reason == "length":
            body["status"] = "incomplete"
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        elif finish_reason == "abort":  # the request's own constraints left nothing to say
            body["status"] = "failed"
            body["error"] = {
                "code": "invalid_prompt",
                "message": "the output ended before its constraints could be met (they exclude "
                "each other, or the grammar passed its limits)",
            }
        if usage is not None:
            details = usage.prompt_tokens_details
            body["usage"] = {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": details.cached_tokens if details else 0},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.total_tokens,
            }
        return body


def output_items(completion: ChatCompletionResponse) -> list[dict[str, Any]]:
    """A chat completion's one choice as output items: its reasoning, its message (where it
    has content, as vLLM's), then a function call per tool call."""
    message = completion.choices[0].message
    items = []
    if message.reasoning:
        items.append(reasoning_item(item_id("rs"), message.reasoning))
    if message.content:
        items.append(message_item(item_id("msg"), message.content))
    for call in message.tool_calls or []:
        items.append(call_item(item_id("fc"), call.id, call.function.name, call.function.arguments))
    return items


def message_item(id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """An assistant message item; one being streamed has no content part yet."""
    return {
        "type": "message",
        "id": id,
        "status": status,
        "role": "assistant",
        "content": [text_part(text)] if status == "completed" else [],
    }


def text_part(text: str) -> dict[str, Any]:
    """A message's `output_text` part (no annotations or logprobs are made here)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A reasoning item: the think block's text as its `reasoning_text`, no summary."""
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": id, "status": status, "summary": [], "content": content}


def call_item(
    id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    """A function call item: its own id, and the `call_id` its output item names."""
    return {
        "type": "function_call",
        "id": id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def assistant_turn(output: list[dict[str, Any]]) -> dict[str, Any]:
    """Output items as the chat message a next turn renders (reasoning left out)."""
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {"id": item["call_id"], "type": "function",
         "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in output if item["type"] == "function_call"
    ]  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return message
