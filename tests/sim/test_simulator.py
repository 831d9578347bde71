"""The simulator on streams small enough to follow by hand, then its invariants at scale.

Notation in the comments: block size 4; "r0 3+2" is a request with a 3-token prompt that
generates 2 tokens. A request is prefilled in the step it is admitted and gains one token
per sample in each later step.
"""

import pytest

from pagedkv.sim.report import summarize
from pagedkv.sim.schemes import SCHEME_LABELS, PagedScheme, SlabScheme, make_scheme
from pagedkv.sim.simulator import SimulationError, simulate
from pagedkv.sim.workloads import WORKLOADS, Request, generate_requests

# r0 3+2 (max_tokens 3), r1 2+4 (max_tokens 4); a pool of 4 blocks = 16 slots.
TWO_REQUESTS = [Request(0, 0, 3, 2, 3), Request(1, 0, 2, 4, 4)]


def test_paged_holds_whole_blocks_of_each_requests_tokens():
    result = simulate(TWO_REQUESTS, make_scheme("paged", 4, 4, max_model_len=8))
    timeline = result.timeline
    # Tokens per step: r0 3,4,5 (done), r1 2,3,4,5,6 (done).
    assert timeline.state == [5, 7, 9, 5, 6]
    # Blocks: r0 1,1,2 and r1 1,1,1,2,2 -> empty slots in last blocks 1+2, 0+1, 3+0, 3, 2.
    assert timeline.internal == [3, 1, 3, 3, 2]
    assert timeline.reservation == [0] * 5
    assert timeline.running == [2, 2, 2, 1, 1]
    # At their last steps r0 holds 5 tokens in 8 slots, r1 6 in 8.
    assert (result.final_tokens, result.final_held) == (11, 16)
    summary = summarize(result)
    assert summary.mean_utilisation == pytest.approx(32 / 44)
    assert summary.utilisation_at_completion == pytest.approx(11 / 16)
    # Step by step: 5/8, 7/8, 9/12, 5/8, 6/8; the fullest is step 1, not any request's end.
    assert summary.peak_utilisation_over_time == pytest.approx(7 / 8)
    assert summary.finished_per_1000_steps == pytest.approx(1000 * 2 / 5)
    assert summary.internal_fragmentation == pytest.approx(12 / (16 * 5))


def test_slab_at_max_model_len_reserves_the_whole_context():
    result = simulate(TWO_REQUESTS, make_scheme("slab-max", 4, 4, max_model_len=8))
    timeline = result.timeline
    assert timeline.state == [5, 7, 9, 5, 6]
    # Slots still to be written: (5-3)+(6-2), then one fewer per request per step.
    assert timeline.reservation == [6, 4, 2, 1, 0]
    # Never to be written: (8-5)+(8-6) while both run, then (8-6).
    assert timeline.internal == [5, 5, 5, 2, 2]
    assert (result.final_tokens, result.final_held) == (11, 16)
    summary = summarize(result)
    assert summary.mean_utilisation == pytest.approx(32 / 64)
    assert summary.utilisation_at_completion == pytest.approx(11 / 16)
    # Held 16, 16, 16, 8, 8: the fullest step is the last, r1 alone with 6 of its 8 slots.
    assert summary.peak_utilisation_over_time == pytest.approx(6 / 8)


def test_slab_at_prompt_plus_max_tokens_wastes_only_the_unused_max_tokens():
    result = simulate(TWO_REQUESTS, make_scheme("slab-exact", 4, 4, max_model_len=8))
    # r0 reserves 3+3 and writes 5; r1 reserves 2+4 and writes all 6.
    assert result.timeline.internal == [1, 1, 1, 0, 0]
    assert (result.final_tokens, result.final_held) == (11, 12)


def test_first_fit_slab_shows_external_fragmentation():
    # Reservations of 6, 6 and 4 slots fill a 16-slot pool; r3 (8 slots) waits. When r0 and
    # r2 finish (step 2) the holes are 6 and 4: 10 free, none of 8. r3 gets in once r1 ends.
    requests = [
        Request(0, 0, 1, 2, 5),
        Request(1, 0, 1, 5, 5),
        Request(2, 0, 1, 2, 3),
        Request(3, 0, 1, 1, 7),
    ]
    result = simulate(requests, make_scheme("slab-exact", 4, 4, max_model_len=16))
    assert result.timeline.running == [3, 3, 3, 1, 1, 1, 1, 1]
    # Steps 0-2: nothing free at all, which is no fragmentation; steps 3-5: 10 stranded.
    assert result.timeline.external == [0, 0, 0, 10, 10, 10, 0, 0]
    assert result.queue_delays == [0, 0, 0, 6]


def test_paged_preempts_the_latest_request_and_recomputes_it():
    # Two 4+4 requests in 3 blocks: both prompts fit, but at 5 tokens each needs a second
    # block. r1, the latest, is preempted at step 1 and again at step 3, then finishes alone.
    requests = [Request(0, 0, 4, 4, 4), Request(1, 0, 4, 4, 4)]
    scheme = make_scheme("paged", 3, 4, max_model_len=8)
    result = simulate(requests, scheme)
    assert result.preemptions == 2
    assert result.finished == 2
    assert result.timeline.running == [2, 1, 2, 1, 2, 1, 1, 1, 1]
    assert result.timeline.state == [8, 5, 10, 7, 12, 5, 6, 7, 8]
    assert scheme.manager.num_free_blocks == 3


