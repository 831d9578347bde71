"""`POST /v1/completions`: text (or token-id) prompts in, OpenAI completion objects out.

Everything that can be refused is refused before the first byte of a stream is sent (model
name, prompt length, sampling values, engine rejection, overload), so those failures are
plain 4xx/503 responses rather than errors buried in an event stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedkv.server.errors import APIError
from pagedkv.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
)
from pagedkv.server.serving import (
    CLIENT_CLOSED_REQUEST,
    SSE_DONE,
    ChoiceDelta,
    EventStream,
    Generation,
    ServingContext,
    new_id,
    now,
    parse_body,
    sampling_params,
    sse,
    top_logprobs,
    until_disconnect,
)


async def create_completion(context: ServingContext, raw: Request) -> Response:
    """Validate, submit, then stream or collect the completion."""
    request = parse_body(await raw.body(), CompletionRequest)
    context.check_model(request.model)
    prompts = await asyncio.to_thread(_token_ids, context, request.prompts())
    max_tokens = request.max_tokens
    if max_tokens is None:
        max_tokens = context.default_max_tokens(max(len(prompt) for prompt in prompts))
    params = sampling_params(request, max_tokens, request.logprobs)
    generation = Generation(context.engine_loop, new_id("cmpl"), request.n)
    await generation.start(prompts, params)
    response = _Response(context, request, generation)
    if request.stream:
        return EventStream(response.stream(), on_close=generation.close)
    try:
        body = await until_disconnect(raw, response.collect())
    finally:
        generation.close()
    if body is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(body.model_dump())


def _token_ids(context: ServingContext, prompts: list[str | list[int]]) -> list[list[int]]:
    """Tokenize text prompts here, in a worker thread, rather than on the engine thread."""
    return [context.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]


@dataclass
class _Choice:
    """One choice being assembled from its deltas."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: CompletionLogprobs | None = None
    text_offset: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _Response:
    """Turns a Generation's deltas into completion objects or stream chunks."""

    def __init__(
        self, context: ServingContext, request: CompletionRequest, generation: Generation
    ) -> None:
        self.context = context
        self.request = request
        self.generation = generation
        self.created = now()
        self.choices: dict[int, _Choice] = {}

    async def collect(self) -> CompletionResponse:
        """The whole completion, once every choice has finished."""
        async for delta in self.generation.deltas():
            self._update(delta)
        return self._object(
            [
                CompletionChoice(
                    index=choice.index,
                    text="".join(choice.text),
                    logprobs=choice.logprobs,
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                )
                for choice in sorted(self.choices.values(), key=lambda choice: choice.index)
            ],
            usage=True,
        )

    async def stream(self) -> AsyncIterator[str]:
        """Server-sent chunks: one per choice delta, then usage if asked, then [DONE]."""
        try:
            async for delta in self.generation.deltas():
                output = delta.output
                if not (output.text or output.token_ids or output.finish_reason):
                    continue
                choice = CompletionChoice(
                    index=delta.index,
                    text=output.text,
                    logprobs=self._update(delta),
                    finish_reason=output.finish_reason,
                    stop_reason=output.stop_reason,
                )
                yield sse(self._object([choice]).model_dump_json())
            options = self.request.stream_options
            if options is not None and options.include_usage:
                yield sse(self._object([], usage=True).model_dump_json())
        except APIError as error:
            yield sse(ErrorResponse(error=error.info).model_dump_json())
        yield SSE_DONE

    def _update(self, delta: ChoiceDelta) -> CompletionLogprobs | None:
        """Fold a delta into its choice; return the delta's own logprobs (if requested)."""
        choice = self.choices.setdefault(delta.index, _Choice(delta.index))
        output = delta.output
        choice.text.append(output.text)
        if output.finish_reason is not None:
            choice.finish_reason = output.finish_reason
            choice.stop_reason = output.stop_reason
        if self.request.logprobs is None:
            return None
        logprobs = self._logprobs(choice, output.token_ids, output.logprobs or [])
        if choice.logprobs is None:
            choice.logprobs = CompletionLogprobs()
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(choice.logprobs, name).extend(getattr(logprobs, name))
        return logprobs

    def _logprobs(
        self, choice: _Choice, token_ids: list[int], positions: list[dict]
    ) -> CompletionLogprobs:
        k = self.request.logprobs or 0
        logprobs = CompletionLogprobs()
        for token_id, position in zip(token_ids, positions, strict=True):
            chosen = position[token_id]
            text = chosen.decoded_token
            logprobs.tokens.append(text)
            logprobs.token_logprobs.append(chosen.logprob)
            top: dict[str, float] = {}
            for alt in top_logprobs(position, k):  # most likely first: it keeps a shared text
                top.setdefault(alt.decoded_token, alt.logprob)
            logprobs.top_logprobs.append(top)
            logprobs.text_offset.append(choice.text_offset)
            choice.text_offset += len(text)
        return logprobs

    def _object(self, choices: list[CompletionChoice], usage: bool = False) -> CompletionResponse:
        return CompletionResponse(
            id=self.generation.request_id,
            created=self.created,
            model=self.context.model_name,
            choices=choices,
            usage=self.generation.usage() if usage else None,
        )
