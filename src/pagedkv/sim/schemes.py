"""The four allocation schemes the simulator compares, each a thin adapter over `pagedkv.memory`.

(a) slab reserved at max_model_len, (b) slab reserved at prompt + max_tokens (first fit, so
holes appear), (c) paged with no sharing, (d) paged with prefix caching and copy-on-write
forks for n > 1. Every block, reservation and byte counted here comes from `SlabAllocator`
or `KVCacheManager`; the adapters only translate requests into their calls and know one
thing the allocators cannot: how long each request will finally be, which is what splits
unwritten reserved memory into "still to be written" and "never to be written".
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import asdict, dataclass

from pagedkv.memory import KVCacheManager, NoContiguousSpace, NoFreeBlocks, SlabAllocator
from pagedkv.sim.memory_map import MemoryMap, paged_map, slab_map
from pagedkv.sim.workloads import Request

SCHEME_LABELS: dict[str, str] = {
    "slab-max": "(a) slab @ max_model_len",
    "slab-exact": "(b) slab @ prompt+max_tokens",
    "paged": "(c) paged",
    "paged-shared": "(d) paged + sharing",
}

SeqId = tuple[int, int]  # (req_id, sample index)


@dataclass(frozen=True)
class MemoryState:
    """Where the pool's token slots are at one step.

    `state` slots hold a token's KV; `reservation` slots are held for tokens their request
    will still write; `internal` slots are held but will never be written (a slab's
    over-reservation, a paged block's unfilled tail); `external` slots are free yet unusable
    by the request waiting for memory, because no hole is large enough. `shared` counts the
    slots sharing saves: tokens of several sequences stored once.
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
    """How requests get KV memory; the simulator drives every scheme the same way."""

    def __init__(self, name: str, num_blocks: int, block_size: int) -> None:
        self.name = name
        self.block_size = block_size
        self.pool_tokens = num_blocks * block_size

    @abstractmethod
    def capacity_needed(self, request: Request) -> int:
        """Token slots the request needs at its largest with the pool to itself."""

    @abstractmethod
    def admit(self, request: Request, generated: list[int]) -> bool:
        """Give every sample its prompt plus `generated[k]` tokens; False (no change) if full."""

    @abstractmethod
    def grow(self, request: Request, sample: int) -> bool:
        """Add one token to a sample; False (no change) if there is no memory for it."""

    @abstractmethod
    def release(self, request: Request, finished: bool) -> None:
        """Free the request's memory: it finished, or is preempted and will be recomputed."""

    @abstractmethod
    def measure(self) -> MemoryState:
        """The pool now."""

    @abstractmethod
    def footprint(self, request: Request) -> tuple[int, int]:
        """(token slots holding the request's KV, token slots of memory it holds)."""

    @abstractmethod
    def memory_map(self, step: int) -> MemoryMap:
        """The pool cell by cell."""

    def stats(self) -> dict[str, object]:
        """Allocator counters worth reporting (prefix hits, copies); none by default."""
        return {}

    @staticmethod
    def _seqs(request: Request) -> list[SeqId]:
        return [(request.req_id, sample) for sample in range(request.n)]


class SlabScheme(Scheme):
    """One contiguous reservation per sample: max_model_len (a), or prompt + max_tokens (b)."""

    def __init__(
        self, name: str, num_blocks: int, block_size: int, max_model_len: int | None
    ) -> None:
        super().__init__(name, num_blocks, block_size)
        self.allocator = SlabAllocator(self.pool_tokens)
        self.max_model_len = max_model_len
        self._never_written = 0

    def reservation(self, request: Request) -> int:
        """Slots reserved per sample."""
        if self.max_model_len is not None:
            return self.max_model_len
        return request.prompt_len + request.max_tokens

    def capacity_needed(self, request: Request) -> int:
        return request.n * self.reservation(request)

    def admit(self, request: Request, generated: list[int]) -> bool:
        size = self.reservation(request)
        reserved = []
        try:
            for seq, count in zip(self._seqs(request), generated, strict=True):
                self.allocator.reserve(seq, size)
                reserved.append(seq)
                self.allocator.write(seq, request.prompt_len + count)
        except NoContiguousSpace:
            for seq in reserved:
                self.allocator.release(seq)
            return False
        self._never_written += request.n * (size - request.total_len)
        return True

    def grow(self, request: Request, sample: int) -> bool:
        self.allocator.write((request.req_id, sample), 1)
        return True

    def release(self, request: Request, finished: bool) -> None:
        for seq in self._seqs(request):
            self.allocator.release(seq)
        self._never_written -= request.n * (self.reservation(request) - request.total_len)

    def measure(self) -> MemoryState:
        report = self.allocator.report()
        return MemoryState(
            state=report.used,
            reservation=report.reserved - report.used - self._never_written,
            internal=self._never_written,
            external=report.external_fragmentation,
        )

    def footprint(self, request: Request) -> tuple[int, int]:
        rows = [row for row in self.allocator.reservations() if row[0][0] == request.req_id]
        return sum(used for *_, used in rows), sum(reserved for _, _, reserved, _ in rows)

    def memory_map(self, step: int) -> MemoryMap:
        owners = {seq: seq[0] for seq, *_ in self.allocator.reservations()}
        return slab_map(self.allocator, owners, self.block_size, self.name, step)


class PagedScheme(Scheme):
    """Blocks on demand from `KVCacheManager`; with `sharing`, prefix caching and forks.

    Token ids are made up (memory only compares them): a shared prefix gets the same ids in
    every request that carries it, everything else fresh ids. They are kept per sequence so a
    preempted request is recomputed with the same tokens, as a real engine would. A prompt
    counts as computed once admitted, so a request admitted later in the same step can
    already hit its blocks in the prefix cache.
    """

    def __init__(self, name: str, num_blocks: int, block_size: int, sharing: bool) -> None:
        super().__init__(name, num_blocks, block_size)
        self.sharing = sharing
        self.manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=sharing)
        self._fresh_ids = itertools.count()
        self._prefixes: dict[Hashable, list[int]] = {}
        self._prompts: dict[int, list[int]] = {}
        self._outputs: dict[SeqId, list[int]] = {}
        self._live: dict[SeqId, int] = {}

    def capacity_needed(self, request: Request) -> int:
        return request.n * -(-request.total_len // self.block_size) * self.block_size

    def admit(self, request: Request, generated: list[int]) -> bool:
        prompt = self._prompt_tokens(request)
        seqs = self._seqs(request)
        outputs = [self._outputs.setdefault(seq, []) for seq in seqs]
        done: list[SeqId] = []
        try:
            if self.sharing:
                # One prefill, then forks: samples share every prompt block, even the
                # partly filled last one, until their first token copies it on write.
                self._allocate(seqs[0], prompt)
                done.append(seqs[0])
                for seq in seqs[1:]:
                    self.manager.fork(seqs[0], seq)
                    done.append(seq)
                for seq, tokens, count in zip(seqs, outputs, generated, strict=True):
                    if count:
                        self.manager.append(seq, tokens[:count])
                        self.manager.mark_computed(seq, len(prompt) + count)
            else:
                for seq, tokens, count in zip(seqs, outputs, generated, strict=True):
                    self._allocate(seq, prompt + tokens[:count])
                    done.append(seq)
        except NoFreeBlocks:
            for seq in done:
                self.manager.free(seq)
            return False
        for seq in seqs:
            self._live[seq] = request.req_id
        return True

    def grow(self, request: Request, sample: int) -> bool:
        seq = (request.req_id, sample)
        token = next(self._fresh_ids)
        try:
            self.manager.append(seq, [token])
        except NoFreeBlocks:
            return False
        self._outputs[seq].append(token)
        self.manager.mark_computed(seq, self.manager.num_tokens(seq))
        return True

    def release(self, request: Request, finished: bool) -> None:
        for seq in self._seqs(request):
            self.manager.free(seq)
            del self._live[seq]
            if finished:
                del self._outputs[seq]
        if finished:
            del self._prompts[request.req_id]

    def measure(self) -> MemoryState:
        held = (self.manager.num_gpu_blocks - self.manager.num_free_blocks) * self.block_size
        unfilled = self._unfilled_slots(self._live)
        logical = sum(self.manager.num_tokens(seq) for seq in self._live)
        state = held - unfilled
        return MemoryState(
            state, reservation=0, internal=unfilled, external=0, shared=logical - state
        )

    def footprint(self, request: Request) -> tuple[int, int]:
        fill: dict[int, int] = {}
        for seq in self._seqs(request):
            num_tokens = self.manager.num_tokens(seq)
            for index, block_id in enumerate(self.manager.block_table(seq)):
                fill[block_id] = min(self.block_size, num_tokens - index * self.block_size)
        return sum(fill.values()), len(fill) * self.block_size

    def memory_map(self, step: int) -> MemoryMap:
        return paged_map(self.manager, self._live, self.name, step)

    def stats(self) -> dict[str, object]:
        stats = self.manager.stats
        return {**asdict(stats), "prefix_hit_rate": stats.prefix_hit_rate}

    def _allocate(self, seq: SeqId, tokens: list[int]) -> None:
        self.manager.allocate(seq, tokens)
        self.manager.mark_computed(seq, len(tokens))

    def _unfilled_slots(self, seqs: dict[SeqId, int]) -> int:
        """Empty slots in last blocks; a last block shared by forks is counted once."""
        unfilled: dict[object, int] = {}
        for seq in seqs:
            remainder = self.manager.num_tokens(seq) % self.block_size
            if remainder:
                key = self.manager.block_table(seq)[-1] if self.sharing else seq
                unfilled[key] = self.block_size - remainder
        return sum(unfilled.values())

    def _prompt_tokens(self, request: Request) -> list[int]:
        prompt = self._prompts.get(request.req_id)
        if prompt is None:
            prefix: list[int] = []
            if request.prefix_id is not None:
                prefix = self._prefixes.setdefault(request.prefix_id, [])
                missing = max(0, request.prefix_len - len(prefix))
                prefix.extend(itertools.islice(self._fresh_ids, missing))
                prefix = prefix[: request.prefix_len]
            unique = request.prompt_len - len(prefix)
            prompt = prefix + list(itertools.islice(self._fresh_ids, unique))
            self._prompts[request.req_id] = prompt
        return prompt


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
