"""MemoryPlan: one ordered list of typed moves, batched only where batching is harmless."""

from __future__ import annotations

from pagedkv.memory import BlockMove, MemoryPlan, MoveBatch, MoveKind

COPY, OUT, IN = MoveKind.COPY, MoveKind.SWAP_OUT, MoveKind.SWAP_IN


def batches(*moves: tuple[MoveKind, int, int]) -> list[MoveBatch]:
    return list(MemoryPlan([BlockMove(*move) for move in moves]).batches())


def test_extend_keeps_the_order_the_plans_were_made_in() -> None:
    step = MemoryPlan()
    assert not step and len(step) == 0
    step.extend(MemoryPlan.of(OUT, [(3, 0), (4, 1)]))
    step.extend(MemoryPlan.of(COPY, [(7, 3)]))
    step.extend(MemoryPlan.of(IN, [(5, 4)]))
    assert step and len(step) == 4
    assert [move.kind for move in step] == [OUT, OUT, COPY, IN]
    assert step.pairs() == [(3, 0), (4, 1), (7, 3), (5, 4)]
    assert str(step) == "[(3, 0), (4, 1), (7, 3), (5, 4)]"
    assert "SWAP_IN" in repr(step)


def test_consecutive_moves_of_one_kind_form_one_batch_in_plan_order() -> None:
    assert batches((OUT, 3, 0), (OUT, 4, 1), (COPY, 7, 3), (COPY, 8, 4), (OUT, 9, 2)) == [
        MoveBatch(OUT, [3, 4], [0, 1]),
        MoveBatch(COPY, [7, 8], [3, 4]),
        MoveBatch(OUT, [9], [2]),
    ]


def test_a_copy_of_a_block_copied_earlier_in_the_run_starts_a_new_batch() -> None:
    # Gathering both sources first would read block 5 before the first copy filled it.
    assert batches((COPY, 1, 5), (COPY, 5, 6)) == [
        MoveBatch(COPY, [1], [5]),
        MoveBatch(COPY, [5], [6]),
    ]


def test_copying_over_a_block_the_run_read_earlier_stays_one_batch() -> None:
    # The gather reads block 1 before the scatter overwrites it, as running in order does.
    assert batches((COPY, 1, 5), (COPY, 6, 1)) == [MoveBatch(COPY, [1, 6], [5, 1])]


def test_a_destination_written_twice_starts_a_new_batch() -> None:
    # A CPU block freed and handed out again within one step.
    assert batches((OUT, 3, 0), (OUT, 4, 0)) == [MoveBatch(OUT, [3], [0]), MoveBatch(OUT, [4], [0])]
    assert batches((IN, 0, 3), (IN, 1, 3)) == [MoveBatch(IN, [0], [3]), MoveBatch(IN, [1], [3])]


def test_swaps_read_and_write_different_pools_so_equal_ids_do_not_split() -> None:
    # Swap-out reads device block 2 and writes CPU block 2: no hazard between them.
    assert batches((OUT, 1, 2), (OUT, 2, 3)) == [MoveBatch(OUT, [1, 2], [2, 3])]
    assert batches((IN, 1, 2), (IN, 2, 3)) == [MoveBatch(IN, [1, 2], [2, 3])]
