"""KVCacheManager: per-sequence block tables over one BlockPool (GPU), a CPU swap pool and
an optional host-RAM tier of the prefix cache (`host_tier.py`).

The manager decides where KV lives and never touches KV data. The scheduler asks it one
thing per chunk: `allocate_slots(seq_id, tokens, num_tokens) -> Allocation | None` (vLLM's
shape): slots for a sequence's first `num_tokens` tokens, taking its cached prefix when the
sequence is new, as the block-table change and the moves to run before the next forward pass
(host-tier saves and copies back, copy-on-write); None, having changed nothing, when the pool
cannot hold them. Besides it: `mark_computed` (the scheduler owns each sequence's computed
count and reports it, so full computed blocks enter the prefix cache), `free`, `fork`,
`swap_out` and `swap_in`.

Prompts that arrive together share their common prefix from the first step, as in vLLM V1:
`mark_scheduled` enters the full blocks a step being scheduled will write into the prefix
cache at once, so a prompt allocated later in the same step hits them. That is sound because
the forward pass writes every sequence's K/V of a layer before any attention of that layer
reads. Such a block is "scheduled" until the step ran (`commit_scheduled`); a step that failed
takes them back with its plan (`discard_plan`). The scheduler publishes a step's chunks only
once no sequence can be preempted in it any more, so a scheduled block is never freed before
its KV is written.

Speculative decoding writes the KV of drafted tokens before it knows which are kept:
`allocate_slots(..., num_lookahead_tokens=k)` gives a sequence k slots past the tokens of its
record (drafts are never in the record until accepted), and `trim` gives back the slots, and
the blocks, of the drafts that were rejected. Only tokens of the record are ever marked
computed, so no block holding an unaccepted token enters the prefix cache or its host tier.

`allocate`, `append` and `take_pending_plan` are the same operations for callers that keep
their own ids (tests, the memory walkthrough): they raise `NoFreeBlocks` instead of answering
None. Every operation either succeeds completely or changes nothing. Token ids are checked
where they enter (ints in [0, 2**63), `InvalidTokenIds` otherwise), so nothing later can fail
on them.

With a host tier, a cached block the GPU pool evicts is saved to it in the plan of the call
that evicted it, ahead of the moves that overwrite the block, and a prompt whose prefix hits
the tier gets its blocks copied back.

Plans must be executed in the order they were returned (join a step's plans with
`MemoryPlan.extend`). Blocks are released at once, so a block that `swap_out` is saving can
be the destination of a copy-on-write or `swap_in` returned later in the same step; running
the plans in order reads it before it is overwritten.

The file runs past 400 lines because the lifecycle is one idea: allocation, prefix hits,
growth with copy-on-write, forks, swaps and frees all keep the same per-sequence table and
the same reference counts, and each operation's all-or-nothing check reads the others' state.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from pagedkv.memory.errors import (
    DuplicateSequence,
    NoFreeBlocks,
    SequenceNotSwappedOut,
    SequenceSwappedOut,
    UnknownSequence,
)
from pagedkv.memory.hashing import BlockHash, chain_hashes, root_hash
from pagedkv.memory.host_tier import HostTier, HostTierStats
from pagedkv.memory.moves import BlockMove, MemoryPlan, MoveKind
from pagedkv.memory.pool import Block, BlockPool
from pagedkv.memory.tokens import SequenceTokens, token_array

SeqId = Hashable


@dataclass(frozen=True)
class KVCacheStats:
    """Counters since the manager was created."""

    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    evictions: int = 0
    cow_copies: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of queried prompt tokens served from the prefix cache."""
        return (
            self.prefix_hit_tokens / self.prefix_queried_tokens
            if self.prefix_queried_tokens
            else 0.0
        )


@dataclass(frozen=True)
class Allocation:
    """What `allocate_slots` did: the plan to run first, the table change, the cached prefix.

    `table_update` is `(first, block_ids)`: the table from entry `first` on, when it changed
    since the last allocation reported it (the whole table for a new or swapped-in sequence).
    `num_cached` is how many leading tokens a new sequence found in the prefix cache (0 for a
    sequence the manager already held): their KV is computed.
    """

    plan: MemoryPlan
    table_update: tuple[int, list[int]] | None
    num_cached: int = 0


