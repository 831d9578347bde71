"""Utilisation against batch size: the tutorial's figures, from the real allocators."""

import pytest

from pagedkv.sim.sweep import fillable_batch_sizes, utilisation_by_batch_size
from pagedkv.sim.workloads import WORKLOADS, WorkloadError, generate_requests

BATCH_SIZES = [10, 25, 50, 100, 200]


@pytest.mark.parametrize("seed", [0, 1])
def test_tutorial_slab_is_21_to_28_percent_full_and_paged_at_least_98(seed):
    # A slab reserves 2,048 slots for ~508 tokens (a quarter); a paged request wastes only
    # the unfilled part of its last block, ~7.5 of ~508 tokens. Two seeds: not a lucky draw.
    requests = generate_requests(WORKLOADS["tutorial"], max(BATCH_SIZES), seed=seed)
    points = utilisation_by_batch_size(requests, BATCH_SIZES, block_size=16, max_model_len=2048)
    slab = {p.batch_size: p.utilisation_at_completion for p in points if p.scheme == "slab-max"}
    paged = {p.batch_size: p.utilisation_at_completion for p in points if p.scheme == "paged"}
    assert sorted(slab) == sorted(paged) == BATCH_SIZES
    for size in BATCH_SIZES:
        assert 0.21 <= slab[size] <= 0.28, (size, slab[size])
        assert paged[size] >= 0.98, (size, paged[size])


def test_utilisation_at_completion_is_the_batchs_tokens_over_what_it_holds():
    requests = generate_requests(WORKLOADS["tutorial"], 10, seed=3)
    points = utilisation_by_batch_size(requests, [10], block_size=16, max_model_len=2048)
    # A finished sample's KV holds its prompt and its output but the last token (never fed back).
    tokens = sum(request.total_len - 1 for request in requests)
    blocks = sum(-(-(request.total_len - 1) // 16) for request in requests)
    by_scheme = {point.scheme: point for point in points}
    slab, paged = by_scheme["slab-max"], by_scheme["paged"]
    assert slab.utilisation_at_completion == pytest.approx(tokens / (10 * 2048))
    assert paged.utilisation_at_completion == pytest.approx(tokens / (16 * blocks))
    # Averaged over every step the slab is emptier still: requests start small.
    assert slab.mean_utilisation < slab.utilisation_at_completion
    # At its fullest step the slab is fuller: the longest request, left alone, is nearly done.
    assert slab.peak_utilisation_over_time > slab.utilisation_at_completion


def test_sweep_needs_enough_requests():
    requests = generate_requests(WORKLOADS["tutorial"], 5)
    with pytest.raises(WorkloadError, match="batch size 10 needs that many requests"):
        utilisation_by_batch_size(requests, [10], block_size=16, max_model_len=2048)


def test_a_short_stream_fills_only_the_batch_sizes_it_can():
    assert fillable_batch_sizes([10, 25, 50, 100, 200], 30) == [10, 25]
    assert fillable_batch_sizes([10, 25], 25) == [10, 25]
    # Too short for any: the whole stream is the one batch it can fill.
    assert fillable_batch_sizes([10, 25], 3) == [3]
