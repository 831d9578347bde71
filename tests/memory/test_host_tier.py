"""The host tier of the prefix cache: evicted blocks saved to host RAM and served back.

Prompts come and go through a GPU pool of a few blocks, as turns of chats do: each is
allocated, its plan executed on the slot store (kv_oracle), computed, and freed. Whatever the
tier serves must read back as the prompt's own tokens; a hit is never across salts; with the
tier off, the same run computes at least as many tokens; every block is free at the end.
"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from pagedkv.memory import KVCacheManager, MoveKind

from .kv_oracle import SlotStore

STEMS = [list(range(1, 17)), [1, 2, 3, 4, 9, 9, 9, 9, 8, 8], [5] * 14]
turns = st.lists(
    st.tuples(
        st.sampled_from(range(len(STEMS))),
        st.integers(2, 16),
        st.lists(st.integers(0, 3), max_size=4),
        st.sampled_from([None, "tenant-a"]),
    ),
    min_size=1,
    max_size=25,
)


def run(turns, num_gpu_blocks: int, num_offload_blocks: int) -> int:
    """Prompt tokens computed over the turns; checks every read-back on the way."""
    manager = KVCacheManager(num_gpu_blocks, 2, 0, True, num_offload_blocks)
    store = SlotStore(manager)
    computed = 0
    for index, (stem, cut, tail, salt) in enumerate(turns):
        prompt = STEMS[stem][:cut] + tail
        if -(-len(prompt) // 2) > num_gpu_blocks:
            continue
        num_cached = manager.allocate(index, prompt, salt)
        plan = manager.take_pending_plan()
        if any(move.kind is MoveKind.SWAP_IN for move in plan):
            event("served from the host tier")
        store.execute(plan)
        assert store.read(index, num_cached) == prompt[:num_cached]
        store.write(index, prompt, num_cached, len(prompt))
        manager.mark_computed(index, len(prompt))
        computed += len(prompt) - num_cached
        manager.free(index)
        manager.check_invariants()
    assert manager.num_free_blocks == num_gpu_blocks
    return computed


@settings(max_examples=300, deadline=None)
@given(turns=turns, num_gpu_blocks=st.integers(8, 12), num_offload_blocks=st.integers(1, 12))
def test_the_tier_serves_the_right_kv_and_never_computes_more(
    turns, num_gpu_blocks, num_offload_blocks
):
    with_tier = run(turns, num_gpu_blocks, num_offload_blocks)
    assert with_tier <= run(turns, num_gpu_blocks, 0)


def test_salted_blocks_are_served_only_to_their_salt():
    manager = KVCacheManager(3, 2, 0, True, 8)
    for seq_id, salt in (("a", "tenant-a"), ("filler", None)):
        prompt = [1, 2, 3, 4, 5] if seq_id == "a" else [7] * 6
        manager.allocate(seq_id, prompt, salt)
        manager.mark_computed(seq_id, len(prompt))
        manager.free(seq_id)
    assert manager.offload_stats.num_blocks == 2  # a's two full blocks, evicted by the filler
    assert manager.allocate("b", [1, 2, 3, 4, 5], "tenant-b") == 0
    manager.free("b")
    assert manager.allocate("c", [1, 2, 3, 4, 5], "tenant-a") == 4
    plan = manager.take_pending_plan()
    assert [move.kind for move in plan].count(MoveKind.SWAP_IN) == 2
