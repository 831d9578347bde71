"""The plain data of one step, as the scheduler hands it to the runner.

Defined beside the runner, which executes it, and below the engine, which makes it: ints,
lists and small dataclasses only, so a step can later be broadcast from one scheduler to a
runner per tensor-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pagedkv.memory import MemoryPlan
from pagedkv.memory.adapters import AdapterChanges

PreemptionMode = Literal["swap", "recompute"]


@dataclass(frozen=True)
class ScheduledChunk:
    """New tokens of one sequence to compute this step.

    `table_update` is `(first, block_ids)` when the sequence's block table changed since the
    runner last saw it: entries from `first` on (the whole table for a sequence new to the
    runner). `sample` is True when the chunk ends at the sequence's last token: its logits
    choose the sequence's next token. `num_logits` is how many of its last tokens need logits:
    1 for a sampling chunk, 0 for a prompt chunk, every token of a chunk of a request that
    asks for prompt logprobs (a position's logits score the next prompt token).

    With speculative decoding, the last `num_draft_tokens` tokens are drafts, not yet part of
    the sequence: the chunk is its last token and the drafts, each position with logits, and
    the step keeps the drafts its sampling would have produced.
    """

    seq_id: tuple[str, int]
    token_ids: list[int]
    num_computed: int
    table_update: tuple[int, list[int]] | None
    sample: bool
    num_logits: int
    num_draft_tokens: int = 0
    lora_id: int = 0  # the LoRA adapter its rows go through (0: none)


@dataclass
class SchedulerOutput:
    """One step's work: the chunks to compute and the memory plan to execute first.

    `dropped` names the sequences whose block tables the runner forgets first: freed,
    preempted or swapped out since the last step. `adapters` says which LoRA adapters left the
    pool and which were given blocks (their weights written after the plan has run).
    """

    chunks: list[ScheduledChunk] = field(default_factory=list)
    plan: MemoryPlan = field(default_factory=MemoryPlan)
    preempted: list[tuple[str, PreemptionMode]] = field(default_factory=list)
    dropped: list[tuple[str, int]] = field(default_factory=list)
    adapters: AdapterChanges = field(default_factory=AdapterChanges)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens the forward pass computes."""
        return sum(len(chunk.token_ids) for chunk in self.chunks)

    @property
    def decodes_only(self) -> bool:
        """Whether every chunk is a decode: one token, and its drafts if it has any."""
        return bool(self.chunks) and all(
            len(chunk.token_ids) == 1 + chunk.num_draft_tokens for chunk in self.chunks
        )
