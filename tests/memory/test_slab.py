"""SlabAllocator: first fit, and an honest account of where reserved memory goes."""

from __future__ import annotations

import pytest

from pagedkv.memory import NoContiguousSpace, SlabAllocator, UnknownSequence


def test_total_free_space_suffices_but_no_hole_fits() -> None:
    slab = SlabAllocator(100)
    assert [slab.reserve(name, 25) for name in "abcd"] == [0, 25, 50, 75]
    slab.release("a")
    slab.release("c")
    with pytest.raises(NoContiguousSpace) as failure:
        slab.reserve("e", 40)
    assert failure.value.total_free == 50
    assert failure.value.largest_hole == 25
    assert failure.value.is_external_fragmentation
    assert "external fragmentation" in str(failure.value)
    report = slab.report()
    assert report.external_fragmentation == 50
    assert report.largest_hole == 25
    assert slab.holes() == [(0, 25), (50, 25)]


def test_not_enough_space_in_total_is_not_fragmentation() -> None:
    slab = SlabAllocator(100)
    slab.reserve("a", 80)
    with pytest.raises(NoContiguousSpace) as failure:
        slab.reserve("b", 30)
    assert not failure.value.is_external_fragmentation
    assert "not enough in total" in str(failure.value)


def test_first_fit_takes_the_lowest_hole_that_fits() -> None:
    slab = SlabAllocator(100)
    for name in "abcd":
        slab.reserve(name, 20)
    slab.release("a")  # hole [0, 20)
    slab.release("c")  # hole [40, 60)
    assert slab.reserve("small", 10) == 0
    assert slab.reserve("fits second hole", 15) == 40
    assert slab.reserve("tail", 20) == 80
    assert [row[:2] for row in slab.reservations()] == [
        ("small", 0),
        ("b", 20),
        ("fits second hole", 40),
        ("d", 60),
        ("tail", 80),
    ]


def test_report_splits_reservation_waste_and_internal_fragmentation() -> None:
    slab = SlabAllocator(1000)
    slab.reserve("running", 300)
    slab.write("running", 120)
    slab.reserve("finished", 200)
    slab.write("finished", 50)
    slab.release("finished")
    report = slab.report()
    assert (report.reserved, report.used) == (300, 120)
    assert report.reservation_waste == 180
    assert report.internal_fragmentation == 150
    assert report.num_free == 700
    assert report.utilization == pytest.approx(0.4)


def test_writing_past_the_reservation_or_to_an_unknown_request_is_an_error() -> None:
    slab = SlabAllocator(100)
    slab.reserve("a", 10)
    with pytest.raises(ValueError, match="overflows its slab"):
        slab.write("a", 11)
    with pytest.raises(ValueError, match="cannot write -1 tokens"):
        slab.write("a", -1)
    with pytest.raises(UnknownSequence):
        slab.write("b", 1)
    with pytest.raises(ValueError, match="must be positive"):
        slab.reserve("c", 0)


def test_a_request_too_big_for_the_whole_pool_is_not_fragmentation() -> None:
    slab = SlabAllocator(100)
    with pytest.raises(NoContiguousSpace):
        slab.reserve("huge", 150)
    assert slab.report().external_fragmentation == 0  # an empty pool strands nothing


def test_external_fragmentation_follows_the_state_now() -> None:
    slab = SlabAllocator(100)
    for name in "abcd":
        slab.reserve(name, 25)
    with pytest.raises(NoContiguousSpace):
        slab.reserve("e", 40)
    assert slab.report().external_fragmentation == 0  # nothing free: a full pool
    slab.release("a")
    slab.release("c")
    assert slab.report().external_fragmentation == 50  # 50 free, no hole of 40
    slab.release("b")
    assert slab.report().external_fragmentation == 0  # a hole of 75 now fits e
    assert slab.reserve("e", 40) == 0
    slab.release("d")
    with pytest.raises(NoContiguousSpace):
        slab.reserve("too big", 61)
    assert slab.report().external_fragmentation == 0  # 60 free in total: not enough anyway
    assert slab.reserve("small", 10) == 40
    assert slab.report().external_fragmentation == 0  # a success: nothing waits any more
