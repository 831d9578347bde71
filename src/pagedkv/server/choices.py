"""A Generation's choice deltas assembled into one OpenAI response, collected or streamed.

Completions and chat differ only in the objects they build and in how they report logprobs.
What they share lives here: folding each delta into its choice, the order of a stream's events
(opening chunks, a chunk per non-empty delta, usage if asked, an error event if the engine
fails mid-stream, then [DONE]) and closing the generation however the response ends.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedkv.server.errors import APIError
from pagedkv.server.generation import ChoiceDelta, Generation
from pagedkv.server.protocol import SamplingFields
from pagedkv.server.responses import ErrorResponse, PromptLogprobs, Usage
from pagedkv.server.serving import (
    CLIENT_CLOSED_REQUEST,
    SSE_DONE,
    EventStream,
    ServingContext,
    now,
    prompt_logprobs_json,
    sse,
    until_disconnect,
)

if TYPE_CHECKING:
    from pagedkv.engine import CompletionOutput
    from pagedkv.engine.outputs import TokenLogprobs

ChoiceT = TypeVar("ChoiceT", bound="ChoiceState")
RequestT = TypeVar("RequestT", bound=SamplingFields)
LogprobsT = TypeVar("LogprobsT")
ChunkT = TypeVar("ChunkT", bound="ChunkChoice")


class ChoiceAssembler(ABC, Generic[RequestT, ChoiceT, LogprobsT, ChunkT]):
    """Turns a Generation's deltas into one response object or its stream chunks.

    A subclass names its `choice_type` and builds the endpoint's objects: `_logprobs` (a
    delta's logprobs, also folded into its choice), `_chunk_choice` and `_chunk` (a stream
    chunk), `_response` (the whole answer) and, if its stream opens with chunks, `_opening`.
    """

    choice_type: type[ChoiceT]

    def __init__(self, context: ServingContext, request: RequestT, generation: Generation) -> None:
        self.context = context
        self.request = request
        self.generation = generation
        self.created = now()
        self.choices: dict[int, ChoiceT] = {}
        # Each prompt's logprobs and token ids, once the engine has scored it (by prompt index).
        self.prompt_entries: dict[int, list[TokenLogprobs | None]] = {}
        self.prompt_ids: dict[int, list[int]] = {}

    async def respond(self, raw: Request) -> Response:
        """Stream or collect, as the request asks; the generation is closed however it ends."""
        if self.request.stream:
            return EventStream(self.stream(), on_close=self.generation.close)
        try:
            body = await until_disconnect(raw, self.collect())
        finally:
            self.generation.close()
        if body is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(body.model_dump())

    async def collect(self) -> BaseModel:
        """The whole response, once every choice has finished."""
        async for delta in self.generation.deltas():
            self._update(delta)
        return self._response(sorted(self.choices.values(), key=lambda choice: choice.index))

    async def stream(self) -> AsyncIterator[str]:
        """Opening chunks, a chunk per non-empty delta, usage if asked, then [DONE]."""
        try:
            for event in self._opening():
                yield event
            options = self.request.stream_options
            async for choice in self.chunk_choices():
                usage = self._choice_usage(choice.index) if self._usage_in_every_chunk else None
                yield self._chunk([choice], usage=usage)
            if options is not None and options.include_usage:
                yield self._chunk([], usage=self.generation.usage())
        except APIError as error:
            yield sse(ErrorResponse(error=error.info).model_dump_json())
        yield SSE_DONE

    async def chunk_choices(self) -> AsyncIterator[ChunkT]:
        """Each non-empty delta as its stream chunk's choice, folded into the choices too."""
        async for delta in self.generation.deltas():
            output = delta.output
            if not (output.text or output.token_ids or output.finish_reason):
                continue
            choice = self._chunk_choice(delta, self._update(delta))
            if choice is not None:
                yield choice

    def _update(self, delta: ChoiceDelta) -> LogprobsT:
        """Fold a delta into its choice (keeping its prompt's logprobs when they come);
        return the delta's own logprobs."""
        self._keep_prompt(delta)
        choice = self.choices.setdefault(delta.index, self.choice_type(delta.index))
        choice.fold(delta.output)
        return self._logprobs(choice, delta.output)

    @property
    def _usage_in_every_chunk(self) -> bool:
        """vLLM's `continuous_usage_stats` (with include_usage): each chunk has its usage."""
        options = self.request.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats

    def _choice_usage(self, index: int) -> Usage:
        """vLLM's continuous usage: choice `index`'s own prompt and its tokens so far."""
        prompt = len(self.generation.prompts[index // self.generation.n])
        completion = len(self.choices[index].token_ids) if index in self.choices else 0
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    def _stream_token_ids(self, delta: ChoiceDelta) -> tuple[list[int] | None, list[int] | None]:
        """With return_token_ids: (the prompt's ids on the choice's first chunk, else None;
        the delta's own ids); (None, None) without."""
        if not self.request.return_token_ids:
            return None, None
        choice = self.choices[delta.index]
        prompt = None
        if not choice.prompt_ids_sent:
            choice.prompt_ids_sent = True
            prompt = self.generation.prompts[delta.index // self.generation.n]
        return prompt, list(delta.output.token_ids)

    def _keep_prompt(self, delta: ChoiceDelta) -> None:
        """Keep the prompt's logprobs and token ids of the delta that brings them."""
        if delta.prompt_logprobs is not None and delta.prompt_token_ids is not None:
            self.prompt_entries[delta.index // self.generation.n] = delta.prompt_logprobs
            self.prompt_ids[delta.index // self.generation.n] = delta.prompt_token_ids

    def _opening(self) -> list[str]:
        """Events a stream starts with, before any delta (none unless overridden)."""
        return []

    def _prompt_logprobs(self, prompt_index: int) -> PromptLogprobs | None:
        """vLLM's `prompt_logprobs` of a prompt, when the request asked for them."""
        k = self.request.prompt_logprobs
        entries = self.prompt_entries.get(prompt_index)
        return None if k is None or entries is None else prompt_logprobs_json(entries, k)

    @abstractmethod
    def _logprobs(self, choice: ChoiceT, output: CompletionOutput) -> LogprobsT:
        """The delta's logprobs in the endpoint's shape, also added to `choice`."""

    @abstractmethod
    def _chunk_choice(self, delta: ChoiceDelta, logprobs: LogprobsT) -> ChunkT | None:
        """One choice's part of a stream chunk (None: this delta adds nothing to send yet)."""

    @abstractmethod
    def _chunk(self, choices: list, usage: Usage | None = None) -> str:
        """One server-sent stream chunk holding `choices` (and `usage`, if given)."""

    @abstractmethod
    def _response(self, choices: list[ChoiceT]) -> BaseModel:
        """The whole response from the finished choices, in index order."""


class ChunkChoice(Protocol):
    """What a stream chunk's choice has for every endpoint: the index of its choice."""

    index: int


@dataclass
class ChoiceState:
    """One choice being assembled from its deltas; subclasses add their logprobs."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_ids_sent: bool = False  # a stream with return_token_ids sent its prompt's ids

    def fold(self, output: CompletionOutput) -> None:
        """Append a delta's text and tokens; keep its finish reason once it has one."""
        self.text.append(output.text)
        self.token_ids.extend(output.token_ids)
        if output.finish_reason is not None:
            self.finish_reason = output.finish_reason
            self.stop_reason = output.stop_reason
