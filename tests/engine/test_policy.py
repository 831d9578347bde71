"""Scheduling policy: who is admitted first and who gives way, under "fcfs" and "priority".

The scheduler runs first over a real `KVCacheManager` with no model: a test plays the runner,
giving every sample whose chunk ends its tokens one made-up token (pools of blocks of 4).
Then through the engine: `LLM.generate(priority=...)` against transformers, and the errors.
"""

from __future__ import annotations

import argparse
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine import EngineArgs
from pagedkv.engine.errors import InvalidPriority, PriorityNotSupported
from pagedkv.engine.outputs import RequestMetrics
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.request import Request, RequestStatus, Sequence
from pagedkv.engine.sched.config import SchedulerConfig
from pagedkv.engine.sched.policy import FCFSPolicy, PriorityPolicy, make_policy
from pagedkv.engine.sched.scheduler import Scheduler
from pagedkv.memory import KVCacheManager
from pagedkv.memory.tokens import SequenceTokens
from pagedkv.worker.step import SchedulerOutput
from tests.engine.conftest import make_engine, make_llm, run_to_completion
from tests.engine.made_up import made_up_output
from tests.model.tiny_models import random_prompt

_token_ids = itertools.count(1000)


def make_request(
    request_id: str, prompt_len: int, max_tokens: int, priority: int = 0, n: int = 1
) -> Request:
    prompt = [next(_token_ids) for _ in range(prompt_len)]
    samples = [
        Sequence(
            (request_id, index), index, SequenceTokens((request_id, index), prompt), prompt_len
        )
        for index in range(n)
    ]
    return Request(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=prompt,
        params=SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True),
        max_tokens=max_tokens,
        sequences=samples[:1],
        metrics=RequestMetrics(arrival_time=0.0),
        priority=priority,
        forks=samples[1:],
    )


def make_scheduler(num_blocks: int, policy: str, **overrides) -> Scheduler:
    settings_ = dict(max_num_seqs=16, max_num_batched_tokens=256, preemption_mode="recompute")
    settings_.update(overrides)
    manager = KVCacheManager(num_blocks, 4, num_cpu_blocks=num_blocks)
    return Scheduler(manager, SchedulerConfig(**settings_, policy=policy))


def step(scheduler: Scheduler) -> SchedulerOutput:
    output = scheduler.schedule()
    scheduler.update(output, made_up_output(scheduler, output, _token_ids))
    return output


def admission_order(scheduler: Scheduler, requests: list[Request]) -> list[str]:
    """Run to the end; the request ids in the order they were first scheduled."""
    order: list[str] = []
    for _ in range(1000):
        if not scheduler.has_unfinished():
            return order
        output = step(scheduler)
        for chunk in output.chunks:
            if chunk.seq_id[0] not in order:
                order.append(chunk.seq_id[0])
        scheduler.manager.check_invariants()
    raise AssertionError("the workload did not finish")


def test_priority_admits_the_lowest_value_first_and_equal_values_by_arrival():
    # One request at a time fits (3 blocks of 4: a 4+4 request needs 2, plus the watermark).
    scheduler = make_scheduler(3, "priority")
    requests = [
        make_request("a", 4, 4, priority=2),
        make_request("b", 4, 4, priority=0),
        make_request("c", 4, 4, priority=1),
        make_request("d", 4, 4, priority=0),
    ]
    for request in requests:
        scheduler.add(request)
    assert [request.request_id for request in scheduler.waiting] == ["b", "d", "c", "a"]
    assert admission_order(scheduler, requests) == ["b", "d", "c", "a"]


def test_fcfs_admits_in_arrival_order():
    scheduler = make_scheduler(3, "fcfs")
    requests = [make_request(name, 4, 4) for name in "abcd"]
    for request in requests:
        scheduler.add(request)
    assert admission_order(scheduler, requests) == ["a", "b", "c", "d"]


def test_priority_preempts_the_lowest_priority_even_when_it_ran_first_this_step():
    # a (priority 5) runs first in the step, then b (priority 0) needs a block that is not
    # there: a gives way, and its chunk of this step is taken back with its budget.
    scheduler = make_scheduler(4, "priority")
    low, high = make_request("a", 1, 8, priority=5), make_request("b", 4, 8, priority=0)
    scheduler.add(low)
    step(scheduler)  # a alone: 1 block
    scheduler.add(high)
    step(scheduler)  # b admitted beside it, the watermark kept
    assert [r.request_id for r in scheduler.running] == ["a", "b"]
    # Both grow a token a step until the pool is full and b, at a block boundary, needs one.
    output = step(scheduler)
    while not output.preempted:
        output = step(scheduler)
    assert output.preempted == [("a", "recompute")]
    assert {chunk.seq_id[0] for chunk in output.chunks} == {"b"}
    assert output.num_batched_tokens == 1
    assert low.status is RequestStatus.WAITING
    scheduler.manager.check_invariants()


