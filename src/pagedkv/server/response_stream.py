"""A streamed response: OpenAI's typed Responses events from a chat completion's chunks.

`response.created` and `response.in_progress` first; then each output item in order, opened
(`output_item.added`, and for a message its `content_part.added`), its deltas
(`reasoning_text.delta`, `output_text.delta`, `function_call_arguments.delta`), and its close
(the `.done` events, then `output_item.done` with the whole item); last `response.completed`
with the whole response, whatever its status, as vLLM's ends (the `openai` client's stream
helper reads the final response from that event). Every event has its `sequence_number`,
from 0; items keep one id from `added` to the final output. No `[DONE]` follows.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from itertools import count
from typing import TYPE_CHECKING, Any

from pagedkv.server.errors import APIError
from pagedkv.server.response_items import (
    ResponseShell,
    call_item,
    item_id,
    message_item,
    reasoning_item,
    text_part,
)

if TYPE_CHECKING:
    from pagedkv.server.generation import Generation
    from pagedkv.server.responses import ChatChunkChoice

_DELTAS = {"reasoning": "response.reasoning_text.delta", "message": "response.output_text.delta"}


class _Events:
    """Typed server-sent events, numbered in order."""

    def __init__(self) -> None:
        self.numbers = count()

    def __call__(self, kind: str, **fields: Any) -> str:
        data = json.dumps({"type": kind, "sequence_number": next(self.numbers), **fields})
        return f"event: {kind}\ndata: {data}\n\n"


@dataclass
class _OpenItem:
    """An output item being streamed: its index among the outputs, and what it said so far."""

    index: int
    item: dict[str, Any]
    text: list[str] = field(default_factory=list)


async def response_events(
    shell: ResponseShell,
    choices: AsyncIterator[ChatChunkChoice],
    generation: Generation,
    on_finished: Callable[[dict[str, Any]], None],
) -> AsyncIterator[str]:
    """The stream of one response; `on_finished` gets the whole response at the end (to
    store it). An engine failure mid-stream is an `error` event, as OpenAI's streams send."""
    event = _Events()
    yield event("response.created", response=shell.body("in_progress", []))
    yield event("response.in_progress", response=shell.body("in_progress", []))
    done: list[dict[str, Any]] = []
    current: _OpenItem | None = None
    calls: dict[int, _OpenItem] = {}
    finish_reason = None
    try:
        async for choice in choices:
            delta = choice.delta
            finish_reason = choice.finish_reason or finish_reason
            for kind, piece in (("reasoning", delta.reasoning), ("message", delta.content)):
                if not piece:
                    continue
                if current is None or current.item["type"] != kind:
                    for text in _close(event, current, done):
                        yield text
                    current = _OpenItem(len(done), _new_item(kind))
                    for text in _opened(event, current):
                        yield text
                current.text.append(piece)
                extra = {"logprobs": []} if kind == "message" else {}
                yield event(
                    _DELTAS[kind], item_id=current.item["id"], output_index=current.index,
                    content_index=0, delta=piece, **extra,
                )  # fmt: skip
            for call in delta.tool_calls or []:
                if call.index not in calls:
                    for text in _close(event, current, done):
                        yield text
                    item = call_item(item_id("fc"), call.id or "", call.function.name or "", "",
                                     status="in_progress")  # fmt: skip
                    current = calls[call.index] = _OpenItem(len(done), item)
                    yield event("response.output_item.added", output_index=current.index,
                                item=item)  # fmt: skip
                if call.function.arguments:
                    open_call = calls[call.index]
                    open_call.text.append(call.function.arguments)
                    yield event(
                        "response.function_call_arguments.delta", item_id=open_call.item["id"],
                        output_index=open_call.index, delta=call.function.arguments,
                    )  # fmt: skip
        for text in _close(event, current, done):
            yield text
    except APIError as error:  # OpenAI's error event: its code, message and param
        info = error.info
        yield event("error", code=info.code, message=info.message, param=info.param)
        return
    response = shell.finished(done, finish_reason, generation.usage())
    on_finished(response)  # before the last event: a client may hang up once it has it
    yield event("response.completed", response=response)


def _new_item(kind: str) -> dict[str, Any]:
    if kind == "reasoning":
        return reasoning_item(item_id("rs"), "", status="in_progress")
    return message_item(item_id("msg"), "", status="in_progress")


def _opened(event: _Events, open_item: _OpenItem) -> Iterator[str]:
    item = open_item.item
    yield event("response.output_item.added", output_index=open_item.index, item=item)
    if item["type"] == "message":
        yield event(
            "response.content_part.added", item_id=item["id"], output_index=open_item.index,
            content_index=0, part=text_part(""),
        )  # fmt: skip


def _close(
    event: _Events, open_item: _OpenItem | None, done: list[dict[str, Any]]
) -> Iterator[str]:
    """The events that end an open item, which joins `done` whole (once)."""
    if open_item is None or open_item.item["status"] == "completed":
        return
    item, text = open_item.item, "".join(open_item.text)
    where = {"item_id": item["id"], "output_index": open_item.index}
    if item["type"] == "message":
        yield event("response.output_text.done", **where, content_index=0, text=text, logprobs=[])
        yield event("response.content_part.done", **where, content_index=0, part=text_part(text))
        finished = message_item(item["id"], text)
    elif item["type"] == "reasoning":
        yield event("response.reasoning_text.done", **where, content_index=0, text=text)
        finished = reasoning_item(item["id"], text)
    else:
        yield event(
            "response.function_call_arguments.done", **where, name=item["name"], arguments=text
        )
        finished = call_item(item["id"], item["call_id"], item["name"], text)
    open_item.item = finished
    done.append(finished)
    yield event("response.output_item.done", output_index=open_item.index, item=finished)
