"""`POST /v1/chat/completions`: a conversation rendered by the model's chat template.

As for completions, every refusal happens before a stream starts. A streamed choice begins
with a role-only delta and ends with a chunk carrying its finish reason, as OpenAI's does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedkv.model.errors import ChatTemplateError
from pagedkv.server.errors import APIError
from pagedkv.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ErrorResponse,
    TokenLogprob,
    TopLogprob,
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


async def create_chat_completion(context: ServingContext, raw: Request) -> Response:
    """Validate, render the conversation, submit, then stream or collect."""
    request = parse_body(await raw.body(), ChatCompletionRequest)
    context.check_model(request.model)
    if request.top_logprobs is not None and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    prompt = await asyncio.to_thread(_render, context, request)
    max_tokens = request.requested_max_tokens()  # None: the room the context leaves
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    params = sampling_params(request, max_tokens, logprobs)
    generation = Generation(context.engine_loop, new_id("chatcmpl"), request.n)
    await generation.start([prompt], params)
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


def _render(context: ServingContext, request: ChatCompletionRequest) -> list[int]:
    """Token ids of the conversation plus the assistant's generation prompt."""
    messages = [
        # Templates predate OpenAI's "developer" role: it plays the system prompt's part.
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in request.messages
    ]
    try:
        return context.tokenizer.encode_chat(messages)
    except ChatTemplateError as error:
        raise APIError(400, str(error), param="messages") from error


@dataclass
class _Choice:
    """One choice being assembled from its deltas."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _Response:
    """Turns a Generation's deltas into a chat completion or stream chunks."""

    def __init__(
        self, context: ServingContext, request: ChatCompletionRequest, generation: Generation
    ) -> None:
        self.context = context
        self.request = request
        self.generation = generation
        self.created = now()
        self.choices: dict[int, _Choice] = {}

    async def collect(self) -> ChatCompletionResponse:
        """The whole chat completion, once every choice has finished."""
        async for delta in self.generation.deltas():
            self._update(delta)
        choices = [
            ChatChoice(
                index=choice.index,
                message=AssistantMessage(content="".join(choice.text)),
                logprobs=ChatLogprobs(content=choice.logprobs) if self.request.logprobs else None,
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
            )
            for choice in sorted(self.choices.values(), key=lambda choice: choice.index)
        ]
        return ChatCompletionResponse(
            id=self.generation.request_id,
            created=self.created,
            model=self.context.model_name,
            choices=choices,
            usage=self.generation.usage(),
        )

    async def stream(self) -> AsyncIterator[str]:
        """A role delta per choice, content deltas, finish chunks, usage if asked, [DONE]."""
        try:
            for index in range(self.request.n):
                opening = ChatChunkChoice(
                    index=index, delta=ChatDelta(role="assistant", content="")
                )
                yield self._chunk([opening])
            async for delta in self.generation.deltas():
                output = delta.output
                if not (output.text or output.token_ids or output.finish_reason):
                    continue
                logprobs = self._update(delta)
                choice = ChatChunkChoice(
                    index=delta.index,
                    delta=ChatDelta(content=output.text),
                    logprobs=ChatLogprobs(content=logprobs) if self.request.logprobs else None,
                    finish_reason=output.finish_reason,
                    stop_reason=output.stop_reason,
                )
                yield self._chunk([choice])
            options = self.request.stream_options
            if options is not None and options.include_usage:
                yield self._chunk([], usage=True)
        except APIError as error:
            yield sse(ErrorResponse(error=error.info).model_dump_json())
        yield SSE_DONE

    def _chunk(self, choices: list[ChatChunkChoice], usage: bool = False) -> str:
        chunk = ChatCompletionChunk(
            id=self.generation.request_id,
            created=self.created,
            model=self.context.model_name,
            choices=choices,
            usage=self.generation.usage() if usage else None,
        )
        return sse(chunk.model_dump_json(exclude_none=True))

    def _update(self, delta: ChoiceDelta) -> list[TokenLogprob]:
        """Fold a delta into its choice; return the delta's own logprobs (if requested)."""
        choice = self.choices.setdefault(delta.index, _Choice(delta.index))
        output = delta.output
        choice.text.append(output.text)
        if output.finish_reason is not None:
            choice.finish_reason = output.finish_reason
            choice.stop_reason = output.stop_reason
        if not self.request.logprobs:
            return []
        logprobs = self._logprobs(output.token_ids, output.logprobs or [])
        choice.logprobs.extend(logprobs)
        return logprobs

    def _logprobs(self, token_ids: list[int], positions: list[dict]) -> list[TokenLogprob]:
        k = self.request.top_logprobs or 0
        entries = []
        for token_id, position in zip(token_ids, positions, strict=True):
            chosen = position[token_id]
            top = [
                TopLogprob(
                    token=alt.decoded_token,
                    logprob=alt.logprob,
                    bytes=list(alt.decoded_token.encode()),
                )
                for alt in top_logprobs(position, k)
            ]
            entries.append(
                TokenLogprob(
                    token=chosen.decoded_token,
                    logprob=chosen.logprob,
                    bytes=list(chosen.decoded_token.encode()),
                    top_logprobs=top,
                )
            )
        return entries
