"""ThreadGovernor: the rule stated in worker/thread_governor.py, on a clock and a run-delay
counter the test drives, and, on a real engine, answers unchanged while it moves the thread
count between steps (the kernels' thread invariance is what makes that safe)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from pagedkv.engine import LLM, SamplingParams
from pagedkv.worker.thread_governor import (
    CONTENDED,
    INTERVAL_S,
    MAX_BACKOFF_S,
    MIN_BACKOFF_S,
    ThreadGovernor,
    process_run_delay,
)
from tests.model.tiny_models import random_prompt

STEP = 0.25  # seconds between readings in these tests: past INTERVAL_S, and exact in binary
assert STEP > INTERVAL_S


class Machine:
    """A clock and the process's run-delay counter (ns), moved by the test; the thread counts
    the governor set, in order."""

    def __init__(self) -> None:
        self.now = 100.0
        self.delay = 0
        self.reads = 0
        self.set: list[int] = []

    def clock(self) -> float:
        return self.now

    def read_delay(self) -> int:
        self.reads += 1
        return self.delay

    def interval(self, seconds: float, waited_share: float) -> None:
        """`seconds` pass, the process waiting for cores `waited_share` of them."""
        self.now += seconds
        self.delay += int(seconds * waited_share * 1e9)

    def governor(self, most: int) -> ThreadGovernor:
        return ThreadGovernor(most, self.read_delay, self.clock, self.set.append)


def test_a_quiet_machine_keeps_every_thread() -> None:
    machine = Machine()
    governor = machine.governor(8)
    for _ in range(100):
        machine.interval(STEP, CONTENDED * 0.9)
        governor.observe()
    assert governor.threads == 8 and machine.set == [8] and governor.changes == 0


def test_contention_takes_threads_away_one_per_interval_down_to_one() -> None:
    machine = Machine()
    governor = machine.governor(3)
    seen = []
    for _ in range(5):  # every interval contended, never long enough for a trial
        machine.interval(STEP, 0.96)
        governor.observe()
        seen.append(governor.threads)
    assert seen == [2, 1, 1, 1, 1]
    assert machine.set == [3, 2, 1]


def test_readings_closer_than_the_interval_are_not_taken() -> None:
    machine = Machine()
    governor = machine.governor(2)
    machine.interval(STEP / 2, 1.0)  # under INTERVAL_S
    governor.observe()
    assert machine.reads == 1 and governor.threads == 2  # the reading at start only
    machine.interval(STEP / 2, 1.0)  # the whole time since the last reading counts
    governor.observe()
    assert machine.reads == 2 and governor.threads == 1


def test_trials_back_off_while_contention_lasts_and_reset_once_it_ends() -> None:
    machine = Machine()
    governor = machine.governor(2)
    machine.interval(STEP, 1.0)
    governor.observe()
    assert governor.threads == 1
    backoff, trials = MIN_BACKOFF_S, []
    for _ in range(8):  # still contended: each trial is taken back, the next one later
        waited = 0.0
        while governor.threads == 1:
            machine.interval(STEP, 0.0)  # one thread fits beside the other process
            waited += STEP
            governor.observe()
        trials.append(waited)
        machine.interval(STEP, 1.0)  # the trial meets the contention again
        governor.observe()
        assert governor.threads == 1
        backoff = min(2 * backoff, MAX_BACKOFF_S)
    # Each trial came after the backoff (to a reading), doubling.
    expected = [min(MIN_BACKOFF_S * 2**i, MAX_BACKOFF_S) for i in range(8)]
    assert all(want <= got <= want + STEP for got, want in zip(trials, expected, strict=True))
    assert trials[-1] == trials[-2]  # capped at MAX_BACKOFF_S
    # The contention ends: the next trial stays, and the backoff is back to its least.
    while governor.threads == 1:
        machine.interval(STEP, 0.0)
        governor.observe()
    machine.interval(STEP, 0.0)
    governor.observe()
    assert governor.threads == 2
    machine.interval(STEP, 1.0)  # contention again: the next trial after the least backoff
    governor.observe()
    waited = 0.0
    while governor.threads == 1:
        machine.interval(STEP, 0.0)
        waited += STEP
        governor.observe()
    assert MIN_BACKOFF_S <= waited <= MIN_BACKOFF_S + STEP


def test_threads_come_back_one_per_interval_never_past_the_most() -> None:
    machine = Machine()
    governor = machine.governor(4)
    for _ in range(3):
        machine.interval(STEP, 1.0)
        governor.observe()
    assert governor.threads == 1
    machine.interval(MIN_BACKOFF_S, 0.0)
    counts = []
    for _ in range(6):
        governor.observe()
        counts.append(governor.threads)
        machine.interval(STEP, 0.0)
    assert counts == [2, 3, 4, 4, 4, 4]


def test_without_the_kernels_figures_nothing_changes() -> None:
    machine = Machine()
    governor = ThreadGovernor(2, lambda: None, machine.clock, machine.set.append)
    for _ in range(10):
        machine.interval(STEP, 1.0)
        governor.observe()
    assert governor.threads == 2 and machine.set == [2]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_the_run_delay_is_every_threads_second_schedstat_field() -> None:
    if not os.path.exists("/proc/self/schedstat"):
        pytest.skip("this kernel keeps no schedstat")
    before = process_run_delay()
    assert isinstance(before, int) and before >= 0
    fields = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/schedstat") as stats:
            fields.append(int(stats.read().split()[1]))
    after = process_run_delay()
    assert before <= sum(fields) <= after


class Flapping(Machine):
    """Each reading of the clock a backoff's longest later, every other one of the run delay
    contended all that time: the governor takes a thread away and tries it again, by turns."""

    def clock(self) -> float:
        self.now += MAX_BACKOFF_S
        return self.now

    def read_delay(self) -> int:
        self.reads += 1
        self.delay += int(MAX_BACKOFF_S * 1e9) * (self.reads % 2)
        return self.delay


def test_answers_are_unchanged_while_the_thread_count_moves(zoo) -> None:
    """Tokens and logprobs with the thread count moving between 2 and 1 from step to step
    equal those of a fixed count, bit for bit."""
    prompts = [random_prompt(length, seed=length) for length in (7, 30, 18, 52)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    threads = torch.get_num_threads()
    results, machine = [], Flapping()
    try:
        for moving in (False, True):
            llm = LLM(str(zoo.folder("llama")), num_gpu_blocks=64, threads=2)
            if moving:
                llm.engine.threads = machine.governor(2)
            outputs = llm.generate(prompts, params, use_tqdm=False)
            results.append(
                [
                    (o.outputs[0].token_ids, [sorted(e.items()) for e in o.outputs[0].logprobs])
                    for o in outputs
                ]
            )
    finally:
        torch.set_num_threads(threads)
    assert machine.set.count(1) >= 4 and machine.set.count(2) >= 4
    assert results[1] == results[0]