def test_priority_victim_is_the_lowest_priority_then_the_newest():
    scheduler = make_scheduler(64, "priority", max_num_seqs=16)
    running = [
        make_request("old-low", 4, 4, priority=3),
        make_request("high", 4, 4, priority=0),
        make_request("new-low", 4, 4, priority=3),
        make_request("mid", 4, 4, priority=1),
    ]
    for request in running:
        scheduler.add(request)
    step(scheduler)
    assert scheduler.policy.victim(scheduler.running).request_id == "new-low"


def test_fcfs_victim_is_the_newest_running_request():
    scheduler = make_scheduler(64, "fcfs")
    for name in ("a", "b", "c"):
        scheduler.add(make_request(name, 4, 4))
    step(scheduler)
    assert scheduler.policy.victim(scheduler.running).request_id == "c"


@pytest.mark.parametrize(
    ("policy", "priorities", "victim", "survivor"),
    [("priority", (9, 0), "old", "new"), ("fcfs", (0, 0), "new", "old")],
)
def test_the_request_needing_a_block_may_be_the_victim_itself(policy, priorities, victim, survivor):
    # "old" runs first and is the one at a block boundary when the pool is full. Under
    # "priority" it has the lowest priority, so it gives way itself; under fcfs the newest
    # request does.
    scheduler = make_scheduler(4, policy)
    scheduler.add(make_request("old", 4, 8, priority=priorities[0]))
    step(scheduler)
    scheduler.add(make_request("new", 2, 8, priority=priorities[1]))
    output = step(scheduler)
    while not output.preempted:
        output = step(scheduler)
    assert output.preempted == [(victim, "recompute")]
    assert [chunk.seq_id[0] for chunk in output.chunks] == [survivor]


def test_priority_is_refused_under_fcfs_naming_the_value_and_the_policy():
    scheduler = make_scheduler(8, "fcfs")
    with pytest.raises(
        PriorityNotSupported, match="priority is 3, but scheduling_policy is 'fcfs'"
    ):
        scheduler.add(make_request("a", 4, 4, priority=3))
    assert not scheduler.has_unfinished()


def test_an_unknown_policy_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"one of \('fcfs', 'priority'\), got 'lifo'"):
        make_policy("lifo")
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        EngineArgs(scheduling_policy="lifo")


