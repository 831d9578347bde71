"""The four allocation schemes the simulator compares, each memory the engine's scheduler runs on.

(a) slab reserved at max_model_len, (b) slab reserved at prompt + max_tokens (first fit, so
holes appear), (c) paged with no sharing, (d) paged with prefix caching and copy-on-write
forks for n > 1. Each scheme hands the scheduler a `KVMemory`: the engine's own
`KVCacheManager` for (c) and (d), a `SlabMemory` over `SlabAllocator` for (a) and (b). Every
block, reservation and byte counted here comes from those allocators; a scheme adds only what
they cannot know: how long each request will finally be, which is what splits unwritten
reserved memory into "still to be written" and "never to be written".

A sample's KV finally holds its prompt and all its output tokens but the last: the last
sampled token is never fed back, so its KV is never written.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass

from pagedkv.engine.sched.kv_memory import KVMemory
from pagedkv.memory import (
    Allocation,
    KVCacheManager,
    MemoryPlan,
    NoContiguousSpace,
    SlabAllocator,
)
from pagedkv.memory.tokens import SequenceTokens
from pagedkv.sim.memory_map import MemoryMap, paged_map, slab_map
from pagedkv.sim.workloads import WorkloadRequest

SCHEME_LABELS: dict[str, str] = {
    "slab-max": "(a) slab @ max_model_len",
    "slab-exact": "(b) slab @ prompt+max_tokens",
    "paged": "(c) paged",
    "paged-shared": "(d) paged + sharing",
}

SeqId = tuple[str, int]  # the engine's: (request id, sample index)


@dataclass(frozen=True)
class MemoryState:
    """Where the pool's token slots are at one step.

    `state` slots hold a token's KV; `reservation` slots are held for tokens their request
    will still write; `internal` slots are held but will never be written (a slab's
    over-reservation, the part of a paged request's last block past its final length);
    `external` slots are free yet unusable by the request waiting for memory, because no hole
    is large enough. `shared` counts the slots sharing saves: tokens of several sequences
    stored once.
    """

    state: int
    reservation: int
    internal: int
    external: int
    shared: int = 0

    @property
    def held(self) -> int:
        """Slots held by requests: state plus both kinds of reserved-but-empty."""
        return self.state + self.reservation + self.internal


class Scheme(ABC):
    """KV memory for the engine's scheduler, and the accounting the simulator reports.

    `forks`: whether a request's samples share its prompt (one prefill, then forks) or each
    holds a copy of its own from admission.
    """

    forks: bool

    def __init__(self, name: str, num_blocks: int, block_size: int) -> None:
        self.name = name
        self.block_size = block_size
        self.pool_tokens = num_blocks * block_size
        self.requests: dict[str, WorkloadRequest] = {}  # by the engine's request id

    @property
    @abstractmethod
    def memory(self) -> KVMemory:
        """What the scheduler allocates from."""

    def add(self, request: WorkloadRequest) -> None:
        """Learn a request as it arrives (its final length; a slab's reservation size)."""
        self.requests[str(request.req_id)] = request

    @abstractmethod
    def capacity_needed(self, request: WorkloadRequest) -> int:
        """Token slots the request needs at its largest with the pool to itself."""

    @abstractmethod
    def measure(self) -> MemoryState:
        """The pool now."""

    @abstractmethod
    def footprint(self, request: WorkloadRequest) -> tuple[int, int]:
        """(token slots holding the request's KV, token slots of memory it holds)."""

    @abstractmethod
    def memory_map(self, step: int) -> MemoryMap:
        """The pool cell by cell."""

    def stats(self) -> dict[str, object]:
        """Allocator counters worth reporting (prefix hits, copies); none by default."""
        return {}

    def _owner(self, seq: SeqId) -> int:
        """The workload's id of the request a sequence belongs to."""
        return self.requests[seq[0]].req_id


class SlabScheme(Scheme):
    """One contiguous reservation per sample: max_model_len (a), or prompt + max_tokens (b)."""

    forks = False

    def __init__(
        self, name: str, num_blocks: int, block_size: int, max_model_len: int | None
    ) -> None:
        super().__init__(name, num_blocks, block_size)
        self.allocator = SlabAllocator(self.pool_tokens)
        self.max_model_len = max_model_len
        self._memory = SlabMemory(self.allocator, block_size, self._reservation_of)

    @property
    def memory(self) -> SlabMemory:
        return self._memory

    def reservation(self, request: WorkloadRequest) -> int:
        """Slots reserved per sample."""
        if self.max_model_len is not None:
            return self.max_model_len
        return request.prompt_len + request.max_tokens

    def capacity_needed(self, request: WorkloadRequest) -> int:
        return request.n * self.reservation(request)

    def _reservation_of(self, request_id: str) -> int:
        return self.reservation(self.requests[request_id])

    def measure(self) -> MemoryState:
        report = self.allocator.report()
        never_written = sum(
            reserved - final_kv_tokens(self.requests[seq[0]])
            for seq, _, reserved, _ in self.allocator.reservations()
        )
        return MemoryState(
            state=report.used,
            reservation=report.reserved - report.used - never_written,
            internal=never_written,
            external=report.external_fragmentation,
        )

    def footprint(self, request: WorkloadRequest) -> tuple[int, int]:
        request_id = str(request.req_id)
        rows = [row for row in self.allocator.reservations() if row[0][0] == request_id]
        return sum(used for *_, used in rows), sum(reserved for _, _, reserved, _ in rows)

    def memory_map(self, step: int) -> MemoryMap:
        owners = {seq: self._owner(seq) for seq, *_ in self.allocator.reservations()}
        return slab_map(self.allocator, owners, self.block_size, self.name, step)


class PagedScheme(Scheme):
    """Blocks on demand from the engine's `KVCacheManager`; with `sharing`, prefix caching
    and forks (without, each sample of a request holds its own copy of the prompt)."""

    def __init__(self, name: str, num_blocks: int, block_size: int, sharing: bool) -> None:
        super().__init__(name, num_blocks, block_size)
        self.sharing = sharing
        self.forks = sharing
        self.manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=sharing)

    @property
    def memory(self) -> KVCacheManager:
        return self.manager

    def capacity_needed(self, request: WorkloadRequest) -> int:
        return request.n * -(-request.total_len // self.block_size) * self.block_size

    def measure(self) -> MemoryState:
        held = (self.manager.num_gpu_blocks - self.manager.num_free_blocks) * self.block_size
        seqs = self.manager.seq_ids
        unfilled, never_written = self._unfilled_slots(seqs)
        logical = sum(self.manager.num_tokens(seq) for seq in seqs)
        state = held - unfilled
        return MemoryState(
            state,
            reservation=unfilled - never_written,
            internal=never_written,
            external=0,
            shared=logical - state,
        )

    def footprint(self, request: WorkloadRequest) -> tuple[int, int]:
        fill: dict[int, int] = {}
        for sample in range(request.n):
            seq = (str(request.req_id), sample)
            if seq not in self.manager:
                continue
            num_tokens = self.manager.num_tokens(seq)
            for index, block_id in enumerate(self.manager.block_table(seq)):
                fill[block_id] = min(self.block_size, num_tokens - index * self.block_size)
        return sum(fill.values()), len(fill) * self.block_size

    def memory_map(self, step: int) -> MemoryMap:
        owners = {seq: self._owner(seq) for seq in self.manager.seq_ids}
        return paged_map(self.manager, owners, self.name, step)

    def stats(self) -> dict[str, object]:
        stats = self.manager.stats
        return {**asdict(stats), "prefix_hit_rate": stats.prefix_hit_rate}

    def _unfilled_slots(self, seqs: list[SeqId]) -> tuple[int, int]:
        """Empty slots in last blocks, and those of them the sequence will never write (past
        its final length); a last block shared by forks is counted once."""
        unfilled: dict[object, tuple[int, int]] = {}
        for seq in seqs:
            num_tokens = self.manager.num_tokens(seq)
            remainder = num_tokens % self.block_size
            if remainder:
                key = self.manager.block_table(seq)[-1] if self.sharing else seq
                empty = self.block_size - remainder
                still_written = final_kv_tokens(self.requests[seq[0]]) - num_tokens
                unfilled[key] = empty, empty - min(empty, max(0, still_written))
        return sum(e for e, _ in unfilled.values()), sum(n for _, n in unfilled.values())


class SlabMemory:
    """A `SlabAllocator` as the scheduler's `KVMemory`: a sample's whole reservation is made
    when it is admitted, so appending never fails and a slab is never preempted.

    A slab scheme gives every sample its own reservation from the start and has no CPU pool,
    so the scheduler never asks it to fork or swap; those calls say so.
    """

    def __init__(
        self, allocator: SlabAllocator, block_size: int, reservation: Callable[[str], int]
    ) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.num_gpu_blocks = allocator.capacity // block_size
        self.num_free_cpu_blocks = 0
        self._reservation = reservation  # slots per sample, by request id
        self._slabs: dict[SeqId, _SlabSeq] = {}

    @property
    def num_free_blocks(self) -> int:
        """Free slots, in blocks (not necessarily contiguous)."""
        return self.allocator.num_free // self.block_size

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._slabs

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
    ) -> Allocation | None:
        """A new sample's slab is reserved (None when no hole fits it) and its prompt written;
        a held one writes its tokens into its slab. No prefix is ever cached (so `read_cache`
        and `count_lookup` change nothing); the slab's span is reported once and never
        moves. Lookahead slots are the slab's own room past its tokens: reserved from the
        start."""
        slab = self._slabs.get(seq_id)
        if slab is None:
            size = self._reservation(seq_id[0])
            try:
                offset = self.allocator.reserve(seq_id, size)
            except NoContiguousSpace:
                return None
            slab = self._slabs[seq_id] = _SlabSeq(offset, size, 0)
        if num_tokens > slab.num_tokens:
            self.allocator.write(seq_id, num_tokens - slab.num_tokens)
            slab.num_tokens = num_tokens
        table_update = None
        if not slab.table_reported:
            slab.table_reported = True
            table_update = (0, self.block_table(seq_id))
        return Allocation(MemoryPlan(), table_update)

    def mark_computed(self, seq_id: SeqId, num_tokens: int) -> None:
        """Nothing to record: a slab has no prefix cache."""

    def mark_scheduled(self, seq_id: SeqId, num_tokens: int) -> None:
        """Nothing to share: a slab has no prefix cache."""

    def commit_scheduled(self) -> None:
        """Nothing was shared ahead of its computation."""

    def trim(self, seq_id: SeqId, num_tokens: int) -> None:
        """Nothing to give back: lookahead slots are part of the slab's reservation."""

    def num_tokens(self, seq_id: SeqId) -> int:
        """Tokens written in the sample's slab."""
        return self._slabs[seq_id].num_tokens

    def free(self, seq_id: SeqId) -> None:
        self.allocator.release(seq_id)
        del self._slabs[seq_id]

    def block_table(self, seq_id: SeqId) -> list[int]:
        """The blocks' worth of address space the slab spans."""
        slab = self._slabs[seq_id]
        return list(
            range(slab.offset // self.block_size, -(-(slab.offset + slab.size) // self.block_size))
        )

    def fork(self, parent_id: SeqId, child_id: SeqId, tokens: SequenceTokens) -> None:
        raise NotImplementedError("a slab reserves every sample at admission: it never forks")

    def swap_out(self, seq_id: SeqId) -> MemoryPlan:
        raise NotImplementedError("a slab has no CPU pool and is never preempted")

    def swap_in(self, seq_id: SeqId) -> MemoryPlan:
        raise NotImplementedError("a slab has no CPU pool and is never preempted")


@dataclass
class _SlabSeq:
    """Where a sample's slab is and the tokens written in it (the allocator's count, read in
    O(1))."""

    offset: int
    size: int
    num_tokens: int
    table_reported: bool = False


def final_kv_tokens(request: WorkloadRequest) -> int:
    """Tokens of one sample whose KV is written by the time it finishes: all but the last."""
    return request.total_len - 1


def make_scheme(name: str, num_blocks: int, block_size: int, max_model_len: int) -> Scheme:
    """Build scheme `name` (a key of `SCHEME_LABELS`) over a pool of `num_blocks` blocks."""
    if name == "slab-max":
        return SlabScheme(name, num_blocks, block_size, max_model_len)
    if name == "slab-exact":
        return SlabScheme(name, num_blocks, block_size, None)
    if name == "paged":
        return PagedScheme(name, num_blocks, block_size, sharing=False)
    if name == "paged-shared":
        return PagedScheme(name, num_blocks, block_size, sharing=True)
    raise ValueError(f"unknown scheme {name!r}; schemes: {', '.join(SCHEME_LABELS)}")
