"""What executing a step produced, as `Scheduler.update` consumes it: plain data.

The step flows one way: `Scheduler.schedule()` -> `SchedulerOutput` -> the executor (forward
pass, then sampling) -> `ModelRunnerOutput` -> `Scheduler.update(...)`, which calls nobody
back (vLLM's `schedule()` / `update_from_output()` contract). The simulator makes the same
object up, with no model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.engine.outputs import TokenLogprobs

SeqId = tuple[str, int]


@dataclass(frozen=True)
class SampledToken:
    """One sample's next token, and its logprob entry (chosen token first) when asked for."""

    token_id: int
    logprobs: TokenLogprobs | None = None


@dataclass
class ModelRunnerOutput:
    """One executed step.

    `sampled`: per sample that drew a token, by sequence id, in chunk order (the samples of a
    prompt that just finished all draw from its row, sample 0 first). `prompt_logprobs`: per
    request that scores its prompt, the entries this step scored, in prompt order.
    `logits_rows`: per scheduled chunk, its rows of the step's logits (where the batch was
    built).
    """

    sampled: dict[SeqId, SampledToken] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    logits_rows: list[range] = field(default_factory=list)
