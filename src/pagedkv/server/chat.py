"""`POST /v1/chat/completions`: a conversation rendered by the model's chat template.

As for completions, every refusal happens before a stream starts. A streamed choice begins
with a role-only delta and ends with a chunk carrying its finish reason, as OpenAI's does.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from pagedkv.model.errors import ChatTemplateError
from pagedkv.server.choices import ChoiceAssembler, ChoiceState
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
    TokenLogprob,
    TopLogprob,
)
from pagedkv.server.serving import (
    ChoiceDelta,
    Generation,
    ServingContext,
    new_id,
    sampling_params,
    sse,
    top_logprobs,
)

if TYPE_CHECKING:
    from pagedkv.engine import CompletionOutput


async def create_chat_completion(context: ServingContext, raw: Request) -> Response:
    """Validate, render the conversation, submit, then stream or collect."""
    request = context.parse(await raw.body(), ChatCompletionRequest)
    if request.top_logprobs is not None and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    prompt = await asyncio.to_thread(_render, context, request)
    max_tokens = request.requested_max_tokens()  # None: the room the context leaves
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    params = sampling_params(request, max_tokens, logprobs)
    generation = Generation(context.engine_loop, new_id("chatcmpl"), request.n)
    await generation.start([prompt], params, request.priority)
    return await _ChatCompletion(context, request, generation).respond(raw)


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
class _Choice(ChoiceState):
    """One chat choice: its message text, plus its token logprobs (if requested)."""

    logprobs: list[TokenLogprob] = field(default_factory=list)


class _ChatCompletion(ChoiceAssembler[ChatCompletionRequest, _Choice, list[TokenLogprob]]):
    """Turns a Generation's deltas into a chat completion or stream chunks."""

    choice_type = _Choice

    def _opening(self) -> list[str]:
        """A role-only delta per choice, as OpenAI's streams begin."""
        return [
            self._chunk(
                [ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))]
            )
            for index in range(self.request.n)
        ]

    def _logprobs(self, choice: _Choice, output: CompletionOutput) -> list[TokenLogprob]:
        if not self.request.logprobs:
            return []
        k = self.request.top_logprobs or 0
        token_bytes = self.context.token_bytes
        entries = []
        for token_id, position in zip(output.token_ids, output.logprobs or [], strict=True):
            chosen = position[token_id]
            top = [
                TopLogprob(
                    token=alt.decoded_token, logprob=alt.logprob, bytes=list(token_bytes(alt_id))
                )
                for alt_id, alt in top_logprobs(position, k)
            ]
            entries.append(
                TokenLogprob(
                    token=chosen.decoded_token,
                    logprob=chosen.logprob,
                    bytes=list(token_bytes(token_id)),
                    top_logprobs=top,
                )
            )
        choice.logprobs.extend(entries)
        return entries

    def _chunk_choice(self, delta: ChoiceDelta, logprobs: list[TokenLogprob]) -> ChatChunkChoice:
        output = delta.output
        return ChatChunkChoice(
            index=delta.index,
            delta=ChatDelta(content=output.text),
            logprobs=ChatLogprobs(content=logprobs) if self.request.logprobs else None,
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
        )

    def _chunk(self, choices: list[ChatChunkChoice], usage: bool = False) -> str:
        chunk = ChatCompletionChunk(
            id=self.generation.request_id,
            created=self.created,
            model=self.context.model_name,
            system_fingerprint=self.context.system_fingerprint,
            choices=choices,
            usage=self.generation.usage() if usage else None,
        )
        # Every choice says `finish_reason: null` and `logprobs: null` until it has them, as
        # OpenAI's chunks do; the usage appears only in the chunk that carries it.
        return sse(chunk.model_dump_json(exclude=None if usage else {"usage"}))

    def _response(self, choices: list[_Choice]) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=self.generation.request_id,
            created=self.created,
            model=self.context.model_name,
            system_fingerprint=self.context.system_fingerprint,
            choices=[
                ChatChoice(
                    index=choice.index,
                    message=AssistantMessage(content="".join(choice.text)),
                    logprobs=ChatLogprobs(content=choice.logprobs)
                    if self.request.logprobs
                    else None,
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                )
                for choice in choices
            ],
            usage=self.generation.usage(),
            prompt_logprobs=self._prompt_logprobs(0),
        )
