"""LoRA adapters paged into the KV pool: invariants over random operation sequences.

A hypothesis state machine drives `AdapterBlocks` and a `KVCacheManager` over one pool: requests
of random adapters arrive (acquire), finish (release), sequences take and free KV blocks, and
KV that does not fit makes idle adapters give their blocks back. After every step, checked
against a model kept here: no block is leaked or held twice, each resident adapter holds one
run of consecutive blocks that nothing else holds, at most `max_loras` are resident, an adapter
in use is never evicted, the changes handed to the worker leave it seeing exactly the resident
adapters, and the manager's own invariants (ref counts = tables + adapter runs) hold. `place`
and `blocks_needed` are checked against their definition: matrices never overlap, never
straddle a region, and one block fewer would not do.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv.kvmath.lora import blocks_needed, place
from pagedkv.memory import KVCacheManager
from pagedkv.memory.adapters import AdapterBlocks
from pagedkv.memory.tokens import SequenceTokens

NUM_BLOCKS = 40
BLOCK_SIZE = 4
ADAPTER_BLOCKS = {1: 3, 2: 7, 3: 1, 4: 12, 5: 5}  # lora id -> blocks it takes


class AdaptersAndKV(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, 0, enable_prefix_caching=True)
        self.adapters = AdapterBlocks(self.manager.pool, max_loras=3)
        self.users: dict[int, int] = {}  # lora id -> requests holding it (the model)
        self.seqs: list[tuple[str, int]] = []
        self.next_seq = 0
        self.worker: dict[int, int] = {}  # what the worker holds: lora id -> first block

    @rule(lora_id=st.sampled_from(sorted(ADAPTER_BLOCKS)))
    def request_arrives(self, lora_id: int) -> None:
        resident_before = set(self.adapters.resident)
        got = self.adapters.acquire(lora_id, ADAPTER_BLOCKS[lora_id])
        if got is None:
            # Refused only when a slot or a run could not be made from idle adapters.
            assert lora_id not in resident_before
            return
        assert got.lora_id == lora_id and got.num_blocks == ADAPTER_BLOCKS[lora_id]
        self.users[lora_id] = self.users.get(lora_id, 0) + 1

    @precondition(lambda self: any(self.users.values()))
    @rule(data=st.data())
    def request_finishes(self, data) -> None:
        lora_id = data.draw(st.sampled_from(sorted(k for k, v in self.users.items() if v)))
        self.adapters.release(lora_id)
        self.users[lora_id] -= 1

    @rule(num_tokens=st.integers(1, 30), prefix=st.integers(0, 2))
    def sequence_takes_kv(self, num_tokens: int, prefix: int) -> None:
        seq_id = ("s", self.next_seq)
        self.next_seq += 1
        tokens = SequenceTokens(seq_id, [prefix] * 8 + list(range(num_tokens)))
        while (allocation := self.manager.allocate_slots(seq_id, tokens, len(tokens))) is None:
            if not self.adapters.evict_idle():
                return  # the pool is held by running sequences and adapters in use
        self.manager.mark_computed(seq_id, len(tokens))
        self.seqs.append(seq_id)
        assert allocation is not None

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def sequence_frees_kv(self, data) -> None:
        seq_id = self.seqs.pop(data.draw(st.integers(0, len(self.seqs) - 1)))
        self.manager.free(seq_id)

    @rule()
    def worker_takes_changes(self) -> None:
        """The worker forgets the evicted, then writes the loaded: it then sees exactly the
        resident adapters, each in its own run (a load evicted in the same step never
        reaches it; one evicted and loaded again lands in its new run)."""
        changes = self.adapters.take_changes()
        for lora_id in changes.evicted:
            self.worker.pop(lora_id, None)
        for adapter in changes.loaded:
            self.worker[adapter.lora_id] = adapter.first_block
        resident = {i: adapter.first_block for i, adapter in self.adapters.resident.items()}
        assert self.worker == resident

    @invariant()
    def blocks_are_accounted_for(self) -> None:
        self.manager.check_invariants()
        self.manager.pool.check_invariants()
        resident = self.adapters.resident
        assert len(resident) <= self.adapters.max_loras
        held = [b for seq in self.seqs for b in self.manager.block_table(seq)]
        runs = []
        for lora_id, adapter in resident.items():
            run = list(range(adapter.first_block, adapter.first_block + adapter.num_blocks))
            assert adapter.num_blocks == ADAPTER_BLOCKS[lora_id]
            assert adapter.ref_count == self.users.get(lora_id, 0)
            runs += run
        for lora_id, count in self.users.items():
            assert count == 0 or lora_id in resident, "an adapter in use was evicted"
        assert len(set(runs)) == len(runs) and not set(runs) & set(held)
        assert set(runs) == self.manager.pool.runs
        assert self.manager.num_free_blocks == NUM_BLOCKS - len(set(held)) - len(runs)


TestAdaptersAndKV = AdaptersAndKV.TestCase
TestAdaptersAndKV.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@given(
    st.lists(st.lists(st.integers(1, 300), max_size=6), min_size=1, max_size=4),
    st.integers(16, 256),
)
def test_place_packs_matrices_without_overlap(layer_sizes, chunk_elements):
    num_blocks = blocks_needed(layer_sizes, chunk_elements)
    placements = place(layer_sizes, num_blocks, chunk_elements)
    capacity = num_blocks * chunk_elements
    for sizes, where in zip(layer_sizes, placements, strict=True):
        spans = sorted(
            (region, offset, offset + size)
            for size, (region, offset) in zip(sizes, where, strict=True)
        )
        for region, start, end in spans:
            assert start >= 0 and end <= capacity and region in (0, 1)
        for (r1, _, e1), (r2, s2, _) in zip(spans, spans[1:], strict=False):
            assert r1 != r2 or e1 <= s2, "two matrices overlap"
    if num_blocks > 1:
        try:
            place(layer_sizes, num_blocks - 1, chunk_elements)
        except ValueError:
            return
        raise AssertionError(f"{num_blocks - 1} blocks would do")
