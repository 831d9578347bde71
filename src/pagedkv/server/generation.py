"""A `Generation`: one HTTP request's engine requests (one per prompt, each with `n` samples)
read back as one stream of per-choice deltas.

It aborts whatever is still running when it is closed early (client gone, handler cancelled),
which frees the blocks before the next step. Its engine requests carry the HTTP request's
arrival time (`ARRIVAL_TIME`, set by the route before the body is read), so latency metrics
include the server's own queueing, as vLLM's do.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pagedkv.engine.errors import InvalidStructuredOutput, PromptTooLong, RequestRejected
from pagedkv.server.engine_loop import EngineFailed, EngineLoop, Overloaded, ShuttingDown
from pagedkv.server.errors import APIError
from pagedkv.server.responses import PromptTokensDetails, Usage
from pagedkv.server.serving import check_room, request_field, shutting_down

if TYPE_CHECKING:
    from pagedkv.engine import (
        BeamSearchParams,
        CompletionOutput,
        LoRARequest,
        RequestOutput,
        SamplingParams,
    )
    from pagedkv.engine.outputs import TokenLogprobs
    from pagedkv.server.protocol import SamplingFields

RETRY_AFTER_S = 1
# When the HTTP request being handled arrived (time.monotonic); a context variable because the
# endpoints receive only the raw request, and the route sets it before anything else.
ARRIVAL_TIME: ContextVar[float | None] = ContextVar("arrival_time", default=None)


@dataclass
class ChoiceDelta:
    """What one step added to one choice."""

    index: int
    output: CompletionOutput
    # The prompt's logprobs (SamplingParams.prompt_logprobs) and token ids, on the delta that
    # brings them.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_token_ids: list[int] | None = None


class Generation:
    """One HTTP request's engine requests, merged into one stream of choice deltas."""

    def __init__(
        self,
        engine_loop: EngineLoop,
        request_id: str,
        n: int,
        lora_request: LoRARequest | None = None,
        prompt_only: bool = False,
    ) -> None:
        self.engine_loop = engine_loop
        # Score the prompts only (vLLM's echo with max_tokens 0): the engine samples one token
        # per choice, as it must, and every delta leaves it out; the choices end on "length".
        self.prompt_only = prompt_only
        self.lora_request = lora_request  # the adapter the request's `model` names
        self.request_id = request_id
        self.n = n
        self.arrival_time = ARRIVAL_TIME.get() or time.monotonic()
        self._outputs: asyncio.Queue = asyncio.Queue()
        self._prompt_index: dict[str, int] = {}
        self._unfinished: set[str] = set()
        self.prompts: list[list[int]] = []  # as submitted, by prompt index
        self.params: SamplingParams | None = None  # as submitted (defaults filled in)
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0

    def served_name(self, model_name: str) -> str:
        """The `model` a response names: the adapter asked for, else the served model."""
        return model_name if self.lora_request is None else self.lora_request.lora_name

    async def start(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        request: SamplingFields,
        beam_search: BeamSearchParams | None = None,
        asked_max_tokens: int | None = None,
    ) -> None:
        """Submit every prompt with `request`'s priority and cache salt (as a beam search
        with `beam_search`; prefix-cache blocks shared only under the same salt); refusals
        become 4xx/503, naming the field the request sent, and abort the prompts already
        queued. `asked_max_tokens`, the client's own max_tokens, is a 400 where the context
        cannot hold it (a default, or the model's recommended cap, is cut to the room
        instead, by the engine).

        More prompts than may ever be queued at once (the batch's seats, then --max-waiting)
        is a 400: a 503 would have the client retry a request that can never be admitted.
        """
        max_waiting = self.engine_loop.max_waiting
        seats = self.engine_loop.engine.args.max_num_seqs
        samples = params.n if beam_search is None else beam_search.beam_width
        room = seats // samples + (max_waiting or 0)
        if max_waiting is not None and len(prompts) > room:
            raise APIError(
                400,
                f"{len(prompts)} prompts in one request, but at most {room} may be queued at "
                f"once ({samples} samples each: --max-num-seqs {seats} running, then "
                f"--max-waiting {max_waiting} waiting)",
                param="prompt",
            )
        max_model_len = self.engine_loop.engine.max_model_len
        asked_in = request_field(request, "max_tokens")
        for prompt in prompts:
            check_room(len(prompt), asked_max_tokens, max_model_len, asked_in)
        self.prompts = prompts
        self.params = params
        try:
            for index, prompt in enumerate(prompts):
                engine_id = f"{self.request_id}-{index}" if len(prompts) > 1 else self.request_id
                self._prompt_index[engine_id] = index
                self._unfinished.add(engine_id)
                await self.engine_loop.add(
                    engine_id,
                    prompt,
                    params,
                    self._outputs,
                    request.priority,
                    self.arrival_time,
                    beam_search,
                    self.lora_request,
                    request.cache_salt,
                )
                self.prompt_tokens += len(prompt)
        except BaseException as error:
            self.close()
            if isinstance(error, Overloaded):
                raise APIError(
                    503,
                    str(error),
                    type="server_error",
                    code="overloaded",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                ) from error
            if isinstance(error, EngineFailed):
                raise APIError(503, str(error), type="server_error") from error
            if isinstance(error, ShuttingDown):
                raise shutting_down(str(error)) from error
            if isinstance(error, RequestRejected):
                code = "context_length_exceeded" if isinstance(error, PromptTooLong) else None
                param = None if error.param is None else request_field(request, error.param)
                message = str(error)
                if param == "tool_choice" and isinstance(error, InvalidStructuredOutput):
                    # The client sent tools, not a structured output: name what it sent.
                    message = f"the tools' parameters cannot hold a call to them: {error.reason}"
                raise APIError(400, message, param=param, code=code) from error
            raise

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Every choice's deltas as they arrive, until all requests have finished."""
        while self._unfinished:
            item = await self._outputs.get()
            if isinstance(item, (ShuttingDown, EngineFailed)):
                # The response fails whole: its other prompts' requests stop too, not run on
                # for nobody holding blocks.
                self.close()
                if isinstance(item, ShuttingDown):
                    raise shutting_down(str(item))
                raise APIError(500, str(item), type="server_error")
            output: RequestOutput = item
            base = self._prompt_index[output.request_id] * self.n
            for completion in output.outputs:
                if self.prompt_only:
                    completion = _without_tokens(completion)
                self.completion_tokens += len(completion.token_ids)
                scored = output.prompt_logprobs
                prompt_ids = output.prompt_token_ids if scored is not None else None
                yield ChoiceDelta(base + completion.index, completion, scored, prompt_ids)
            if output.finished:
                self._unfinished.discard(output.request_id)
                self.cached_tokens += output.metrics.num_cached_tokens

    def close(self) -> None:
        """Abort whatever has not finished (safe to call more than once)."""
        for engine_id in self._unfinished:
            self.engine_loop.abort(engine_id)
        self._unfinished.clear()

    def usage(self) -> Usage:
        """Token counts so far, over every prompt and choice."""
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
        )


def _without_tokens(output: CompletionOutput) -> CompletionOutput:
    """A prompt-only choice's delta: no text, tokens or logprobs; once finished, by length."""
    return replace(
        output,
        text="",
        token_ids=[],
        finish_reason="length" if output.finish_reason is not None else None,
        stop_reason=None,
        logprobs=None if output.logprobs is None else [],
        cumulative_logprob=None if output.cumulative_logprob is None else 0.0,
    )
