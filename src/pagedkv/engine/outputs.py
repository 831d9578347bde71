"""What the engine hands back: per-request outputs, per-sample completions, logprobs, timings.

Shapes and names follow vLLM's `RequestOutput` / `CompletionOutput`, so code that reads vLLM
results reads ours. `Engine.step` returns deltas (only what is new since the last step);
`LLM.generate` accumulates them into whole outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from pagedkv.engine.lora_request import LoRARequest

FinishReason = Literal["stop", "length", "abort"]


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
