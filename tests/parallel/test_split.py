"""How a dimension splits across ranks: evenly, one replicated KV head per rank when the heads
run out, or (a vocabulary) padded to equal shares."""

from __future__ import annotations

import pytest

from pagedkv.parallel.split import (
    NotDivisible,
    Split,
    split_even,
    split_or_replicate,
    split_padded,
)


def test_an_even_split_gives_each_rank_a_contiguous_run():
    assert [split_even(8, rank, 4, "heads") for rank in range(4)] == [
        Split(0, 2, 2),
        Split(2, 2, 2),
        Split(4, 2, 2),
        Split(6, 2, 2),
    ]


def test_fewer_heads_than_ranks_replicate_one_head_to_each_group_of_ranks():
    # 2 KV heads over 4 ranks: ranks 0-1 keep head 0, ranks 2-3 head 1, the heads their
    # query heads (2 of 8 each, contiguous) read.
    assert [split_or_replicate(2, rank, 4, "heads").first for rank in range(4)] == [0, 0, 1, 1]
    assert split_or_replicate(1, 3, 4, "heads") == Split(0, 1, 1)


@pytest.mark.parametrize(("units", "size"), [(6, 4), (3, 2), (2, 3)])
def test_units_that_cannot_be_split_or_replicated_are_refused(units, size):
    with pytest.raises(NotDivisible, match=rf"{units} heads of q_proj are not divisible by "):
        split_or_replicate(units, 0, size, "heads of q_proj")


def test_a_padded_split_cuts_the_last_rank_at_the_vocabulary():
    assert [split_padded(321, rank, 2) for rank in range(2)] == [
        Split(0, 161, 161),
        Split(161, 160, 161),
    ]
    assert split_padded(5, 3, 4) == Split(5, 0, 2)  # nothing left for the last rank