def test_the_default_policy_is_fcfs():
    assert EngineArgs().scheduling_policy == "fcfs"
    manager = KVCacheManager(8, 4)
    scheduler = Scheduler(manager, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    assert isinstance(scheduler.policy, FCFSPolicy)
    assert isinstance(make_policy("priority"), PriorityPolicy)


_workloads = st.lists(
    st.tuples(
        st.integers(0, 3),  # arrival step
        st.integers(1, 12),  # prompt tokens
        st.integers(1, 10),  # max_tokens
        st.sampled_from([1, 1, 2]),  # n
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=60, deadline=None)
@given(workload=_workloads, num_blocks=st.integers(8, 24), budget=st.sampled_from([8, 64]))
def test_priority_with_every_priority_zero_schedules_exactly_as_fcfs(workload, num_blocks, budget):
    # Under fcfs the waiting queue stays in arrival order and the running list in admission
    # (so arrival) order; with equal priorities "priority" orders by arrival too, so the two
    # policies must make the same steps. (Not with swap: fcfs resumes swapped requests in the
    # order they were swapped out, newest first.)
    runs = []
    for policy in ("fcfs", "priority"):
        scheduler = make_scheduler(
            num_blocks, policy, max_num_seqs=4, max_num_batched_tokens=budget
        )
        runs.append(_run(scheduler, workload))
    assert runs[0] == runs[1]


@settings(max_examples=60, deadline=None)
@given(
    workload=_workloads,
    priorities=st.lists(st.integers(-2, 2), min_size=8, max_size=8),
    num_blocks=st.integers(8, 24),
    budget=st.sampled_from([8, 64]),
    mode=st.sampled_from(["swap", "recompute"]),
)
def test_priority_runs_every_workload_to_the_end_and_admits_in_order(
    workload, priorities, num_blocks, budget, mode
):
    scheduler = make_scheduler(
        num_blocks, "priority", max_num_seqs=4, max_num_batched_tokens=budget, preemption_mode=mode
    )
    _run(scheduler, workload, priorities)
    assert scheduler.manager.num_free_blocks == num_blocks
    assert scheduler.manager.num_free_cpu_blocks == num_blocks


def _run(scheduler: Scheduler, workload, priorities=None) -> list:
    """Steps of a workload (a list of what each step scheduled and preempted); checks that
    every request the engine would accept finishes, memory stays consistent, and nothing
    waiting is admitted ahead of a waiting request with a smaller (priority, arrival)."""
    pending = sorted(enumerate(workload), key=lambda item: item[1][0])
    requests = []
    steps = []
    for number in range(2000):
        while pending and pending[0][1][0] <= number:
            index, (_, prompt_len, max_tokens, n) = pending.pop(0)
            if n * -(-(prompt_len + max_tokens) // 4) > scheduler.manager.num_gpu_blocks:
                continue  # more than the whole pool: the engine refuses it at add_request
            priority = priorities[index] if priorities else 0
            request = make_request(f"r{index}", prompt_len, max_tokens, priority, n)
            requests.append(request)
            scheduler.add(request)
        if not pending and not scheduler.has_unfinished():
            break
        waiting = list(scheduler.waiting)
        output = step(scheduler)
        admitted = [r for r in waiting if r.status is not RequestStatus.WAITING]
        assert waiting[: len(admitted)] == admitted  # a prefix of the queue's order
        steps.append(
            (
                [(chunk.seq_id, len(chunk.token_ids)) for chunk in output.chunks],
                output.preempted,
            )
        )
        scheduler.manager.check_invariants()
    assert all(request.status is RequestStatus.FINISHED for request in requests)
    assert all(
        seq.num_output_tokens == request.max_tokens
        for request in requests
        for seq in request.sequences
    )
    return steps


# -- through the engine, with a model ----------------------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = [random_prompt(length, seed=length) for length in (9, 30, 17)]


def test_generate_with_priorities_runs_lowest_first_and_outputs_what_transformers_does(
    engine_zoo,
):
    # One sequence at a time, so the admission order is the priority order.
    llm = make_llm(engine_zoo, "llama", scheduling_policy="priority", max_num_seqs=1)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[2, 0, 1])
    started = [output.metrics.first_scheduled_time for output in outputs]
    assert started[1] < started[2] < started[0]
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.outputs[0].token_ids == engine_zoo.hf_greedy("llama", tuple(prompt), 12)
    assert not llm.engine.has_unfinished()


def test_generate_refuses_priorities_under_fcfs_and_leaves_nothing_queued(engine_zoo):
    llm = make_llm(engine_zoo, "llama")
    with pytest.raises(PriorityNotSupported, match="priority is 1, but scheduling_policy"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[0, 1, 0])
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="priority has 2 entries for 3 prompts"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[0, 0])
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[0, 0, 0])
    assert [len(output.outputs[0].token_ids) for output in outputs] == [12, 12, 12]
    for bad in ("high", 1.5, True):
        with pytest.raises(InvalidPriority, match="expected an int"):
            llm.engine.add_request("bad", PROMPTS[0], GREEDY, priority=bad)
    assert not llm.engine.has_unfinished()


def test_the_command_line_has_scheduling_policy_with_its_choices():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--scheduling-policy", "priority"]))
    assert args.scheduling_policy == "priority"
    assert EngineArgs.from_cli_args(parser.parse_args([])).scheduling_policy == "fcfs"
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduling-policy", "lifo"])


def test_a_refused_priority_leaves_the_next_requests_random_draws_as_they_were(engine_zoo):
    """Unseeded samples draw numbered streams of the engine's seed: a request refused for its
    priority must not use one up, or the requests after it would sample other tokens than on
    an engine that never saw it (the oracle)."""
    sampled = SamplingParams(n=2, temperature=1.0, max_tokens=12, ignore_eos=True)
    answers = []
    for refused_first in (True, False):
        engine = make_engine(engine_zoo, "llama")
        if refused_first:
            with pytest.raises(PriorityNotSupported):
                engine.add_request("refused", PROMPTS[0], sampled, priority=2)
        engine.add_request("r", PROMPTS[1], sampled)
        tokens = {}
        for deltas in run_to_completion(engine):
            for delta in deltas:
                for output in delta.outputs:
                    tokens.setdefault(output.index, []).extend(output.token_ids)
        answers.append(tokens)
    assert answers[0] == answers[1]
