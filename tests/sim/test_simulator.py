"""The simulator on streams small enough to follow by hand, then its invariants at scale.

The simulator runs the engine's own scheduler, so a step is an engine step: a request's
prompt is computed in the step it is admitted, which also samples its first token; each
later step computes the last sampled token and samples the next. The pool is measured while
the step runs, so a sample holds its prompt and every output token but the newest (the last
one's KV is never written). Admission keeps the scheduler's watermark of one free block
while others run.

Notation in the comments: block size 4; "r0 3+2" is a request with a 3-token prompt that
generates 2 tokens.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.outputs import RequestMetrics
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.request import Request, Sequence
from pagedkv.engine.sched.config import SchedulerConfig
from pagedkv.engine.sched.scheduler import Scheduler
from pagedkv.memory import KVCacheManager
from pagedkv.memory.tokens import SequenceTokens
from pagedkv.sim.report import summarize
from pagedkv.sim.schemes import SCHEME_LABELS, PagedScheme, SlabScheme, make_scheme
from pagedkv.sim.simulator import SimulationError, simulate
from pagedkv.sim.workloads import WORKLOADS, WorkloadRequest, generate_requests
from tests.engine.made_up import made_up_output

# r0 3+2 (max_tokens 3), r1 2+4 (max_tokens 4); a pool of 4 blocks = 16 slots.
TWO_REQUESTS = [WorkloadRequest(0, 0, 3, 2, 3), WorkloadRequest(1, 0, 2, 4, 4)]


def test_paged_holds_whole_blocks_of_each_requests_tokens():
    result = simulate(TWO_REQUESTS, make_scheme("paged", 4, 4, max_model_len=8))
    timeline = result.timeline
    # KV held per step: r0 3,4 (done: its 2nd token is sampled), r1 2,3,4,5 (done).
    assert timeline.state == [5, 7, 4, 5]
    # Blocks: r0 1,1 and r1 1,1,1,2 -> empty slots in last blocks 1+2, 0+1, 0, 3. Up to its
    # final 4 (r0) and 5 (r1) KV tokens a request still writes them; past that, never.
    assert timeline.reservation == [3, 1, 0, 0]
    assert timeline.internal == [0, 0, 0, 3]
    assert timeline.running == [2, 2, 1, 1]
    # At their last steps r0 holds 4 tokens in 4 slots, r1 5 in 8.
    assert (result.final_tokens, result.final_held) == (9, 12)
    summary = summarize(result)
    assert summary.mean_utilisation == pytest.approx(21 / 28)
    assert summary.utilisation_at_completion == pytest.approx(9 / 12)
    # Step by step: 5/8, 7/8, 4/4, 5/8; the fullest is step 2, not any request's end.
    assert summary.peak_utilisation_over_time == pytest.approx(1.0)
    assert summary.finished_per_1000_steps == pytest.approx(1000 * 2 / 4)
    assert summary.internal_fragmentation == pytest.approx(3 / (16 * 4))
    assert summary.reservation_waste == pytest.approx(4 / (16 * 4))


def test_slab_at_max_model_len_reserves_the_whole_context():
    result = simulate(TWO_REQUESTS, make_scheme("slab-max", 4, 4, max_model_len=8))
    timeline = result.timeline
    assert timeline.state == [5, 7, 4, 5]
    # Slots still to be written: (4-3)+(5-2), then one fewer per request per step.
    assert timeline.reservation == [4, 2, 1, 0]
    # Never to be written: (8-4)+(8-5) while both run, then (8-5).
    assert timeline.internal == [7, 7, 3, 3]
    assert (result.final_tokens, result.final_held) == (9, 16)
    summary = summarize(result)
    assert summary.mean_utilisation == pytest.approx(21 / 48)
    assert summary.utilisation_at_completion == pytest.approx(9 / 16)
    # Held 16, 16, 8, 8: the fullest step is the last, r1 alone with 5 of its 8 slots.
    assert summary.peak_utilisation_over_time == pytest.approx(5 / 8)


def test_slab_at_prompt_plus_max_tokens_wastes_only_the_unused_max_tokens():
    result = simulate(TWO_REQUESTS, make_scheme("slab-exact", 4, 4, max_model_len=8))
    # r0 reserves 3+3 and writes 4; r1 reserves 2+4 and writes 5.
    assert result.timeline.internal == [3, 3, 1, 1]
    assert (result.final_tokens, result.final_held) == (9, 12)


def test_first_fit_slab_shows_external_fragmentation():
    # Blocks of one slot, so the watermark is one slot. Reservations of 6, 6 and 4 slots fill
    # a 16-slot pool; r3 (8 slots) waits. When r0 and r2 finish (step 1) the holes are 6 and
    # 4: 10 free, none of 8. r3 gets in once r1 ends (step 4).
    requests = [
        WorkloadRequest(0, 0, 1, 2, 5),
        WorkloadRequest(1, 0, 1, 5, 5),
        WorkloadRequest(2, 0, 1, 2, 3),
        WorkloadRequest(3, 0, 1, 1, 7),
    ]
    result = simulate(requests, make_scheme("slab-exact", 16, 1, max_model_len=16))
    assert result.timeline.running == [3, 3, 1, 1, 1, 1]
    # Steps 0-1: nothing free at all, which is no fragmentation; steps 2-4: 10 stranded.
    assert result.timeline.external == [0, 0, 10, 10, 10, 0]
    assert result.queue_delays == [0, 0, 0, 5]


def test_the_watermark_keeps_a_block_free_while_others_run():
    # The same stream with blocks of 4: after r0 and r1 the pool has one block free, which
    # the watermark keeps, so r2 waits although its slab would fit.
    requests = [
        WorkloadRequest(0, 0, 1, 2, 5),
        WorkloadRequest(1, 0, 1, 5, 5),
        WorkloadRequest(2, 0, 1, 2, 3),
    ]
    result = simulate(requests, make_scheme("slab-exact", 4, 4, max_model_len=16))
    assert result.timeline.running[0] == 2
    assert result.queue_delays == [0, 0, 2]


def test_paged_preempts_the_latest_request_and_recomputes_it():
    # Two 4+4 requests in 3 blocks: both prompts fit, but at 5 tokens each needs a second
    # block. r1, the latest, is preempted at step 1; with 5 tokens to recompute (2 blocks
    # plus the watermark) it waits until r0 leaves, then finishes alone.
    requests = [WorkloadRequest(0, 0, 4, 4, 4), WorkloadRequest(1, 0, 4, 4, 4)]
    scheme = make_scheme("paged", 3, 4, max_model_len=8)
    result = simulate(requests, scheme)
    assert result.preemptions == 1
    assert result.finished == 2
    assert result.timeline.running == [2, 1, 1, 1, 1, 1, 1]
    assert result.timeline.state == [8, 5, 6, 7, 5, 6, 7]
    assert scheme.manager.num_free_blocks == 3


def test_forked_samples_share_the_prompt_until_copy_on_write():
    # n=3 samples of a 6-token prompt: 2 blocks, the prompt computed once, then forked.
    scheme = make_scheme("paged-shared", 8, 4, max_model_len=8)
    result = simulate([WorkloadRequest(0, 0, 6, 2, 2, n=3)], scheme)
    timeline = result.timeline
    # Step 0: the prompt, one sequence. Step 1: each sample writes its first token; two copy
    # the shared last block on write (the third now owns it): 4 + 3x3 stored, 21 held.
    assert timeline.state == [6, 13]
    # Final length 7 KV tokens: at step 0 one of the prompt's 2 empty slots is still to be
    # written; at step 1 the three samples' empty slots never will be.
    assert timeline.reservation == [1, 0]
    assert timeline.internal == [1, 3]
    assert timeline.shared == [0, 8]
    assert result.stats["cow_copies"] == 2
    assert (result.final_tokens, result.final_held) == (13, 16)


def test_prefix_caching_shares_the_system_prompts_full_blocks():
    # Two requests with a common 9-token prefix: blocks of 4 share 2 full blocks. r1 arrives
    # a step after r0, once r0's prompt blocks are computed.
    requests = [
        WorkloadRequest(0, 0, 10, 4, 4, prefix_id="sys", prefix_len=9),
        WorkloadRequest(1, 1, 11, 4, 4, prefix_id="sys", prefix_len=9),
    ]
    shared = simulate(requests, make_scheme("paged-shared", 16, 4, max_model_len=16))
    unshared = simulate(requests, make_scheme("paged", 16, 4, max_model_len=16))
    assert shared.stats["prefix_hit_tokens"] == 8
    assert shared.timeline.shared[1] == 8
    assert shared.timeline.held(1) == unshared.timeline.held(1) - 8


def test_requests_admitted_in_one_step_share_the_blocks_that_step_computes():
    # Both arrive at step 0 and are prefilled together: r1 hits r0's 2 full prefix blocks as
    # soon as r0's chunk is scheduled, so step 0 holds 3 + 1 blocks, not 3 + 3.
    requests = [
        WorkloadRequest(0, 0, 10, 1, 1, prefix_id="sys", prefix_len=9),
        WorkloadRequest(1, 0, 11, 1, 1, prefix_id="sys", prefix_len=9),
    ]
    shared = simulate(requests, make_scheme("paged-shared", 16, 4, max_model_len=16))
    unshared = simulate(requests, make_scheme("paged", 16, 4, max_model_len=16))
    assert shared.stats["prefix_hit_tokens"] == 8
    assert shared.timeline.shared[0] == 8
    assert shared.timeline.held(0) == unshared.timeline.held(0) - 8


def test_arrivals_wait_for_their_step_and_queueing_is_measured():
    requests = [WorkloadRequest(0, 0, 4, 4, 4), WorkloadRequest(1, 3, 4, 2, 2)]
    result = simulate(requests, make_scheme("slab-max", 2, 4, max_model_len=8))
    # One 8-slot reservation at a time: r1 arrives at step 3, r0 leaves after step 3.
    assert result.timeline.running == [1, 1, 1, 1, 1, 1]
    assert result.queue_delays == [0, 1]


def test_max_num_seqs_caps_concurrency():
    requests = [WorkloadRequest(req, 0, 2, 2, 2) for req in range(6)]
    result = simulate(requests, make_scheme("paged", 64, 4, max_model_len=8), max_num_seqs=2)
    assert max(result.timeline.running) == 2
    assert result.finished == 6


def test_a_request_larger_than_the_pool_is_refused_up_front():
    with pytest.raises(SimulationError, match="request 0 needs 2,048 token slots alone"):
        simulate([WorkloadRequest(0, 0, 1, 10, 2047)], make_scheme("slab-max", 4, 4, 2048))


def test_memory_maps_show_owners_states_and_sharing():
    scheme = make_scheme("paged-shared", 8, 4, max_model_len=8)
    result = simulate([WorkloadRequest(0, 0, 6, 2, 2, n=3)], scheme, snapshot_step=1)
    # The first prompt block shared by three samples; each owns its copied last block.
    cells = [cell.value for cell in result.memory_map.cells]
    assert cells[:4] == ["shared", "used", "used", "used"]
    assert cells[4:] == ["free"] * 4
    assert result.memory_map.owners[:4] == [0, 0, 0, 0]
    slab = simulate(TWO_REQUESTS, make_scheme("slab-max", 4, 4, 8), snapshot_step=1)
    # r0 at slots 0-7 with 4 written; r1 at 8-15 with 3 written: cells of 4 slots.
    assert [cell.value for cell in slab.memory_map.cells] == ["used", "reserved"] * 2
    assert slab.memory_map.owners == [0, 0, 1, 1]


@pytest.mark.parametrize("name", list(SCHEME_LABELS))
def test_every_scheme_serves_a_busy_stream_and_leaks_nothing(name):
    requests = generate_requests(
        WORKLOADS["sharegpt"], 60, seed=5, rate=0.5, system_prompt=40, shared_fraction=0.5, n=2
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
        simulate([WorkloadRequest(0, 0, 4, 4, 4)], scheme)


def test_a_request_with_more_samples_than_a_step_runs_is_refused_up_front():
    with pytest.raises(SimulationError, match="n=3 samples, but one step runs at most 2"):
        simulate(
            [WorkloadRequest(0, 0, 4, 4, 4, n=3)], make_scheme("paged", 64, 4, 8), max_num_seqs=2
        )


def test_the_simulator_runs_the_engines_scheduler_step_by_step():
    # The oracle drives a Scheduler over a KVCacheManager by hand, as the engine does with its
    # default settings: the simulator's paged run must see the same running requests and
    # held tokens every step.
    requests = generate_requests(WORKLOADS["sharegpt"], 30, seed=2, rate=2.0)
    result = simulate(requests, make_scheme("paged", 200, 16, max_model_len=2048))
    assert result.preemptions > 0  # tight enough that preemption is part of the comparison

    manager = KVCacheManager(200, 16, enable_prefix_caching=False)
    scheduler = Scheduler(
        manager,
        SchedulerConfig(
            max_num_seqs=256,
            max_num_batched_tokens=EngineArgs().max_num_batched_tokens,  # the engine's default
            preemption_mode="recompute",
        ),
    )
    next_token = iter(range(10**9, 2 * 10**9))
    running, held, preemptions = [], [], 0
    step = 0
    pending = sorted(requests, key=lambda request: request.arrival_step)
    while pending or scheduler.has_unfinished():
        while pending and pending[0].arrival_step <= step:
            request = pending.pop(0)
            prompt = [next(next_token) for _ in range(request.prompt_len)]
            scheduler.add(_engine_request(str(request.req_id), prompt, request.output_len))
        output = scheduler.schedule()
        preemptions += len(output.preempted)
        running.append(len(scheduler.running))
        held.append(sum(manager.num_tokens(seq_id) for seq_id in manager.seq_ids))
        scheduler.update(output, made_up_output(scheduler, output, next_token))
        step += 1
    assert result.timeline.running == running
    assert result.timeline.state == held
    assert result.preemptions == preemptions


def _engine_request(request_id: str, prompt: list[int], output_len: int) -> Request:
    """A request whose sample stops after `output_len` tokens (its max_tokens)."""
    return Request(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=prompt,
        params=SamplingParams(max_tokens=2048, ignore_eos=True),
        max_tokens=output_len,
        sequences=[
            Sequence((request_id, 0), 0, SequenceTokens((request_id, 0), prompt), len(prompt))
        ],
        metrics=RequestMetrics(arrival_time=0.0),
    )


def test_a_stream_that_fits_finishes_when_its_longest_output_does():
    # Room for everyone and every prompt in one step's budget: request i finishes at step
    # output_len - 1 (its first token comes with its prompt), so the run takes max(output).
    requests = [WorkloadRequest(req, 0, 3 + req, 2 + 3 * req, 20) for req in range(5)]
    for name in SCHEME_LABELS:
        result = simulate(requests, make_scheme(name, 64, 4, max_model_len=32))
        assert result.steps == max(request.output_len for request in requests), name
        assert result.timeline.running[0] == 5, name


@st.composite
def _streams(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    requests = []
    for req_id in range(draw(st.integers(1, 8))):
        prompt_len = draw(st.integers(1, 20))
        output_len = draw(st.integers(1, 12))
        shared = draw(st.booleans())
        requests.append(
            WorkloadRequest(
                req_id,
                arrival_step=draw(st.integers(0, 5)),
                prompt_len=prompt_len,
                output_len=output_len,
                max_tokens=output_len + draw(st.integers(0, 5)),
                prefix_id="sys" if shared else None,
                prefix_len=min(prompt_len, 6) if shared else 0,
                n=draw(st.integers(1, 3)),
            )
        )
    # From the least that fits the largest slab (3 samples of 40 slots) to room to spare.
    num_blocks = draw(st.integers(120, 300)) // block_size
    return requests, block_size, num_blocks


@settings(max_examples=60, deadline=None)
@given(stream=_streams(), max_num_seqs=st.integers(3, 8))
def test_random_streams_finish_free_everything_and_hold_what_arithmetic_says(stream, max_num_seqs):
    requests, block_size, num_blocks = stream
    max_model_len = 40
    for name in SCHEME_LABELS:
        scheme = make_scheme(name, num_blocks, block_size, max_model_len)
        result = simulate(requests, scheme, max_num_seqs=max_num_seqs)
        assert result.finished == len(requests) == len(result.queue_delays)
        assert all(delay >= 0 for delay in result.queue_delays)
        assert all(
            held <= scheme.pool_tokens for held in map(result.timeline.held, range(result.steps))
        )
        # At completion each sample holds its prompt and all its output but the last token.
        kv_tokens = [request.n * (request.total_len - 1) for request in requests]
        if isinstance(scheme, SlabScheme):
            assert scheme.allocator.reservations() == []
            assert result.preemptions == 0
            assert result.final_tokens == sum(kv_tokens)
            slab = [scheme.reservation(request) for request in requests]
            assert result.final_held == sum(
                r.n * size for r, size in zip(requests, slab, strict=True)
            )
        else:
            assert isinstance(scheme, PagedScheme)
            scheme.manager.check_invariants()
            assert scheme.manager.num_free_blocks == num_blocks
            if not scheme.sharing:
                blocks = [-(-(r.total_len - 1) // block_size) for r in requests]
                assert result.final_tokens == sum(kv_tokens)
                assert result.final_held == block_size * sum(
                    r.n * count for r, count in zip(requests, blocks, strict=True)
                )
