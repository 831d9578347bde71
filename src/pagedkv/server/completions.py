"""`POST /v1/completions`: text (or token-id) prompts in, OpenAI completion objects out.

Everything that can be refused is refused before the first byte of a stream is sent (model
name, prompt length, sampling values, engine rejection, overload), so those failures are
plain 4xx/503 responses rather than errors buried in an event stream.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from pagedkv.server.choices import ChoiceAssembler, ChoiceState
from pagedkv.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from pagedkv.server.serving import (
    ChoiceDelta,
    Generation,
    ServingContext,
    new_id,
    parse_body,
    sampling_params,
    sse,
    top_logprobs,
)

if TYPE_CHECKING:
    from pagedkv.engine import CompletionOutput


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
    await generation.start(prompts, params, request.priority)
    return await _Completion(context, request, generation).respond(raw)


def _token_ids(context: ServingContext, prompts: list[str | list[int]]) -> list[list[int]]:
    """Tokenize text prompts here, in a worker thread, rather than on the engine thread."""
    return [context.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]


@dataclass
class _Choice(ChoiceState):
    """One completion choice: its text, plus the legacy logprobs lists (if requested)."""

    logprobs: CompletionLogprobs | None = None
    text_offset: int = 0


class _Completion(ChoiceAssembler[CompletionRequest, _Choice, CompletionLogprobs | None]):
    """Turns a Generation's deltas into completion objects or stream chunks."""

    choice_type = _Choice

    def _logprobs(self, choice: _Choice, output: CompletionOutput) -> CompletionLogprobs | None:
        if self.request.logprobs is None:
            return None
        k = self.request.logprobs
        logprobs = CompletionLogprobs()
        for token_id, position in zip(output.token_ids, output.logprobs or [], strict=True):
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
        if choice.logprobs is None:
            choice.logprobs = CompletionLogprobs()
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(choice.logprobs, name).extend(getattr(logprobs, name))
        return logprobs

    def _chunk_choice(
        self, delta: ChoiceDelta, logprobs: CompletionLogprobs | None
    ) -> CompletionChoice:
        output = delta.output
        return CompletionChoice(
            index=delta.index,
            text=output.text,
            logprobs=logprobs,
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
        )

    def _chunk(self, choices: list[CompletionChoice], usage: bool = False) -> str:
        return sse(self._object(choices, usage).model_dump_json())

    def _response(self, choices: list[_Choice]) -> CompletionResponse:
        return self._object(
            [
                CompletionChoice(
                    index=choice.index,
                    text="".join(choice.text),
                    logprobs=choice.logprobs,
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                )
                for choice in choices
            ],
            usage=True,
        )

    def _object(self, choices: list[CompletionChoice], usage: bool = False) -> CompletionResponse:
        return CompletionResponse(
            id=self.generation.request_id,
            created=self.created,
            model=self.context.model_name,
            choices=choices,
            usage=self.generation.usage() if usage else None,
        )
