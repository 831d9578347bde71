"""KVMemory: what the scheduler asks of KV memory.

The engine's is the paged `memory.KVCacheManager`; the simulator also schedules over a slab
allocator (`sim/schemes.py`) through the same calls.
"""

from __future__ import annotations

from typing import Protocol

from pagedkv.memory import Allocation, MemoryPlan
from pagedkv.memory.tokens import SequenceTokens

SeqId = tuple[str, int]


class KVMemory(Protocol):
    """What the scheduler asks of KV memory; `KVCacheManager` is the real one.

    `allocate_slots` answers None, having changed nothing, when the slots do not fit. The
    memory shares each sequence's `SequenceTokens` record (given at its first `allocate_slots`
    and at `fork`) and reads the ids there; the scheduler counts the computed tokens and reports
    them with `mark_computed`. Before admitting prompts it reports the tokens the step's chunks
    will compute (`mark_scheduled`), so a prompt admitted in the same step can share their
    blocks, and `commit_scheduled` once the step ran. Lookahead slots (for drafts past the
    record) are given back with `trim`; `num_tokens` is the slots a sequence holds.
    """

    block_size: int
    num_gpu_blocks: int

    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_free_cpu_blocks(self) -> int: ...
    def __contains__(self, seq_id: SeqId) -> bool: ...
    def allocate_slots(
        self,
        seq_id: SeqId,
        tokens: SequenceTokens,
        num_tokens: int,
        *,
        num_lookahead_tokens: int = 0,
        cache_salt: str | None = None,
        read_cache: bool = True,
        count_lookup: bool = True,
    ) -> Allocation | None: ...
    def mark_computed(self, seq_id: SeqId, num_tokens: int) -> None: ...
    def mark_scheduled(self, seq_id: SeqId, num_tokens: int) -> None: ...
    def commit_scheduled(self) -> None: ...
    def trim(self, seq_id: SeqId, num_tokens: int) -> None: ...
    def num_tokens(self, seq_id: SeqId) -> int: ...
    def fork(self, parent_id: SeqId, child_id: SeqId, tokens: SequenceTokens) -> None: ...
    def free(self, seq_id: SeqId) -> None: ...
    def swap_out(self, seq_id: SeqId) -> MemoryPlan: ...
    def swap_in(self, seq_id: SeqId) -> MemoryPlan: ...
    def block_table(self, seq_id: SeqId) -> list[int]: ...
