"""What executing a step produced, as `Scheduler.update` consumes it: plain data.

The step flows one way: `Scheduler.schedule()` -> `SchedulerOutput` -> the executor (forward
pass, then sampling) -> `ModelRunnerOutput` -> `Scheduler.update(...)`, which calls nobody
back (vLLM's `schedule()` / `update_from_output()` contract). The simulator makes the same
object up, with no model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.engine.beam_search import Candidate
from pagedkv.engine.outputs import TokenLogprobs

SeqId = tuple[str, int]


@dataclass(frozen=True)
class SampledToken:
    """One sample's next token, and its logprob entry (chosen token first) when asked for."""

    token_id: int
    logprobs: TokenLogprobs | None = None
    exhausted: bool = False  # the sample's settings allowed no token: this one means nothing


@dataclass
class ModelRunnerOutput:
    """One executed step.

    `sampled`: per sample that drew tokens, by sequence id, in chunk order (the samples of a
    prompt that just finished all draw from its row, sample 0 first): one token, or with
    speculative decoding the drafts it kept and the token sampled after them.
    `prompt_logprobs`: per request that scores its prompt, the entries this step scored, in
    prompt order. `logits_rows`: per scheduled chunk, its rows of the step's logits (where the
    batch was built). `draft_token_ids`: per sample that drew tokens, the drafts proposed for
    its next step (none where it drafts nothing). `step_seconds`: how long the step took (None
    where nothing was timed), which tells the scheduler what a row of a step costs.
    """

    sampled: dict[SeqId, list[SampledToken]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    logits_rows: list[range] = field(default_factory=list)
    draft_token_ids: dict[SeqId, list[int]] = field(default_factory=dict)
    step_seconds: float | None = None
    # Beam search: per live beam that computed its next row, the extensions it proposes.
    beam_candidates: dict[SeqId, list[Candidate]] = field(default_factory=dict)
