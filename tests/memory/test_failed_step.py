"""`discard_plan`: what a step whose plan never ran promised is taken back.

Oracle: the plan's own moves. Every block it would have written is out of the GPU prefix
cache and the host tier, and the sequences holding one are exactly those returned; a later
prompt with the same prefix is served from a copy that did run, never from the block the
failed copy targeted. The random-sequence version is `test_state_machine`'s
`the_step_fails_before_its_plan`.
"""

from __future__ import annotations

from pagedkv.memory import KVCacheManager, MoveKind

PROMPT = [1, 2, 3]  # one full block of 2 tokens, then a partial one
OTHER = [7, 7, 7]


def computed_then_freed(manager: KVCacheManager, seq_id: int, prompt: list[int]) -> None:
    manager.allocate(seq_id, prompt)
    manager.take_pending_plan()  # (run by the step: these copies happened)
    manager.mark_computed(seq_id, len(prompt))
    manager.free(seq_id)


def test_a_copy_back_from_the_host_tier_that_never_ran_is_not_served():
    manager = KVCacheManager(2, 2, 0, True, 4)
    computed_then_freed(manager, 0, PROMPT)
    computed_then_freed(manager, 1, OTHER)  # evicts PROMPT's block to the tier
    assert manager.allocate(2, [*PROMPT[:2], 9]) == 2  # a tier hit, copied back
    plan = manager.take_pending_plan()
    [copy_back] = [move for move in plan if move.kind is MoveKind.SWAP_IN]
    assert manager.is_cached(copy_back.dst)
    assert manager.discard_plan(plan) == {2}
    assert not manager.is_cached(copy_back.dst)
    manager.free(2)
    assert manager.allocate(3, [*PROMPT[:2], 8]) == 2  # served from the tier again
    assert [m.kind for m in manager.take_pending_plan()] == [MoveKind.SWAP_IN]
    manager.check_invariants()


def test_a_save_to_the_host_tier_that_never_ran_is_forgotten():
    manager = KVCacheManager(2, 2, 0, True, 4)
    computed_then_freed(manager, 0, PROMPT)
    manager.allocate(1, OTHER)  # evicts PROMPT's block: its save is in this plan
    plan = manager.take_pending_plan()
    assert [move.kind for move in plan] == [MoveKind.SWAP_OUT]
    assert manager.discard_plan(plan) == set()  # the block's new owner is not written by it
    manager.free(1)
    assert manager.allocate(2, [*PROMPT[:2], 9]) == 0  # not served from the unwritten save
    assert manager.offload_stats.num_blocks == 0
    manager.check_invariants()


def test_a_swap_that_never_ran_names_its_sequence_and_caches_nothing():
    manager = KVCacheManager(2, 2, 4, True, 0)
    manager.allocate(0, PROMPT)
    manager.mark_computed(0, len(PROMPT))
    swap_out = manager.swap_out(0)
    assert manager.discard_plan(swap_out) == {0}  # its CPU blocks hold nothing
    computed_then_freed(manager, 1, OTHER)  # the GPU blocks PROMPT was in are reused
    swap_in = manager.swap_in(0)
    assert [move.kind for move in swap_in] == [MoveKind.SWAP_IN] * 2
    assert manager.is_cached(swap_in.moves[0].dst)  # its full block, as the copy promised
    assert manager.discard_plan(swap_in) == {0}
    assert not any(manager.is_cached(move.dst) for move in swap_in)
    manager.free(0)
    manager.check_invariants()
