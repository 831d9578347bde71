"""Random operation sequences against an independent model of what the manager must hold.

The model keeps, per sequence, its tokens, how many are computed and whether it is swapped
out. From it alone the test derives table lengths, ref counts and free counts. Like the
engine, the machine joins the plans of several operations into one step plan and has a slot
store (kv_oracle) execute it as `KVCache.execute` would, before any KV is written; then each
sequence must read back exactly its own computed tokens. Pools are tiny so NoFreeBlocks is
frequent; a failed operation, or one given an invalid token id, must change nothing. Prompts
carry one of a few cache salts: a prefix hit must be a prefix some sequence of the same salt
computed.

Some sequences are driven as the engine drives them: their owner keeps a `SequenceTokens`
record that the manager shares (no copy), appends to it and asks the manager to `grow`; the
record's computed count must always be the manager's. A mirror of the runner's block tables is
kept from `take_table_update` alone and must equal the manager's tables whenever it is synced.

Those sequences also speculate as the engine does: lookahead slots are reserved past the record
(`allocate_slots(..., num_lookahead_tokens=k)`), the KV of drafted tokens is written into them,
a prefix of the drafts is accepted into the record and the rest is forgotten (`trim`). Every
cached block, on the GPU or in the host tier, must then hold exactly the tokens it is cached
under: an unaccepted draft's KV never reaches the prefix cache.
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagedkv.memory import InvalidTokenIds, KVCacheManager, MemoryPlan, MoveKind, NoFreeBlocks
from pagedkv.memory.tokens import TOKEN_TYPECODE, SequenceTokens

from .kv_oracle import SlotStore
from .test_rules import snapshot

# Prompts drawn from a few shared stems so prefix-cache hits are common.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9], [5] * 12]
prompts = st.builds(
    lambda stem, cut, tail: stem[:cut] + tail,
    st.sampled_from(STEMS),
    st.integers(1, 12),
    st.lists(st.integers(0, 3), max_size=6),
)
picks = st.integers(0, 1_000)
salts = st.sampled_from([None, "tenant-a", "tenant-b"])
bad_ids = st.sampled_from([-1, 2**63, 2**70, True, 1.5, "7", None])


@dataclass
class ModelSeq:
    token_ids: list[int]  # the tokens the manager holds slots for
    num_computed: int
    salt: str | None
    swapped: bool = False
    record: SequenceTokens | None = None  # the owner's record, shared with the manager
    lookahead: int = 0  # slots held past `token_ids` (for drafts)


class MemoryRules(RuleBasedStateMachine):
    """The rules and invariants; subclasses choose the pools they run over."""

    def setup(
        self, block_size, num_gpu_blocks, num_cpu_blocks, prefix_caching, num_offload_blocks
    ) -> None:
        self.manager = KVCacheManager(
            num_gpu_blocks, block_size, num_cpu_blocks, prefix_caching, num_offload_blocks
        )
        self.store = SlotStore(self.manager)
        self.step_plan = MemoryPlan()  # moves of this step, not yet executed
        self.model: dict[int, ModelSeq] = {}
        self.computed_prefixes: set[tuple[str | None, tuple[int, ...]]] = set()
        self.next_id = 0
        self.runner_tables: dict[int, list[int]] = {}  # built from table updates only

    def _pick(self, pick: int) -> tuple[int, ModelSeq | None]:
        """A live sequence chosen by `pick` (rules do nothing while there is none)."""
        if not self.model:
            return -1, None
        seq_id = sorted(self.model)[pick % len(self.model)]
        return seq_id, self.model[seq_id]

    def _fails_cleanly(self, operation, *args) -> bool:
        """Run an operation; on NoFreeBlocks check it changed nothing and report failure."""
        before = snapshot(self.manager)
        try:
            self.result = operation(*args)
        except NoFreeBlocks:
            assert snapshot(self.manager) == before
            return True
        return False

    def _run_step_plan(self) -> None:
        """What the runner does before a forward pass: execute the step's plan as a whole."""
        self.store.execute(self.step_plan)
        self.step_plan = MemoryPlan()

    def _compute(self, seq_id: int, seq: ModelSeq, upto: int) -> None:
        """What a forward pass does: write the KV of the tokens up to `upto`, then mark them."""
        if upto > seq.num_computed:
            self._run_step_plan()
            self.store.write(seq_id, seq.token_ids, seq.num_computed, upto)
            seq.num_computed = upto
            size = self.manager.block_size
            for end in range(size, upto + 1, size):
                self.computed_prefixes.add((seq.salt, tuple(seq.token_ids[:end])))
        self.manager.mark_computed(seq_id, upto)

    @rule(prompt=prompts, salt=salts, compute=st.booleans(), shared=st.booleans())
    def allocate(self, prompt, salt, compute, shared):
        seq_id = self.next_id
        self.next_id += 1
        record = SequenceTokens(seq_id, prompt) if shared else None
        if self._fails_cleanly(self.manager.allocate, seq_id, record or prompt, salt):
            assert not self.manager.take_pending_plan()
            return
        # Host-tier saves and copies back, run with the step as the engine's scheduler does.
        pending = self.manager.take_pending_plan()
        if any(move.kind is MoveKind.SWAP_IN for move in pending):
            event("a prefix hit served from the host tier")
        self.step_plan.extend(pending)
        num_cached = self.result
        size = self.manager.block_size
        assert num_cached % size == 0 and num_cached < len(prompt)
        if not self.manager.enable_prefix_caching:
            assert num_cached == 0
        elif num_cached:
            assert (salt, tuple(prompt[:num_cached])) in self.computed_prefixes
        seq = self.model[seq_id] = ModelSeq(list(prompt), num_cached, salt, record=record)
        if compute:
            self._compute(seq_id, seq, len(seq.token_ids))

    @rule(prompt=prompts, bad=bad_ids, where=picks)
    def allocate_invalid(self, prompt, bad, where):
        prompt = list(prompt)
        prompt[where % len(prompt)] = bad
        before = snapshot(self.manager)
        try:
            self.manager.allocate(self.next_id, prompt)
        except InvalidTokenIds:
            assert snapshot(self.manager) == before
        else:
            raise AssertionError(f"allocate accepted token id {bad!r}")

    @rule(
        pick=picks,
        tokens=st.lists(st.integers(0, 3), min_size=1, max_size=5),
        compute=st.booleans(),
    )
    def append(self, pick, tokens, compute):
        seq_id, seq = self._pick(pick)
        if seq is None or seq.swapped or seq.record is not None:
            return
        if not self._fails_cleanly(self.manager.append, seq_id, tokens):
            self.step_plan.extend(self.result)
            seq.token_ids.extend(tokens)
            if compute:
                self._compute(seq_id, seq, len(seq.token_ids))

    @rule(
        pick=picks,
        tokens=st.lists(st.integers(0, 3), max_size=5),
        compute=st.booleans(),
    )
    def owner_appends_then_grows(self, pick, tokens, compute):
        """The engine's way: the owner appends to its record, then the manager gives slots."""
        seq_id, seq = self._pick(pick)
        if seq is None or seq.swapped or seq.record is None:
            return
        seq.record.extend(tokens)
        # Lookahead slots hold the record's next tokens once it has them (kept drafts).
        absorbed = min(seq.lookahead, len(tokens))
        seq.token_ids += tokens[:absorbed]
        seq.lookahead -= absorbed
        before = snapshot(self.manager)
        allocation = self.manager.allocate_slots(seq_id, seq.record, len(seq.record))
        if allocation is None:  # the pool cannot hold them: nothing changed
            assert snapshot(self.manager) == before
            return
        self.step_plan.extend(allocation.plan)
        self._sync_table(seq_id, allocation.table_update)
        seq.token_ids = list(seq.record.token_ids)
        seq.lookahead = max(0, self.manager.num_tokens(seq_id) - len(seq.token_ids))
        if compute:
            self._compute(seq_id, seq, len(seq.token_ids))

    @rule(pick=picks, k=st.integers(1, 4))
    def reserve_draft_slots(self, pick, k):
        """Slots for the record's tokens and `k` drafts after them, as a speculating engine
        reserves them."""
        seq_id, seq = self._pick(pick)
        if seq is None or seq.swapped or seq.record is None:
            return
        before = snapshot(self.manager)
        allocation = self.manager.allocate_slots(
            seq_id, seq.record, len(seq.record), num_lookahead_tokens=k
        )
        if allocation is None:
            assert snapshot(self.manager) == before
            return
        self.step_plan.extend(allocation.plan)
        self._sync_table(seq_id, allocation.table_update)
        seq.token_ids = list(seq.record.token_ids)
        seq.lookahead = self.manager.num_tokens(seq_id) - len(seq.token_ids)
        assert seq.lookahead >= k

    @rule(
        pick=picks,
        drafts=st.lists(st.integers(0, 3), min_size=1, max_size=4),
        accepted=picks,
        sampled=st.integers(0, 3),
    )
    def verify_drafts(self, pick, drafts, accepted, sampled):
        """A speculative step: the KV of the uncomputed tokens and of the drafts is written,
        `accepted` of the drafts and one sampled token join the record, the KV of the kept
        tokens is marked computed and the slots past the record are given back."""
        seq_id, seq = self._pick(pick)
        if seq is None or seq.swapped or seq.record is None or not seq.lookahead:
            return
        if seq.token_ids != list(seq.record.token_ids):
            return  # the owner appended tokens it holds no slot for: it grows them first
        drafts = drafts[: seq.lookahead]
        self._run_step_plan()
        chunk = seq.token_ids + drafts
        self.store.write(seq_id, chunk, seq.num_computed, len(chunk))
        kept = accepted % (len(drafts) + 1)
        held = self.manager.num_tokens(seq_id)
        seq.record.extend(drafts[:kept] + [sampled])
        upto = len(seq.token_ids) + kept
        seq.token_ids = list(seq.record.token_ids[:held])
        seq.num_computed = upto
        self.manager.mark_computed(seq_id, upto)
        size = self.manager.block_size
        for end in range(size, upto + 1, size):
            self.computed_prefixes.add((seq.salt, tuple(seq.token_ids[:end])))
        num_free = self.manager.num_free_blocks
        self.manager.trim(seq_id, min(len(seq.record), held))
        seq.token_ids = seq.token_ids[: min(len(seq.record), held)]
        seq.lookahead = 0
        assert len(self.manager.block_table(seq_id)) == -(-len(seq.token_ids) // size)
        assert self.manager.num_free_blocks >= num_free

    @rule(pick=picks)
    def sync_runner_table(self, pick):
        seq_id, seq = self._pick(pick)
        if seq is None or seq.swapped:
            return
        self._sync_table(seq_id, self.manager.take_table_update(seq_id))
        assert self.runner_tables[seq_id] == self.manager.block_table(seq_id)
        assert self.manager.take_table_update(seq_id) is None

    def _sync_table(self, seq_id: int, update: tuple[int, list[int]] | None) -> None:
        """Apply a table update as the runner does."""
        if update is not None:
            first, block_ids = update
            assert first == 0 or seq_id in self.runner_tables
            self.runner_tables[seq_id] = self.runner_tables.get(seq_id, [])[:first] + block_ids

    @rule(pick=picks, bad=bad_ids)
    def append_invalid(self, pick, bad):
        seq_id, seq = self._pick(pick)
        if seq is None or seq.swapped or seq.record is not None:
            return
        before = snapshot(self.manager)
        try:
            self.manager.append(seq_id, [1, bad])
        except InvalidTokenIds:
            assert snapshot(self.manager) == before
        else:
            raise AssertionError(f"append accepted token id {bad!r}")

    @rule(pick=picks, fraction=st.floats(0, 1))
    def mark_computed(self, pick, fraction):
        seq_id, seq = self._pick(pick)
        if seq is None or seq.swapped:
            return
        self._compute(seq_id, seq, round(fraction * len(seq.token_ids)))

    @rule(pick=picks)
    def fork(self, pick):
        parent, seq = self._pick(pick)
        if seq is None or seq.swapped:
            return
        child = self.next_id
        self.next_id += 1
        record = None if seq.record is None else seq.record.copy(child)
        self.manager.fork(parent, child, record)
        self.model[child] = ModelSeq(list(seq.token_ids), seq.num_computed, seq.salt, record=record)

    @rule(pick=picks)
    def free(self, pick):
        seq_id, seq = self._pick(pick)
        if seq is None:
            return
        del self.model[seq_id]
        self.runner_tables.pop(seq_id, None)
        self.manager.free(seq_id)

    @rule(pick=picks)
    def swap_out(self, pick):
        seq_id, seq = self._pick(pick)
        if seq is None or seq.swapped:
            return
        if not self._fails_cleanly(self.manager.swap_out, seq_id):
            self.step_plan.extend(self.result)
            seq.swapped = True

    @rule(pick=picks)
    def swap_in(self, pick):
        seq_id, seq = self._pick(pick)
        if seq is None or not seq.swapped:
            return
        if not self._fails_cleanly(self.manager.swap_in, seq_id):
            self.step_plan.extend(self.result)
            seq.swapped = False

    @rule()
    def reset_prefix_cache(self):
        """vLLM's reset: refused while a sequence holds blocks; done, nothing cached is left
        (device or tier), so the allocate rule's check that a hit is a prefix computed
        earlier then means computed since the reset."""
        reset = self.manager.reset_prefix_cache()
        assert reset == (not self.model)
        if reset:
            event("the prefix cache was reset")
            self.computed_prefixes.clear()
            assert not any(map(self.manager.is_cached, range(self.manager.num_gpu_blocks)))
            assert self.manager.offload_stats.num_blocks == 0

    @rule()
    def end_step(self):
        self._run_step_plan()

    @rule()
    def the_step_fails_before_its_plan(self):
        """The engine's failed step: the plan never ran (or ran part way: its destinations hold
        garbage), `discard_plan` takes back what it promised, and the sequences it names are
        dropped. The invariants below then hold: every cached block (GPU or tier) and every
        surviving sequence still holds the tokens it claims."""
        if not self.step_plan:
            return
        plan, self.step_plan = self.step_plan, MemoryPlan()
        gpu = {move.dst for move in plan if move.kind is not MoveKind.SWAP_OUT}
        cpu = {move.dst for move in plan if move.kind is MoveKind.SWAP_OUT}
        holding = {
            seq_id
            for seq_id, seq in self.model.items()
            if set(self.manager.block_table(seq_id)) & (cpu if seq.swapped else gpu)
        }
        # A step that failed part way may have written anything into them.
        size = self.manager.block_size
        for slots, blocks in ((self.store.gpu, gpu), (self.store.cpu, cpu)):
            slots.update({(block, offset): -1 for block in blocks for offset in range(size)})
        dropped = self.manager.discard_plan(plan)
        assert dropped == holding
        event("a failed step dropped sequences" if dropped else "a failed step dropped none")
        for seq_id in dropped:
            self.free(sorted(self.model).index(seq_id))

    @rule(
        first=st.one_of(st.none(), prompts),
        salt=salts,
        pick=picks,
        fraction=st.floats(0, 1),
        cuts=st.lists(picks, min_size=1, max_size=3),
        tails=st.lists(st.integers(0, 3), max_size=3),
        fails=st.booleans(),
    )
    def prompts_admitted_in_a_step_share_what_it_schedules(
        self, first, salt, pick, fraction, cuts, tails, fails
    ):
        """The engine's step over a sequence's next tokens (a held one's, or the `first` prompt
        admitted in it): their full blocks are cached when scheduled (`mark_scheduled`), and
        prompts admitted after it in the same step, each beginning with some of its tokens,
        hit them and are scheduled in turn. Then the step
        runs (every scheduled token's KV is written, then `commit_scheduled`), or it fails
        before writing any: `discard_plan` takes back its plan and its scheduled blocks, and
        the engine drops the sequences it names and those with a chunk in the step. Either way
        the invariants hold after: a hit is a prefix computed or scheduled under the salt, and
        no cached block, no surviving sequence, holds KV it does not claim."""
        if first is not None:
            seq_id = self.next_id
            self.next_id += 1
            if self._fails_cleanly(self.manager.allocate, seq_id, first, salt):
                assert not self.manager.take_pending_plan()
                return
            self.step_plan.extend(self.manager.take_pending_plan())
            if self.result:
                assert (salt, tuple(first[: self.result])) in self.computed_prefixes
            seq = self.model[seq_id] = ModelSeq(list(first), self.result, salt)
        else:
            seq_id, seq = self._pick(pick)
        if seq is None or seq.swapped:
            return
        size = self.manager.block_size
        upto = seq.num_computed + round(fraction * (len(seq.token_ids) - seq.num_computed))
        written = self.manager.block_table(seq_id)[seq.num_computed // size : -(-upto // size)]
        if any(self.manager.block_ref_count(b) > 1 or self.manager.is_cached(b) for b in written):
            return  # an engine's step writes only private, uncached slots (forks share computed)
        scheduled: dict[int, int] = {}  # sequence -> tokens the step writes, from num_computed
        scheduled_prefixes: set[tuple[str | None, tuple[int, ...]]] = set()

        def schedule(sid: int, upto: int) -> None:
            self.manager.mark_scheduled(sid, upto)
            scheduled[sid] = upto
            for end in range(size, upto + 1, size):
                scheduled_prefixes.add((seq.salt, tuple(self.model[sid].token_ids[:end])))

        schedule(seq_id, upto)
        for cut in cuts:
            prompt = seq.token_ids[: cut % (len(seq.token_ids) + 1)] + tails
            if not prompt:
                continue
            new_id = self.next_id
            self.next_id += 1
            if self._fails_cleanly(self.manager.allocate, new_id, prompt, seq.salt):
                assert not self.manager.take_pending_plan()
                continue
            self.step_plan.extend(self.manager.take_pending_plan())
            num_cached = self.result
            prefix = (seq.salt, tuple(prompt[:num_cached]))
            if num_cached:
                assert prefix in self.computed_prefixes or prefix in scheduled_prefixes
            if prefix in scheduled_prefixes - self.computed_prefixes:
                event("a prompt hit blocks scheduled in its own step")
            self.model[new_id] = ModelSeq(list(prompt), num_cached, seq.salt)
            schedule(new_id, len(prompt))
        if fails:
            plan, self.step_plan = self.step_plan, MemoryPlan()
            gpu = {move.dst for move in plan if move.kind is not MoveKind.SWAP_OUT}
            cpu = {move.dst for move in plan if move.kind is MoveKind.SWAP_OUT}
            # The step wrote nothing it promised: its destinations and slots hold garbage.
            for slots, blocks in ((self.store.gpu, gpu), (self.store.cpu, cpu)):
                slots.update({(block, offset): -1 for block in blocks for offset in range(size)})
            for sid, upto in scheduled.items():
                start = self.model[sid].num_computed
                self.store.write(sid, [-1] * upto, start, upto)
            dropped = self.manager.discard_plan(plan)
            for sid in sorted(dropped | set(scheduled)):
                self.free(sorted(self.model).index(sid))
            return
        self._run_step_plan()
        for sid, upto in scheduled.items():
            model = self.model[sid]
            self.store.write(sid, model.token_ids, model.num_computed, upto)
        self.manager.commit_scheduled()
        for sid, upto in scheduled.items():
            self._compute(sid, self.model[sid], upto)

    @invariant()
    def manager_is_consistent(self):
        self.manager.check_invariants()

    @invariant()
    def tables_match_the_model(self):
        manager, size = self.manager, self.manager.block_size
        assert sorted(manager.seq_ids) == sorted(self.model)
        refs: Counter[int] = Counter()
        for seq_id, seq in self.model.items():
            table = manager.block_table(seq_id)
            assert len(table) == -(-(len(seq.token_ids) + seq.lookahead) // size)
            assert manager.num_tokens(seq_id) == len(seq.token_ids) + seq.lookahead
            assert manager.num_computed_tokens(seq_id) == seq.num_computed
            assert manager.is_swapped_out(seq_id) == seq.swapped
            if seq is None or not seq.swapped:
                refs.update(table)
        for block in range(manager.num_gpu_blocks):
            assert manager.block_ref_count(block) == refs[block]
        assert manager.num_free_blocks == manager.num_gpu_blocks - len(refs)
        cpu_held = sum(len(manager.block_table(s)) for s, q in self.model.items() if q.swapped)
        assert manager.num_free_cpu_blocks == manager.num_cpu_blocks - cpu_held

    @invariant()
    def shared_records_are_the_one_truth(self):
        for seq in self.model.values():
            if seq.record is not None:
                assert list(seq.record.token_ids[: len(seq.token_ids)]) == seq.token_ids

    @invariant()
    def every_sequence_reads_back_its_own_computed_tokens(self):
        if self.step_plan:
            return  # the KV moves of this step are still to run
        for seq_id, seq in self.model.items():
            computed = seq.token_ids[: seq.num_computed]
            assert self.store.read(seq_id, seq.num_computed) == computed

    @invariant()
    def cached_blocks_hold_the_tokens_they_are_cached_under(self):
        """No block of the prefix cache, on the GPU or in its host tier, holds KV of tokens
        other than those its hash names (a rejected draft's, say)."""
        if self.step_plan:
            return
        size = self.manager.block_size
        # White-box: the cache's entries are private; their contents are what this checks.
        for block in self.manager._pool.cached.values():
            tokens = array(TOKEN_TYPECODE, block.token_bytes).tolist()
            assert len(tokens) == size
            assert self.store._block(self.store.gpu, block.block_id) == tokens
        for host_id, token_bytes in self.manager._tier._entries.values():
            tokens = array(TOKEN_TYPECODE, token_bytes).tolist()
            assert self.store._block(self.store.cpu, host_id) == tokens

    def teardown(self):
        if not hasattr(self, "manager"):
            return
        for seq_id in list(self.model):
            self.manager.free(seq_id)
        self.manager.check_invariants()
        assert self.manager.num_free_blocks == self.manager.num_gpu_blocks
        assert self.manager.num_free_cpu_blocks == self.manager.num_cpu_blocks


class KVCacheMachine(MemoryRules):
    @initialize(
        block_size=st.sampled_from([1, 2, 3, 4]),
        num_gpu_blocks=st.integers(2, 20),
        num_cpu_blocks=st.integers(0, 8),
        prefix_caching=st.booleans(),
        num_offload_blocks=st.sampled_from([0, 0, 1, 3, 8]),
    )
    def start(self, block_size, num_gpu_blocks, num_cpu_blocks, prefix_caching, num_offload_blocks):
        self.setup(block_size, num_gpu_blocks, num_cpu_blocks, prefix_caching, num_offload_blocks)


KVCacheMachine.TestCase.settings = settings(max_examples=500, stateful_step_count=30, deadline=None)
test_kv_cache_manager = KVCacheMachine.TestCase


class HostTierMachine(MemoryRules):
    """The same rules over GPU pools of a few blocks with a host tier, plus prompts that
    repeat computed prefixes, so cached blocks are evicted to the tier and served back from
    it often (the machine above rarely gets there)."""

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_gpu_blocks=st.integers(3, 8),
        num_cpu_blocks=st.integers(0, 4),
        num_offload_blocks=st.integers(1, 10),
    )
    def start(self, block_size, num_gpu_blocks, num_cpu_blocks, num_offload_blocks):
        self.setup(block_size, num_gpu_blocks, num_cpu_blocks, True, num_offload_blocks)

    @rule(prompt=prompts, salt=salts)
    def a_request_comes_and_goes(self, prompt, salt):
        """Computed, then freed: its full blocks stay cached until the pool evicts them."""
        seq_id = self.next_id
        self.allocate(prompt, salt, compute=True, shared=False)
        if seq_id in self.model:
            self.free(sorted(self.model).index(seq_id))

    @rule(pick=picks, tail=st.lists(st.integers(0, 3), min_size=1, max_size=3))
    def allocate_a_computed_prefix_again(self, pick, tail):
        if self.computed_prefixes:
            salt, prefix = sorted(self.computed_prefixes, key=repr)[
                pick % len(self.computed_prefixes)
            ]
            self.allocate(list(prefix) + tail, salt, compute=True, shared=False)

    @rule(pick=picks, tail=st.lists(st.integers(0, 3), min_size=1, max_size=3))
    def a_prefix_hit_whose_step_fails(self, pick, tail):
        """A prompt served from the cache (often copied back from the tier), then its step
        fails before the copies ran."""
        if self.computed_prefixes:
            salt, prefix = sorted(self.computed_prefixes, key=repr)[
                pick % len(self.computed_prefixes)
            ]
            self.allocate(list(prefix) + tail, salt, compute=False, shared=False)
            self.the_step_fails_before_its_plan()


HostTierMachine.TestCase.settings = settings(
    max_examples=250, stateful_step_count=40, deadline=None
)
test_host_tier = HostTierMachine.TestCase
