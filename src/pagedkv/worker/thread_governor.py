"""ThreadGovernor: one CPU thread fewer while other processes want this machine's cores.

Why: the kernels' threads meet at the end of every parallel region, a few hundred times a
step. When another busy process shares a core with one of them, every region waits for that
thread's next turn on the core. On a 2-core VM beside one busy loop (`python -c "while True:
pass"`), the built-in model decoded 4.6-7.7 tok/s on 2 threads and 82-92 on 1 (alone: 134-177
and 82-95): the second thread cost 12-20x instead of gaining 1.7x.

The signal is the kernel's own: per thread, the time it was runnable but waiting for a core
(`/proc/self/task/*/schedstat`, its second field). Alone on its cores the process waits
almost never (under 1% of the wall time in those runs); beside the busy loop it waited 96%.
So after a step, at most every `INTERVAL_S`, the governor reads that time: waiting more than
`CONTENDED` of the interval takes a thread away (never below 1). While below the most it may
use, it tries one more thread again after `backoff` seconds; a try that meets contention
again doubles the backoff (up to `MAX_BACKOFF_S`), one that does not resets it. A quiet
machine never loses a thread.

Changing the count never changes an answer: every per-row computation gives the same bits on
any number of threads (tests/kernels/test_row_invariance.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

INTERVAL_S = 0.2  # seconds between readings, at least
CONTENDED = 0.25  # waiting for a core this share of the time: a thread too many
MIN_BACKOFF_S = 2.0  # after a thread is taken away, seconds before one more is tried
MAX_BACKOFF_S = 60.0


def process_run_delay() -> int | None:
    """Nanoseconds this process's threads have spent runnable but waiting for a core, summed;
    None where the kernel does not say (no schedstat: not Linux, or built without it)."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/schedstat") as stats:
                total += int(stats.read().split()[1])
        except FileNotFoundError:  # a thread that has just ended
            continue
        except (OSError, IndexError, ValueError):
            return None
    return total


class ThreadGovernor:
    """The CPU threads the model runs on (`torch.set_num_threads`, which the C kernels share),
    between 1 and `most`, adjusted by `observe` after each step."""

    def __init__(
        self,
        most: int,
        read_delay: Callable[[], int | None] = process_run_delay,
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        self.most = most
        self.threads = most
        self._read_delay = read_delay
        self._clock = clock
        self._set_threads = set_threads
        self._set_threads(most)
        self._since = clock()
        self._delay = read_delay()
        self._backoff = MIN_BACKOFF_S
        self._next_try = self._since
        self._trying = False  # the last interval ran with a thread added on trial
        self.changes = 0  # how often the count changed (shown in the engine's stats)

    def observe(self) -> None:
        """Take a thread away if the process waited for cores over the last interval; add one
        back on trial once the backoff has passed."""
        if self._delay is None:
            return
        now = self._clock()
        if now - self._since < INTERVAL_S:
            return
        delay = self._read_delay()
        if delay is None:
            self._delay = None
            return
        waited = (delay - self._delay) / 1e9 / (now - self._since)
        self._since, self._delay = now, delay
        if waited > CONTENDED:
            if self._trying:
                self._backoff = min(2 * self._backoff, MAX_BACKOFF_S)
            if self.threads > 1:
                self._change(self.threads - 1)
            self._next_try = now + self._backoff
            self._trying = False
            return
        if self._trying:
            self._backoff = MIN_BACKOFF_S
        self._trying = False
        if self.threads < self.most and now >= self._next_try:
            self._change(self.threads + 1)
            self._trying = True

    def _change(self, threads: int) -> None:
        self.threads = threads
        self._set_threads(threads)
        self.changes += 1
