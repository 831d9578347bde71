"""DraftSlots: the scheduler's side of speculative decoding, the slots of drafts.

A decoding sample with drafts (`Sequence.draft_token_ids`, proposed by the step before) gets a
chunk of its last token and the drafts that pay (`spec/acceptance.py`), in lookahead slots past
its record. After the step, `settle` counts computed what was kept (the accepted drafts and the
token sampled after them); `reserve` gives back the slots of the rejected drafts (`trim`) in the
same step, then reserves the slots of the drafts proposed for the next step, where the pool has
room for them above the watermark (else the sample verifies none). Those reservations are real
blocks that admission and the page map see; their moves and table changes wait here until the
next step's output carries them. `forget` drops a sample's drafts when it is freed or preempted.
"""

from __future__ import annotations

from pagedkv.engine.request import Request, Sequence
from pagedkv.engine.sched.kv_memory import KVMemory
from pagedkv.engine.spec.acceptance import StepCost
from pagedkv.engine.spec.metrics import SpecDecodingStats
from pagedkv.memory import Allocation, MemoryPlan
from pagedkv.worker.step import ScheduledChunk

SeqId = tuple[str, int]


class DraftSlots:
    """Draft reservations over one `KVMemory`, what they kept, and what a step's row costs."""

    def __init__(
        self, manager: KVMemory, watermark_blocks: int, num_speculative_tokens: int
    ) -> None:
        self.manager = manager
        self._watermark_blocks = watermark_blocks
        self._plan = MemoryPlan()  # moves of reservations, run with the next step
        # First table entry changed by a reservation, per sample, until its next chunk says so.
        self._table_changes: dict[SeqId, int] = {}
        self.stats = SpecDecodingStats(num_speculative_tokens)
        self.step_cost = StepCost()  # what a row of a step costs: how many drafts pay

    def threshold(self, num_decoding: int) -> float:
        """The least chance of being kept a draft needs to pay in a step of `num_decoding`
        decoding samples."""
        return self.step_cost.threshold(num_decoding)

    def take_plan(self) -> MemoryPlan:
        """The reservations' moves since the last step, for the next one to run first."""
        plan, self._plan = self._plan, MemoryPlan()
        return plan

    def settle(
        self, seq: Sequence, chunk: ScheduledChunk, num_accepted: int, num_kept: int
    ) -> None:
        """A verified chunk: its last token and the `num_accepted` drafts kept have KV, as far
        as the `num_kept` tokens appended reach (a stop may end the sample sooner)."""
        seq.num_computed = chunk.num_computed + num_kept
        self.manager.mark_computed(seq.seq_id, seq.num_computed)
        self.stats.record(chunk.num_draft_tokens, num_accepted)
        seq.acceptance.record(chunk.num_draft_tokens, num_accepted)

    def reserve(self, request: Request, seq: Sequence, drafts: list[int]) -> None:
        """Give back the slots past the sample's record (rejected drafts), then reserve slots
        for `drafts`, the tokens proposed for its next step: cut to what the sample may still
        produce and its grammar allows, and verified only if the pool holds them above the
        watermark (a reservation must not preempt anyone)."""
        self._give_back(seq)
        held = self.manager.num_tokens(seq.seq_id)
        if not seq.acceptance.drafting:
            drafts = []
        drafts = drafts[: max(0, request.max_tokens - seq.num_output_tokens - 1)]
        if drafts and seq.grammar is not None and min(drafts) >= 0:  # not placeholders
            drafts = drafts[: seq.grammar.valid_prefix(drafts)]
        if drafts:
            wanted = self._blocks_for(len(seq.tokens) + len(drafts)) - self._blocks_for(held)
            allocation = None
            if wanted + self._watermark_blocks <= self.manager.num_free_blocks:
                allocation = self.manager.allocate_slots(
                    seq.seq_id, seq.tokens, len(seq.tokens), num_lookahead_tokens=len(drafts)
                )
            if allocation is None:
                drafts = []
            else:
                self._plan.extend(allocation.plan)
                if allocation.table_update is not None:
                    first = allocation.table_update[0]
                    self._table_changes[seq.seq_id] = min(
                        first, self._table_changes.get(seq.seq_id, first)
                    )
        seq.draft_token_ids = drafts

    def table_update(self, seq: Sequence, allocation: Allocation) -> tuple[int, list[int]] | None:
        """The change to the sample's table since its last chunk: this allocation's, joined with
        any a draft reservation made since."""
        first = self._table_changes.pop(seq.seq_id, None)
        if first is None:
            return allocation.table_update
        if allocation.table_update is not None:
            first = min(first, allocation.table_update[0])
        return first, self.manager.block_table(seq.seq_id)[first:]

    def forget(self, seq: Sequence, give_back: bool = False) -> None:
        """Drop the sample's drafts (it is freed, or preempted: then `give_back` their slots
        first, so nothing moves them)."""
        seq.draft_token_ids = []
        self._table_changes.pop(seq.seq_id, None)
        if give_back:
            self._give_back(seq)

    def _give_back(self, seq: Sequence) -> None:
        """Trim the sample's slots past its record (the drafts it did not keep)."""
        if self.manager.num_tokens(seq.seq_id) > len(seq.tokens):
            self.manager.trim(seq.seq_id, len(seq.tokens))

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.manager.block_size)
