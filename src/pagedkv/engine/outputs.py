"""What the engine hands back: per-request outputs, per-sample completions, logprobs, timings.

Shapes and names follow vLLM's `RequestOutput` / `CompletionOutput`, so code that reads vLLM
results reads ours. `Engine.step` reports a request as its `SamplingParams.output_kind` says
(vLLM's `RequestOutputKind`): deltas (only what is new since the last step, `Engine`'s
default), the whole output so far (`LLMEngine`'s default, as vLLM's), or the whole output
once, when it finishes. `LLM.generate` accumulates deltas into whole outputs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from pagedkv.engine.lora_request import LoRARequest

FinishReason = Literal["stop", "length", "abort"]


class RequestOutputKind(enum.IntEnum):
    """What `Engine.step` reports of a request each step (vLLM's names and values)."""

    CUMULATIVE = 0  # the whole output so far
    DELTA = 1  # what is new since the last report
    FINAL_ONLY = 2  # nothing until it finishes, then the whole output


@dataclass(frozen=True)
class Logprob:
    """Log-probability of one token, its rank among all tokens (1 = most likely), its text
    (None where the request asked for no text: `detokenize=False`)."""

    logprob: float
    rank: int
    decoded_token: str | None


# One entry per generated token: the chosen token and the top-k alternatives, by token id.
TokenLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One sample of a request: its text, token ids, finish reason and logprobs."""

    # vLLM's order, so code that builds one positionally (mocks, adapters) means the same.
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    lora_request: LoRARequest | None = None  # the adapter it ran with (vLLM's)

    def finished(self) -> bool:
        """True once the sample has a finish reason (a method, as vLLM's is)."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic) and memory events of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_swap_preemptions: int = 0
    num_recompute_preemptions: int = 0


@dataclass
class RequestOutput:
    """A request's prompt and its samples: a delta from `Engine.step`, whole from `generate`."""

    # vLLM's order of the first eight, so positional construction means the same.
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # With SamplingParams.prompt_logprobs: per prompt token, its logprob and the top-k (the
    # first is None), in the delta that carries the first sampled token (and the whole output).
    prompt_logprobs: list[TokenLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(repr=False, default=None)  # type: ignore[assignment]
    lora_request: LoRARequest | None = None  # the adapter the request ran with (vLLM's)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (vLLM's)


def empty_like(delta: RequestOutput) -> RequestOutput:
    """A whole output to accumulate `delta`'s request into: its prompt, no samples yet."""
    return RequestOutput(
        request_id=delta.request_id,
        prompt=delta.prompt,
        prompt_token_ids=delta.prompt_token_ids,
        prompt_logprobs=delta.prompt_logprobs,
        outputs=[],
        finished=False,
        metrics=delta.metrics,
        lora_request=delta.lora_request,
        num_cached_tokens=delta.num_cached_tokens,
    )


def accumulate(whole: RequestOutput, delta: RequestOutput) -> None:
    """Add a step's delta to the request's whole output (samples kept in index order)."""
    by_index = {output.index: output for output in whole.outputs}
    for piece in delta.outputs:
        output = by_index.get(piece.index)
        if output is None:
            output = CompletionOutput(
                index=piece.index, text="", token_ids=[], lora_request=piece.lora_request
            )
            if piece.logprobs is not None:
                output.logprobs = []
            by_index[piece.index] = output
        output.text += piece.text
        output.token_ids.extend(piece.token_ids)
        if piece.logprobs is not None and output.logprobs is not None:
            output.logprobs.extend(piece.logprobs)
        output.cumulative_logprob = piece.cumulative_logprob
        output.finish_reason = piece.finish_reason
        output.stop_reason = piece.stop_reason
    whole.outputs = [by_index[index] for index in sorted(by_index)]
    whole.finished = delta.finished
    whole.metrics = delta.metrics
    whole.num_cached_tokens = delta.num_cached_tokens
    if delta.prompt_logprobs is not None:
        whole.prompt_logprobs = delta.prompt_logprobs


def report(
    delta: RequestOutput, kind: RequestOutputKind | None, whole: RequestOutput | None
) -> tuple[RequestOutput | None, RequestOutput | None]:
    """What a step reports of a request given its `delta` and output `kind` (None: the
    engine's deltas) -- None: nothing this step -- and the whole output to keep for its next
    step (None for deltas). A cumulative report is a copy: later steps do not change what
    the caller holds."""
    if kind in (None, RequestOutputKind.DELTA):
        return delta, None
    whole = whole or empty_like(delta)
    accumulate(whole, delta)
    if kind is RequestOutputKind.FINAL_ONLY and not delta.finished:
        return None, whole
    outputs = [
        replace(
            output,
            token_ids=list(output.token_ids),
            logprobs=None if output.logprobs is None else list(output.logprobs),
        )
        for output in whole.outputs
    ]
    return replace(whole, outputs=outputs, metrics=replace(whole.metrics)), whole
