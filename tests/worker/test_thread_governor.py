"""ThreadGovernor: the rule stated in worker/thread_governor.py, on a clock and a run-delay
counter the test drives, and, on a real engine, answers unchanged while it moves the thread
count between steps (the kernels' thread invariance is what makes that safe)."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from pagedkv.engine import LLM, SamplingParams
from pagedkv.worker.thread_governor import (
    CONTENDED,
    INTERVAL_S,
    MAX_BACKOFF_S,
    MIN_BACKOFF_S,
    ThreadGovernor,
    thread_run_delays,
)
from tests.model.tiny_models import random_prompt

STEP = 0.25  # seconds between readings in these tests: past INTERVAL_S, and exact in binary
assert STEP > INTERVAL_S


class Machine:
    """A clock and two threads' run-delay counters (ns) the test moves; the thread counts the
    governor set, in order, which are also what the calling thread runs with."""

    def __init__(self) -> None:
        self.now = 100.0
        self.delays = {1: 0, 2: 0}
        self.reads = 0
        self.set: list[int] = []
        self.threads = 0
        self.idle: float | None = None  # the machine's idle core-seconds (None: unknown)
        self.unreadable = False  # the next readings fail (a thread ended as it was read)

    def clock(self) -> float:
        return self.now

    def read_delays(self) -> dict[int, int] | None:
        self.reads += 1
        return None if self.unreadable else dict(self.delays)

    def set_threads(self, count: int) -> None:
        self.set.append(count)
        self.threads = count

    def interval(self, seconds: float, waited_share: float) -> float:
        """`seconds` of steps pass, thread 2 waiting for a core `waited_share` of them; the
        seconds, for `observe`."""
        self.now += seconds
        self.delays[2] += int(seconds * waited_share * 1e9)
        return seconds

    def read_idle(self) -> float | None:
        return self.idle

    def governor(self, most: int) -> ThreadGovernor:
        return ThreadGovernor(
            most,
            self.read_delays,
            read_idle=self.read_idle,
            clock=self.clock,
            set_threads=self.set_threads,
            get_threads=lambda: self.threads,
        )


def test_a_quiet_machine_keeps_every_thread() -> None:
    machine = Machine()
    governor = machine.governor(8)
    for _ in range(100):
        governor.observe(machine.interval(STEP, CONTENDED * 0.9))
    assert governor.threads == 8 and machine.set == [8]


def test_contention_takes_threads_away_one_per_interval_down_to_one() -> None:
    machine = Machine()
    governor = machine.governor(3)
    seen = []
    for _ in range(5):  # every interval contended, never long enough for a trial
        governor.observe(machine.interval(STEP, 0.96))
        seen.append(governor.threads)
    assert seen == [2, 1, 1, 1, 1]
    assert machine.set == [3, 2, 1]


def test_readings_closer_than_the_interval_are_not_taken() -> None:
    machine = Machine()
    governor = machine.governor(2)
    governor.observe(machine.interval(STEP / 2, 1.0))  # under INTERVAL_S
    assert machine.reads == 1 and governor.threads == 2  # the reading at start only
    governor.observe(
        machine.interval(STEP / 2, 1.0)
    )  # the whole time since the last reading counts
    assert machine.reads == 2 and governor.threads == 1


def test_trials_back_off_while_contention_lasts_and_reset_once_it_ends() -> None:
    machine = Machine()
    governor = machine.governor(2)
    governor.observe(machine.interval(STEP, 1.0))
    assert governor.threads == 1

    def wait_for_trial() -> float:
        """Quiet steps (one thread fits beside the other process) until a thread is tried."""
        waited = 0.0
        while governor.threads == 1:
            waited += STEP
            governor.observe(machine.interval(STEP, 0.0))
        return waited

    trials = []
    for _ in range(8):  # still contended: each trial is taken back, the next one later
        trials.append(wait_for_trial())
        governor.observe(machine.interval(STEP, 1.0))  # the trial meets the contention again
        assert governor.threads == 1
    # Each trial came after the backoff (to a reading), doubling up to its most.
    expected = [min(MIN_BACKOFF_S * 2**i, MAX_BACKOFF_S) for i in range(8)]
    assert all(want <= got <= want + STEP for got, want in zip(trials, expected, strict=True))
    # The contention ends: the next trial stays, and the backoff is back to its least.
    wait_for_trial()
    governor.observe(machine.interval(STEP, 0.0))
    assert governor.threads == 2
    governor.observe(machine.interval(STEP, 1.0))
    assert MIN_BACKOFF_S <= wait_for_trial() <= MIN_BACKOFF_S + STEP


def test_threads_come_back_one_per_interval_never_past_the_most() -> None:
    machine = Machine()
    governor = machine.governor(4)
    for _ in range(3):
        governor.observe(machine.interval(STEP, 1.0))
    assert governor.threads == 1
    machine.now += MIN_BACKOFF_S  # idle: no steps, so no reading
    counts = []
    for _ in range(6):
        governor.observe(machine.interval(STEP, 0.0))
        counts.append(governor.threads)
    assert counts == [2, 3, 4, 4, 4, 4]


def test_the_thread_that_waited_most_decides_not_their_sum() -> None:
    """32 threads each waiting 1% of the time are no contention; one waiting 30% is."""
    machine = Machine()
    machine.delays = dict.fromkeys(range(32), 0)
    governor = machine.governor(32)
    for _ in range(10):
        machine.now += STEP
        machine.delays = {
            tid: delay + int(0.01 * STEP * 1e9) for tid, delay in machine.delays.items()
        }
        governor.observe(STEP)
    assert governor.threads == 32
    machine.delays[7] += int(0.3 * STEP * 1e9)
    machine.delays.pop(3)  # a thread that ended meanwhile counts for nothing
    governor.observe(machine.interval(STEP, 0.0))
    assert governor.threads == 31


def test_the_count_is_given_to_whichever_thread_steps() -> None:
    """OpenMP keeps a count per thread: `apply` sets it where it differs from the governor's
    (another thread's step, another engine's count), and nowhere else."""
    machine = Machine()
    governor = machine.governor(2)
    governor.apply()
    assert machine.set == [2]
    machine.threads = 4  # this thread ran with another engine's count
    governor.apply()
    assert machine.set == [2, 2] and machine.threads == 2


def test_without_the_kernels_figures_nothing_changes() -> None:
    machine = Machine()
    for read_delays in (None, lambda: None):
        governor = ThreadGovernor(
            2, read_delays, clock=machine.clock, set_threads=machine.set_threads
        )
        for _ in range(10):
            governor.observe(machine.interval(STEP, 1.0))
        assert governor.threads == 2
    assert machine.set == [2, 2]


def test_an_unreadable_reading_is_skipped_not_the_end() -> None:
    """A reading that fails once (a thread ending as it is read) changes nothing, and the
    next one is taken over all the steps since the last good one."""
    machine = Machine()
    governor = machine.governor(2)
    machine.unreadable = True
    governor.observe(machine.interval(STEP, 1.0))
    assert governor.threads == 2 and machine.reads == 2
    machine.unreadable = False
    governor.observe(machine.interval(STEP, 1.0))
    assert governor.threads == 1


def test_a_core_gone_idle_brings_a_thread_back_before_the_backoff() -> None:
    """Below the most, a thread fewer waits no more: the machine's idle time says when the other
    process paused. An idle core since the last reading tries one more thread at once, at most
    once every MIN_BACKOFF_S; busy cores leave it to the backoff."""
    machine = Machine()
    machine.idle = 0.0
    governor = machine.governor(2)
    governor.observe(machine.interval(STEP, 1.0))
    assert governor.threads == 1
    governor.observe(machine.interval(STEP, 0.0))  # no core idle: wait for the backoff
    assert governor.threads == 1
    machine.idle += 0.9 * STEP  # 0.9 of a core idle over the last reading
    governor.observe(machine.interval(STEP, 0.0))
    assert governor.threads == 2
    governor.observe(machine.interval(STEP, 1.0))  # the other process is back
    assert governor.threads == 1
    machine.idle += 0.9 * STEP  # idle again, but a try was made under MIN_BACKOFF_S ago
    governor.observe(machine.interval(STEP, 0.0))
    assert governor.threads == 1
    waited = 0.0
    while governor.threads == 1:
        machine.idle += 0.9 * STEP
        waited += STEP
        governor.observe(machine.interval(STEP, 0.0))
    assert waited <= MIN_BACKOFF_S


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_each_threads_run_delay_is_its_second_schedstat_field() -> None:
    if not os.path.exists("/proc/self/schedstat"):
        pytest.skip("this kernel keeps no schedstat")
    before = thread_run_delays()
    assert before is not None and threading.get_native_id() in before
    after = thread_run_delays()
    for tid, delay in before.items():
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as stats:
                now = int(stats.read().split()[1])
        except FileNotFoundError:  # ended meanwhile
            continue
        assert delay <= now <= after.get(tid, now)


class Flapping(Machine):
    """Every reading of the run delays comes a backoff's longest after the last, every other one
    with thread 2 waiting all that time: the governor takes a thread away and tries it again by
    turns, step after step (it reads after every step: its interval is 0)."""

    def read_delays(self) -> dict[int, int]:
        self.reads += 1
        self.now += MAX_BACKOFF_S
        self.delays[2] += int(MAX_BACKOFF_S * 1e9) * (self.reads % 2)
        return dict(self.delays)

    def set_threads(self, count: int) -> None:
        super().set_threads(count)
        torch.set_num_threads(count)


def test_answers_are_unchanged_while_the_thread_count_moves(zoo) -> None:
    """Tokens and logprobs with the model's thread count moving between 2 and 1 from step to
    step equal those of a fixed count, bit for bit."""
    prompts = [random_prompt(length, seed=length) for length in (7, 30, 18, 52)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    threads = torch.get_num_threads()
    results, machine = [], Flapping()
    try:
        for moving in (False, True):
            llm = LLM(str(zoo.folder("llama")), num_gpu_blocks=64, threads=2)
            if moving:
                llm.engine.thread_governor = ThreadGovernor(
                    2,
                    machine.read_delays,
                    read_idle=machine.read_idle,
                    clock=machine.clock,
                    set_threads=machine.set_threads,
                    interval_s=0.0,
                )
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