def test_forked_samples_share_the_prompt_until_copy_on_write():
    # n=3 samples of a 6-token prompt: 2 blocks shared by all three (the second half full).
    scheme = make_scheme("paged-shared", 8, 4, max_model_len=8)
    result = simulate([Request(0, 0, 6, 2, 2, n=3)], scheme)
    timeline = result.timeline
    # Step 0: 6 tokens stored once, though 18 are held. Step 1: two samples copy the shared
    # last block on write (the third now owns it): 4 + 3x3 stored, 21 held. Step 2: full.
    assert timeline.state == [6, 13, 16]
    assert timeline.internal == [2, 3, 0]
    assert timeline.shared == [12, 8, 8]
    assert result.stats["cow_copies"] == 2
    assert (result.final_tokens, result.final_held) == (16, 16)


def test_prefix_caching_shares_the_system_prompts_full_blocks():
    # Two requests with a common 9-token prefix: blocks of 4 share 2 full blocks.
    requests = [
        Request(0, 0, 10, 1, 1, prefix_id="sys", prefix_len=9),
        Request(1, 0, 11, 1, 1, prefix_id="sys", prefix_len=9),
    ]
    shared = simulate(requests, make_scheme("paged-shared", 16, 4, max_model_len=16))
    unshared = simulate(requests, make_scheme("paged", 16, 4, max_model_len=16))
    assert shared.stats["prefix_hit_tokens"] == 8
    assert shared.timeline.shared[0] == 8
    assert shared.timeline.held(0) == unshared.timeline.held(0) - 8


def test_arrivals_wait_for_their_step_and_queueing_is_measured():
    requests = [Request(0, 0, 4, 4, 4), Request(1, 3, 4, 2, 2)]
    result = simulate(requests, make_scheme("slab-max", 2, 4, max_model_len=8))
    # One 8-slot reservation at a time: r1 arrives at step 3, r0 leaves after step 4.
    assert result.timeline.running == [1, 1, 1, 1, 1, 1, 1, 1]
    assert result.queue_delays == [0, 2]


def test_max_running_caps_concurrency():
    requests = [Request(req, 0, 2, 2, 2) for req in range(6)]
    result = simulate(requests, make_scheme("paged", 64, 4, max_model_len=8), max_running=2)
    assert max(result.timeline.running) == 2
    assert result.finished == 6


def test_a_request_larger_than_the_pool_is_refused_up_front():
    with pytest.raises(SimulationError, match="request 0 needs 2,048 token slots alone"):
        simulate([Request(0, 0, 1, 10, 2047)], make_scheme("slab-max", 4, 4, 2048))


def test_memory_maps_show_owners_states_and_sharing():
    scheme = make_scheme("paged-shared", 8, 4, max_model_len=8)
    result = simulate([Request(0, 0, 6, 2, 2, n=3)], scheme, snapshot_step=0)
    cells = [cell.value for cell in result.memory_map.cells]
    assert cells[:2] == ["shared", "shared"]
    assert cells[2:] == ["free"] * 6
    assert result.memory_map.owners[:2] == [0, 0]
    slab = simulate(TWO_REQUESTS, make_scheme("slab-max", 4, 4, 8), snapshot_step=1)
    # r0 at slots 0-7 with 4 written; r1 at 8-15 with 3 written: cells of 4 slots.
    assert [cell.value for cell in slab.memory_map.cells] == ["used", "reserved"] * 2
    assert slab.memory_map.owners == [0, 0, 1, 1]


@pytest.mark.parametrize("name", list(SCHEME_LABELS))
def test_every_scheme_serves_a_busy_stream_and_leaks_nothing(name):
    requests = generate_requests(
        WORKLOADS["sharegpt"], 120, seed=5, rate=0.5, system_prompt=40, shared_fraction=0.5, n=2
    )
    scheme = make_scheme(name, 700, 16, max_model_len=2048)
    result = simulate(requests, scheme)
    assert result.finished == len(requests)
    assert len(result.queue_delays) == len(requests)
    timeline = result.timeline
    for step in range(result.steps):
        assert 0 <= timeline.held(step) <= scheme.pool_tokens
        assert timeline.held(step) + timeline.external[step] <= scheme.pool_tokens
        assert min(timeline.state[step], timeline.reservation[step], timeline.internal[step]) >= 0
    if isinstance(scheme, PagedScheme):
        scheme.manager.check_invariants()
        assert scheme.manager.num_free_blocks == 700
        assert result.preemptions > 0  # the pool is tight enough to force some
    else:
        assert isinstance(scheme, SlabScheme)
        assert scheme.allocator.reservations() == []
        assert result.preemptions == 0


def test_paging_runs_more_requests_at_once_than_slabs_on_the_same_pool():
    requests = generate_requests(WORKLOADS["tutorial"], 100, seed=0)
    slab = summarize(simulate(requests, make_scheme("slab-max", 1024, 16, 2048)))
    paged = summarize(simulate(requests, make_scheme("paged", 1024, 16, 2048)))
    assert slab.peak_running == 1024 * 16 // 2048 == 8
    assert paged.peak_running > 3 * slab.peak_running
    assert paged.finished_per_1000_steps > 2 * slab.finished_per_1000_steps


def test_an_allocator_that_leaks_is_reported_not_waited_on_forever():
    scheme = make_scheme("paged", 4, 4, max_model_len=8)
    scheme.manager.allocate("leaked", [0] * 16)  # holds every block, owned by no request
    with pytest.raises(SimulationError, match="does not fit an idle pool"):
        simulate([Request(0, 0, 4, 4, 4)], scheme)