@dataclass
class _Sequence:
    tokens: SequenceTokens  # the caller's record when it passed one: the ids, never copied
    num_held: int  # slots in the table: leading tokens of the record, then lookahead slots
    num_computed: int  # leading tokens whose KV is written, as the caller last reported
    blocks: list[Block]
    root_hash: BlockHash  # parent of the first block's hash: carries the cache salt
    cpu_blocks: list[int] | None = None  # set while swapped out; `blocks` is then empty
    block_hashes: list[BlockHash] = field(default_factory=list)  # computed full blocks, chained
    # First table entry changed since `take_table_update` last reported it (None: none).
    table_changed_from: int | None = 0
    # Slots granted past the record's tokens (speculative drafts not accepted yet); the
    # record may grow into them.
    num_lookahead: int = 0


class KVCacheManager:
    """Paged KV memory: on-demand growth, prefix caching, fork + copy-on-write, swap."""

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int = 16,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        num_offload_blocks: int = 0,
    ) -> None:
        """`num_cpu_blocks` is the swap pool of preemption; `num_offload_blocks` the host tier
        of the prefix cache (0: none), its ids after the swap pool's."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._pool = BlockPool(num_gpu_blocks)
        self._tier = HostTier(num_offload_blocks if enable_prefix_caching else 0, num_cpu_blocks)
        self._pending = MemoryPlan()  # moves of `allocate` calls, for take_pending_plan
        # Reversed so pop() hands out CPU block 0 first: plans read naturally in demos.
        self._free_cpu_blocks = list(range(num_cpu_blocks - 1, -1, -1))
        self._seqs: dict[SeqId, _Sequence] = {}
        # Blocks `mark_scheduled` cached whose KV the step being built is still to write.
        self._scheduled: set[Block] = set()
        self._prefix_queried_tokens = 0
        self._prefix_hit_tokens = 0
        self._cow_copies = 0
        self._blocks_swapped_out = 0
        self._blocks_swapped_in = 0

    # -- lifecycle -------------------------------------------------------------------------

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
        """Slots for the first `num_tokens` of the sequence's tokens and `num_lookahead_tokens`
        more after them, or None (nothing changed) when the pool cannot hold them.

        A sequence new to the manager gets its table here, with its cached prefix (`allocate`
        says how `cache_salt` and `read_cache` choose it); `tokens` is its record, kept and
        read, never copied. Its lookup adds to the prefix-cache figures (`stats`) unless
        `count_lookup` is False: a sequence back after a recompute preemption, whose tokens
        were counted once, as vLLM counts those apart. A held sequence grows when it holds
        fewer slots (copying a shared partial last block first). Lookahead slots are for
        tokens not in the record yet (speculative drafts): their KV may be written, never
        marked computed, and `trim` gives back those of the tokens that are not kept.
        """
        if num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be >= 0, got {num_lookahead_tokens}")
        try:
            if seq_id in self._seqs:
                seq = self._resident(seq_id, "growing")
                lookahead = max(seq.num_lookahead, num_lookahead_tokens)
                wanted = max(num_tokens + num_lookahead_tokens, seq.num_held)
                plan = self._grow(seq, wanted, len(seq.tokens) + lookahead)
                seq.num_lookahead = lookahead
                num_cached = 0
            else:
                plan = MemoryPlan()
                num_cached = self._allocate_table(
                    seq_id,
                    tokens,
                    num_tokens,
                    cache_salt,
                    read_cache,
                    plan,
                    num_lookahead_tokens,
                    count_lookup,
                )
        except NoFreeBlocks:
            return None
        return Allocation(plan, self._take_table_update(self._seqs[seq_id]), num_cached)

    def allocate(
        self,
        seq_id: SeqId,
        tokens: SequenceTokens | Sequence[int],
        cache_salt: str | None = None,
        read_cache: bool = True,
    ) -> int:
        """Create the block table for a prompt; return how many leading tokens are cached.

        `tokens` is the sequence's `SequenceTokens` record (kept, not copied: the manager
        reads ids from it), or plain ids for a record of its own. Every token it holds gets a
        slot; the moves wait in `take_pending_plan`. The cached count is a whole number of
        blocks and always leaves at least one token to compute, because the forward pass needs
        it to produce the next-token logits. With a `cache_salt`, only blocks computed under the
        same salt are hits (and this sequence's blocks serve only that salt), so tenants
        cannot probe each other's prompts. With `read_cache` False nothing is read from the
        cache (a request that scores every prompt token must compute each); its blocks are
        still offered to later prompts.
        """
        if seq_id in self._seqs:
            raise DuplicateSequence(seq_id)
        record = tokens if isinstance(tokens, SequenceTokens) else SequenceTokens(seq_id, tokens)
        return self._allocate_table(
            seq_id, record, len(record), cache_salt, read_cache, self._pending
        )

    def _allocate_table(
        self,
        seq_id: SeqId,
        record: SequenceTokens,
        num_tokens: int,
        cache_salt: str | None,
        read_cache: bool,
        plan: MemoryPlan,
        num_lookahead: int = 0,
        count_lookup: bool = True,
    ) -> int:
        """A new table holding the record's first `num_tokens` tokens and `num_lookahead` slots
        after them, its moves appended to `plan`; the cached count (its lookup added to the
        prefix-cache figures if `count_lookup`)."""
        if num_tokens == 0:
            raise ValueError(f"sequence {seq_id!r}: cannot allocate an empty prompt")
        if not 0 < num_tokens <= len(record):
            raise ValueError(
                f"sequence {seq_id!r}: cannot hold {num_tokens} of its {len(record)} tokens"
            )
        root = root_hash(cache_salt)
        prompt = record.token_ids[:num_tokens]
        hits, hashes, num_tier_queries = (
            self._find_cached_prefix(prompt, root) if read_cache else ([], [], 0)
        )
        gpu_hits = [hit for hit in hits if isinstance(hit, Block)]
        host_hits = frozenset(hit for hit in hits if isinstance(hit, int))
        num_blocks = self._blocks_for(num_tokens + num_lookahead)
        self._take(gpu_hits, num_blocks - len(gpu_hits))
        new_blocks = iter(self._allocate(num_blocks - len(gpu_hits), plan, host_hits))
        blocks = []
        for hit, block_hash in zip(hits, hashes, strict=True):
            if isinstance(hit, Block):
                blocks.append(hit)
                continue
            block = next(new_blocks)  # copied back from the host tier, cached as it arrives
            plan.moves.append(BlockMove(MoveKind.SWAP_IN, hit, block.block_id))
            token_bytes = self._block_bytes(record.token_ids, len(blocks))
            self._pool.cache([block], [(block_hash, token_bytes)])
            blocks.append(block)
        blocks.extend(new_blocks)
        tier_hashes = [h for hit, h in zip(hits, hashes, strict=True) if isinstance(hit, int)]
        self._tier.take(tier_hashes, num_tier_queries)
        num_cached = len(hits) * self.block_size
        if self.enable_prefix_caching and read_cache and count_lookup:
            self._prefix_queried_tokens += num_tokens
            self._prefix_hit_tokens += num_cached
        self._seqs[seq_id] = _Sequence(
            record,
            num_tokens + num_lookahead,
            num_cached,
            blocks,
            root,
            block_hashes=hashes,
            num_lookahead=num_lookahead,
        )
        return num_cached

    def append(self, seq_id: SeqId, token_ids: Sequence[int]) -> MemoryPlan:
        """Add `token_ids` to the sequence and give them slots; return the copy-on-write plan.

        For a caller that keeps its own ids; an owner of the record who appended to it already
        calls `allocate_slots` instead.
        """
        seq = self._resident(seq_id, "appending")
        tokens = token_array(seq_id, token_ids)
        if not tokens:
            return MemoryPlan()
        if len(seq.tokens) != seq.num_held:
            raise ValueError(
                f"sequence {seq_id!r} holds {seq.num_held} slots for {len(seq.tokens)} tokens: "
                "grow or trim it to its tokens before appending more"
            )
        plan = self._grow(seq, seq.num_held + len(tokens), seq.num_held + len(tokens))
        seq.tokens.token_ids.extend(tokens)
        return plan

    def fork(self, parent_id: SeqId, child_id: SeqId, tokens: SequenceTokens | None = None) -> None:
        """Give `child_id` the parent's blocks (shared, no copies), cache salt and tokens.

        `tokens` is the child's own record (its owner made it from the parent's: the ids the
        parent holds must begin it); without it the manager copies the parent's.
        """
        parent = self._resident(parent_id, "forking")
        if child_id in self._seqs:
            raise DuplicateSequence(child_id)
        if tokens is None:
            tokens = parent.tokens.copy(child_id)
        # The child shares the slots of the parent's tokens, not its lookahead slots: those
        # hold the parent's drafts, which the child must never read as its own.
        held = min(parent.num_held, len(parent.tokens))
        if len(tokens) < held or tokens.token_ids[:held] != parent.tokens.token_ids[:held]:
            raise ValueError(f"sequence {child_id!r}: its tokens do not begin with its parent's")
        blocks = parent.blocks[: self._blocks_for(held)]
        self._pool.touch(blocks)
        self._seqs[child_id] = _Sequence(
            tokens,
            held,
            parent.num_computed,
            blocks,
            parent.root_hash,
            block_hashes=list(parent.block_hashes),
        )

    def mark_computed(self, seq_id: SeqId, num_tokens: int) -> None:
        """Record that the KV of the first `num_tokens` tokens is written (the caller counts).

        The full blocks among them not cached yet (by `mark_scheduled`) enter the prefix
        cache now: a cache hit must never hand out a block whose KV no step will have written
        before the hit reads it. All or nothing: the new blocks are hashed before anything is
        recorded.
        """
        seq = self._resident(seq_id, "marking tokens computed")
        self._check_held(seq_id, seq, num_tokens, f"mark {num_tokens} tokens computed")
        if num_tokens <= seq.num_computed:
            return
        self._cache_full_blocks(seq, num_tokens)
        seq.num_computed = num_tokens

    def mark_scheduled(self, seq_id: SeqId, num_tokens: int) -> None:
        """Record that the step being scheduled writes the KV of the first `num_tokens` tokens:
        the full blocks among them enter the prefix cache now, so a prompt allocated later in
        the same step shares them instead of computing its own copy.

        The forward pass writes a layer's K/V for every sequence of the step before that
        layer's attention reads any, so the sharer reads them written. Until `commit_scheduled`
        (the step ran) or `discard_plan` (it failed) they are scheduled blocks: the caller must
        not free or swap the sequence before then.
        """
        seq = self._resident(seq_id, "scheduling tokens")
        self._check_held(seq_id, seq, num_tokens, f"schedule {num_tokens} tokens")
        self._scheduled.update(self._cache_full_blocks(seq, num_tokens))

    def commit_scheduled(self) -> None:
        """The step that `mark_scheduled` spoke for ran: its blocks hold their KV now."""
        self._scheduled.clear()

    def free(self, seq_id: SeqId) -> None:
        """Drop the sequence and release its blocks, tail first so chain tails evict first.

        Its record keeps its ids; the caller counts none of its KV computed any more.
        """
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        if seq.cpu_blocks is not None:
            # Reversed, so the next swap_out pops them in ascending order: consecutive CPU
            # blocks let the runner move a sequence with one contiguous copy.
            self._free_cpu_blocks.extend(reversed(seq.cpu_blocks))
        else:
            self._pool.release(reversed(seq.blocks))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, on the device and in the host tier, so the next prompts
        compute everything again: what a benchmark of cold prompts, or a change of weights,
        needs. Refused (False, nothing changed) while any sequence holds blocks, as vLLM's is:
        their blocks would be cached again as they finish."""
        if self._seqs:
            return False
        self._pool.uncache([block for block in self._pool.blocks if block.block_hash is not None])
        self._tier.clear()
        return True

    def trim(self, seq_id: SeqId, num_tokens: int) -> None:
        """Keep slots for the first `num_tokens` tokens only: blocks wholly past them go back
        to the pool, last first.

        What speculative decoding gives back once drafts are verified: the slots of rejected
        drafts, and the blocks taken only for them, free in the same step. Slots of computed
        tokens are never given back (`num_tokens` is at least the computed count), so no
        cached block is released here.
        """
        seq = self._resident(seq_id, "trimming")
        if not seq.num_computed <= num_tokens <= seq.num_held:
            raise ValueError(
                f"sequence {seq_id!r}: cannot trim to {num_tokens} slots, it holds "
                f"{seq.num_held} with {seq.num_computed} computed"
            )
        keep = self._blocks_for(num_tokens)
        if keep < len(seq.blocks):
            self._pool.release(reversed(seq.blocks[keep:]))
            del seq.blocks[keep:]
            self._mark_table_changed(seq, keep)
        seq.num_held = num_tokens
        seq.num_lookahead = max(0, num_tokens - len(seq.tokens))

    def swap_out(self, seq_id: SeqId) -> MemoryPlan:
        """Move a sequence to the CPU pool; return its (gpu_block -> cpu_block) moves.

        Its GPU references are dropped: a block shared with a sequence still on the GPU stays
        there for that sequence, the swapped one keeps a private CPU copy.
        """
        seq = self._resident(seq_id, "swapping out")
        if len(seq.blocks) > len(self._free_cpu_blocks):
            raise NoFreeBlocks(len(seq.blocks), len(self._free_cpu_blocks), pool="CPU")
        cpu_blocks = [self._free_cpu_blocks.pop() for _ in seq.blocks]
        plan = MemoryPlan.of(
            MoveKind.SWAP_OUT,
            ((block.block_id, cpu) for block, cpu in zip(seq.blocks, cpu_blocks, strict=True)),
        )
        self._pool.release(reversed(seq.blocks))
        seq.blocks = []
        seq.cpu_blocks = cpu_blocks
        self._blocks_swapped_out += len(plan)
        return plan

    def swap_in(self, seq_id: SeqId) -> MemoryPlan:
        """Bring a swapped sequence back; return its (cpu_block -> gpu_block) moves.

        Full blocks whose KV is still in the GPU prefix cache (shared with a sequence that
        stayed, or not yet evicted) are reused instead of copied.
        """
        seq = self._get(seq_id)
        if seq.cpu_blocks is None:
            raise SequenceNotSwappedOut(seq_id)
        hashed = [
            (block_hash, self._block_tokens(seq, index))
            for index, block_hash in enumerate(seq.block_hashes)
        ]
        reused: dict[int, Block] = {}
        for index, (block_hash, token_bytes) in enumerate(hashed):
            block = self._pool.lookup(block_hash, token_bytes)
            if block is not None:
                reused[index] = block
        num_new = len(seq.cpu_blocks) - len(reused)
        self._take(list(reused.values()), num_new)
        plan = MemoryPlan()
        new_blocks = iter(self._allocate(num_new, plan))
        blocks = []
        for index, cpu in enumerate(seq.cpu_blocks):
            block = reused.get(index)
            if block is None:
                block = next(new_blocks)
                plan.moves.append(BlockMove(MoveKind.SWAP_IN, cpu, block.block_id))
            blocks.append(block)
        self._free_cpu_blocks.extend(reversed(seq.cpu_blocks))
        seq.blocks = blocks
        seq.cpu_blocks = None
        seq.table_changed_from = 0
        copied = [index for index in range(len(hashed)) if index not in reused]
        self._pool.cache([blocks[index] for index in copied], [hashed[index] for index in copied])
        self._blocks_swapped_in += len(plan)
        return plan

    def discard_plan(self, plan: MemoryPlan) -> set[SeqId]:
        """Take back what a step that may not have run promised (a failed step's): the blocks
        its plan would have written, and those `mark_scheduled` cached for its forward pass,
        leave the GPU prefix cache and the host tier, and the sequences holding any are
        returned, for the caller to drop. Their KV may never have been written: swapped out
        into them, swapped or copied into them, computed by the step, or sharing them since."""
        gpu = {move.dst for move in plan if move.kind is not MoveKind.SWAP_OUT}
        gpu.update(block.block_id for block in self._scheduled)
        self._scheduled.clear()
        cpu = {move.dst for move in plan if move.kind is MoveKind.SWAP_OUT}
        self._pool.uncache(self._pool.blocks[block_id] for block_id in gpu)
        self._tier.forget(cpu)
        return {
            seq_id
            for seq_id, seq in self._seqs.items()
            if cpu.intersection(seq.cpu_blocks or ())
            or any(block.block_id in gpu for block in seq.blocks)
        }

    def take_pending_plan(self) -> MemoryPlan:
        """The moves `allocate` calls made since last taken (host-tier saves and copies back),
        to run in the step that uses the allocation; empty without a host tier."""
        plan, self._pending = self._pending, MemoryPlan()
        return plan

    def take_table_update(self, seq_id: SeqId) -> tuple[int, list[int]] | None:
        """`(first, block_ids)`: the table from entry `first` on, if it changed since last taken.

        A runner that keeps each sequence's table applies `table[first:] = block_ids` instead
        of receiving the whole table every step; None when nothing changed.
        """
        return self._take_table_update(self._resident(seq_id, "reading its table changes"))

    @staticmethod
    def _take_table_update(seq: _Sequence) -> tuple[int, list[int]] | None:
        first = seq.table_changed_from
        if first is None:
            return None
        seq.table_changed_from = None
        return first, [block.block_id for block in seq.blocks[first:]]

    # -- queries ---------------------------------------------------------------------------

    def block_table(self, seq_id: SeqId) -> list[int]:
        """Physical block ids holding the sequence, in token order (CPU ids while swapped)."""
        seq = self._get(seq_id)
        if seq.cpu_blocks is not None:
            return list(seq.cpu_blocks)
        return [block.block_id for block in seq.blocks]

    def num_tokens(self, seq_id: SeqId) -> int:
        """Slots the sequence holds: its tokens (prompt plus grown), then any lookahead slots."""
        return self._get(seq_id).num_held

    def num_computed_tokens(self, seq_id: SeqId) -> int:
        """Leading tokens whose KV is written (cached prefix included)."""
        return self._get(seq_id).num_computed

    def is_swapped_out(self, seq_id: SeqId) -> bool:
        """True while the sequence's blocks are in the CPU pool."""
        return self._get(seq_id).cpu_blocks is not None

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    @property
    def seq_ids(self) -> list[SeqId]:
        """Sequences holding a block table, in allocation order."""
        return list(self._seqs)

    @property
    def pool(self) -> BlockPool:
        """The GPU blocks themselves: LoRA adapters (`adapters.py`) take runs of them too."""
        return self._pool

    def block_ref_count(self, block_id: int) -> int:
        """How many block tables hold this GPU block (more than one means shared)."""
        return self._pool.blocks[block_id].ref_count

    def is_cached(self, block_id: int) -> bool:
        """True when this GPU block has an entry in the prefix cache."""
        return self._pool.blocks[block_id].block_hash is not None

    @property
    def num_free_blocks(self) -> int:
        """GPU blocks no sequence holds (including cached-but-free blocks)."""
        return self._pool.num_free_blocks

    @property
    def num_free_cached_blocks(self) -> int:
        """Free GPU blocks that still hold prefix-cache KV (reused last, revived on a hit)."""
        return sum(1 for block in self._pool.cached.values() if block.ref_count == 0)

    @property
    def num_free_cpu_blocks(self) -> int:
        """CPU blocks no swapped sequence holds."""
        return len(self._free_cpu_blocks)

    @property
    def num_offload_blocks(self) -> int:
        """Host blocks of the prefix cache's host tier (0: no tier)."""
        return self._tier.num_blocks

    def offload_view(self) -> tuple[set[int], set[int]]:
        """Host-tier blocks (numbered from 0) holding KV, and those copied back since the
        last call: what the page map draws."""
        first = self._tier.first_id
        held = {host_id - first for host_id in self._tier.held_ids()}
        return held, {host_id - first for host_id in self._tier.take_recent_hits()}

    @property
    def offload_stats(self) -> HostTierStats:
        """Host-tier blocks held, block lookups in it and hits since the manager was made."""
        return self._tier.stats

    @property
    def usage(self) -> float:
        """Fraction of GPU blocks held by sequences."""
        return 1.0 - self._pool.num_free_blocks / self._pool.num_blocks

    @property
    def stats(self) -> KVCacheStats:
        """A snapshot of the prefix-cache, eviction, copy-on-write and swap counters."""
        return KVCacheStats(
            prefix_queried_tokens=self._prefix_queried_tokens,
            prefix_hit_tokens=self._prefix_hit_tokens,
            evictions=self._pool.num_evictions,
            cow_copies=self._cow_copies,
            blocks_swapped_out=self._blocks_swapped_out,
            blocks_swapped_in=self._blocks_swapped_in,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken rule of the memory design."""
        self._pool.check_invariants()
        self._tier.check_invariants()
        expected_refs: Counter[int] = Counter()
        held_cpu: list[int] = []
        for seq_id, seq in self._seqs.items():
            table = seq.cpu_blocks if seq.cpu_blocks is not None else seq.blocks
            if len(table) != self._blocks_for(seq.num_held):
                raise AssertionError(
                    f"sequence {seq_id!r} holds {seq.num_held} tokens in {len(table)} blocks, "
                    f"expected {self._blocks_for(seq.num_held)}"
                )
            if seq.num_held > len(seq.tokens) + seq.num_lookahead:
                raise AssertionError(f"sequence {seq_id!r} holds slots for tokens it lacks")
            if seq.cpu_blocks is not None:
                if seq.blocks:
                    raise AssertionError(f"swapped sequence {seq_id!r} still holds GPU blocks")
                held_cpu.extend(seq.cpu_blocks)
            else:
                if len({id(block) for block in seq.blocks}) != len(seq.blocks):
                    raise AssertionError(f"sequence {seq_id!r} holds a block twice")
                expected_refs.update(block.block_id for block in seq.blocks)
            num_computed = seq.num_computed
            if not 0 <= num_computed <= min(seq.num_held, len(seq.tokens)):
                raise AssertionError(f"sequence {seq_id!r} has {num_computed} computed tokens")
            # Hashed blocks past the computed ones are only those a step is about to write:
            # in the prefix cache they are scheduled blocks.
            num_ahead = len(seq.block_hashes) - num_computed // self.block_size
            ahead = seq.blocks[num_computed // self.block_size : len(seq.block_hashes)]
            if num_ahead > 0 and (
                len(ahead) < num_ahead
                or any(b.block_hash is not None and b not in self._scheduled for b in ahead)
            ):
                raise AssertionError(f"sequence {seq_id!r} hashed blocks that are not computed")
        for block in self._scheduled:
            if block.ref_count == 0:
                raise AssertionError(f"scheduled block {block.block_id} is held by no one")
        expected_refs.update(self._pool.runs)  # LoRA adapters' blocks (`adapters.py`)
        for block in self._pool.blocks:
            if block.ref_count != expected_refs[block.block_id]:
                raise AssertionError(
                    f"block {block.block_id} has ref count {block.ref_count}, "
                    f"held by {expected_refs[block.block_id]} tables and adapters"
                )
        cpu_ids = held_cpu + self._free_cpu_blocks
        if sorted(cpu_ids) != list(range(self.num_cpu_blocks)):
            raise AssertionError(
                f"CPU blocks: {len(held_cpu)} held + {len(self._free_cpu_blocks)} free "
                f"do not partition the {self.num_cpu_blocks} CPU blocks"
            )

    # -- helpers ---------------------------------------------------------------------------

    def _find_cached_prefix(
        self, tokens: array, root: BlockHash
    ) -> tuple[list[Block | int], list[BlockHash], int]:
        """Leading cached blocks of a prompt and their hashes, leaving >= 1 token to compute
        (each a GPU block, or else the id of a host-tier block holding it), and how many
        blocks were looked up in the host tier."""
        if not self.enable_prefix_caching:
            return [], [], 0
        hits: list[Block | int] = []
        hashes: list[BlockHash] = []
        num_tier_queries = 0
        max_hit_tokens = (len(tokens) - 1) // self.block_size * self.block_size
        for block_hash, block_tokens in chain_hashes(
            root, tokens[:max_hit_tokens].tobytes(), self.block_size
        ):
            hit: Block | int | None = self._pool.lookup(block_hash, block_tokens)
            if hit is None and self._tier.num_blocks:
                num_tier_queries += 1
                hit = self._tier.find(block_hash, block_tokens)
            if hit is None:
                break
            hits.append(hit)
            hashes.append(block_hash)
        return hits, hashes, num_tier_queries

    def _take(self, hits: list[Block], num_new: int) -> None:
        """Reference the hit blocks, checking first that `num_new` more blocks fit as well.

        A hit on a free cached block removes it from the free queue, so it counts against
        the free blocks too; checking both together keeps the operation all-or-nothing.
        """
        num_revived = sum(1 for block in hits if block.ref_count == 0)
        if num_new + num_revived > self._pool.num_free_blocks:
            raise NoFreeBlocks(num_new + num_revived, self._pool.num_free_blocks)
        self._pool.touch(hits)

    @staticmethod
    def _check_held(seq_id: SeqId, seq: _Sequence, num_tokens: int, doing: str) -> None:
        """`ValueError` unless the first `num_tokens` tokens are in the record and held."""
        if not 0 <= num_tokens <= min(seq.num_held, len(seq.tokens)):
            raise ValueError(
                f"sequence {seq_id!r}: cannot {doing}, it holds {seq.num_held} slots for "
                f"{len(seq.tokens)} tokens"
            )

    def _cache_full_blocks(self, seq: _Sequence, num_tokens: int) -> list[Block]:
        """Hash the full blocks the first `num_tokens` tokens complete past those hashed, and
        offer them to the prefix cache; the blocks it took (a hash another block already
        serves leaves its block out). All hashing happens before anything is recorded."""
        new_blocks = self._hash_new_full_blocks(seq, num_tokens)
        first_new = len(seq.block_hashes)
        seq.block_hashes.extend(block_hash for block_hash, _ in new_blocks)
        blocks = seq.blocks[first_new : first_new + len(new_blocks)]
        self._pool.cache(blocks, new_blocks)
        return [
            block
            for block, (block_hash, _) in zip(blocks, new_blocks, strict=True)
            if block.block_hash == block_hash
        ]

    def _hash_new_full_blocks(
        self, seq: _Sequence, num_computed: int
    ) -> list[tuple[BlockHash, bytes]]:
        """(hash, token bytes) of the full blocks that computing up to `num_computed` completes.

        Empty with prefix caching off: nothing is ever looked up, so nothing is hashed.
        """
        if not self.enable_prefix_caching:
            return []
        first_new = len(seq.block_hashes)
        parent = seq.block_hashes[-1] if seq.block_hashes else seq.root_hash
        new_tokens = seq.tokens.token_ids[first_new * self.block_size : num_computed].tobytes()
        return list(chain_hashes(parent, new_tokens, self.block_size))

    def _block_tokens(self, seq: _Sequence, index: int) -> bytes:
        return self._block_bytes(seq.tokens.token_ids, index)

    def _allocate(
        self, count: int, plan: MemoryPlan, keep: frozenset[int] = frozenset()
    ) -> list[Block]:
        """`count` fresh GPU blocks; cached KV they held is saved to the host tier first, by
        moves appended to `plan` (ahead of any later move that writes these blocks). Host
        blocks in `keep` are about to be read back and are not overwritten."""
        blocks = self._pool.allocate(count)
        for block_id, block_hash, token_bytes in self._pool.last_evicted:
            host_id = self._tier.store(block_hash, token_bytes, keep)
            if host_id is not None:
                plan.moves.append(BlockMove(MoveKind.SWAP_OUT, block_id, host_id))
        return blocks

    def _block_bytes(self, token_ids: array, index: int) -> bytes:
        start = index * self.block_size
        return token_ids[start : start + self.block_size].tobytes()

    def _grow(self, seq: _Sequence, num_tokens: int, num_ids: int) -> MemoryPlan:
        """Slots up to `num_tokens` of the `num_ids` the sequence has, copying a shared partial
        last block first; all or nothing. New blocks are taken only at block boundaries."""
        if not seq.num_held <= num_tokens <= num_ids:
            raise ValueError(
                f"sequence {seq.tokens.seq_id!r}: cannot hold {num_tokens} tokens, it holds "
                f"{seq.num_held} of its {num_ids}"
            )
        if num_tokens == seq.num_held:
            return MemoryPlan()
        last = seq.blocks[-1]
        needs_copy = seq.num_held % self.block_size != 0 and last.ref_count > 1
        num_new = self._blocks_for(num_tokens) - len(seq.blocks)
        if num_new + needs_copy > self._pool.num_free_blocks:
            raise NoFreeBlocks(num_new + needs_copy, self._pool.num_free_blocks)
        plan = MemoryPlan()
        if needs_copy:
            [private] = self._allocate(1, plan)
            self._pool.release([last])
            seq.blocks[-1] = private
            plan.moves.append(BlockMove(MoveKind.COPY, last.block_id, private.block_id))
            self._cow_copies += 1
            self._mark_table_changed(seq, len(seq.blocks) - 1)
        if num_new:
            self._mark_table_changed(seq, len(seq.blocks))
        seq.blocks.extend(self._allocate(num_new, plan))
        seq.num_held = num_tokens
        return plan

    @staticmethod
    def _mark_table_changed(seq: _Sequence, first: int) -> None:
        if seq.table_changed_from is None or first < seq.table_changed_from:
            seq.table_changed_from = first

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _get(self, seq_id: SeqId) -> _Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequence(seq_id)
        return seq

    def _resident(self, seq_id: SeqId, operation: str) -> _Sequence:
        seq = self._get(seq_id)
        if seq.cpu_blocks is not None:
            raise SequenceSwappedOut(seq_id, operation)
        return seq
