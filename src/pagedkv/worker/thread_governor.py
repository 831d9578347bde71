"""ThreadGovernor: one CPU thread fewer while other work wants this machine's cores.

Why: the kernels' threads meet at the end of every parallel region, a few hundred times a
step. When another busy process shares a core with one of them, every region waits for that
thread's next turn on the core. On a 2-core VM beside one busy loop (`python -c "while True:
pass"`), the built-in model decoded 4.6-24 tok/s on 2 threads and 82-92 on 1 (alone: 134-187
and 82-95): the second thread cost 4-20x instead of gaining 1.7x.

The signal is the kernel's own: per thread, the time it was runnable but waiting for a core
(`/proc/self/task/*/schedstat`, its second field). Alone on its cores a thread waits almost
never (under 1% of a step); beside the busy loop the one sharing its core waited most of it.
A region waits for its slowest thread, so what counts is the thread that waited most: after
steps of `interval_s` seconds in all, the governor reads every thread's wait, and one that
waited more than `CONTENDED` of that time takes a thread away (never below 1). That thread
may be one of the process's own (a server's event loop): it competes for the same cores.
While below the most it may use, the governor tries one more thread again after `backoff`
seconds; a try that meets contention again doubles the backoff (up to `MAX_BACKOFF_S`), one
that does not resets it. A thread fewer waits no more while the other process keeps its core,
so only a try could tell when it stops; but the machine's idle time says so too
(`/proc/stat`): with a core idle since the last reading, one more is tried at once (at most
once every `MIN_BACKOFF_S`). Beside a process busy 1 s in 2, the backoff alone kept the
engine on one thread through the idle seconds (0.94x a fixed count).

Changing the count never changes an answer where the C kernels run the model on the CPU:
every per-row computation they and the sampler do gives the same bits on any number of
threads (tests/kernels/test_row_invariance.py). Elsewhere (a GPU, the PyTorch fallback) the
engine keeps its count fixed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from pagedkv.kernels import native
from pagedkv.worker.threads import physical_cores

INTERVAL_S = 0.2  # seconds of steps between readings
CONTENDED = 0.25  # a thread waiting for a core this share of the time: a thread too many
MIN_BACKOFF_S = 2.0  # after a thread is taken away, seconds before one more is tried
MAX_BACKOFF_S = 60.0
IDLE_CORE = 0.75  # cores idle on average since the last reading: room for one more thread

Delays = dict[int, int]  # nanoseconds each thread (by id) has waited for a core


def thread_run_delays() -> Delays | None:
    """Per thread of this process, the nanoseconds it has spent runnable but waiting for a
    core; None where the kernel does not keep them (not Linux, or built without schedstat)."""
    if not os.path.exists("/proc/self/schedstat"):
        return None
    delays = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/schedstat") as stats:
                delays[int(task)] = int(stats.read().split()[1])
        except OSError:  # a thread that ended as it was read (ENOENT, ESRCH)
            continue
        except (IndexError, ValueError):
            return None
    return delays


def idle_core_seconds() -> float | None:
    """Seconds the machine's cores have been idle, all of them summed (`/proc/stat`); None
    where it does not say."""
    try:
        with open("/proc/stat") as stats:
            fields = stats.readline().split()
        return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")  # idle, iowait
    except (OSError, IndexError, ValueError):
        return None


class ThreadGovernor:
    """The CPU threads the model runs on (`torch.set_num_threads`, which the C kernels share),
    between 1 and `most`; fixed at `most` when `read_delays` is None."""

    def __init__(
        self,
        most: int,
        read_delays: Callable[[], Delays | None] | None = thread_run_delays,
        read_idle: Callable[[], float | None] = idle_core_seconds,
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        get_threads: Callable[[], int] = torch.get_num_threads,
        interval_s: float = INTERVAL_S,
    ) -> None:
        self.most = most
        self.threads = most
        self._read_delays = read_delays
        self._read_idle = read_idle
        self._clock = clock
        self._set_threads = set_threads
        self._get_threads = get_threads
        self._interval_s = interval_s
        self._set_threads(most)
        self._delays = None if read_delays is None else read_delays()
        self._busy = 0.0  # seconds of steps since the last reading
        self._backoff = MIN_BACKOFF_S
        self._read_at = self._next_try = self._idle_try = clock()
        self._idle = read_idle()
        self._trying = False  # the last reading's steps ran with a thread added on trial

    def apply(self) -> None:
        """Give the calling thread the count (OpenMP keeps one per thread): a step may run on
        another thread than the last, or after another engine's in the same thread."""
        if self._get_threads() != self.threads:
            self._set_threads(self.threads)

    def observe(self, step_seconds: float) -> None:
        """After a step of `step_seconds`: take a thread away if one waited for a core over
        the steps since the last reading, or add one back on trial once the backoff passed."""
        if self._delays is None:  # no figures: the count stays
            return
        self._busy += step_seconds
        if self._busy < self._interval_s:
            return
        delays, idle, now = self._read_delays(), self._read_idle(), self._clock()
        if delays is None:  # unreadable this once: the next reading takes its place
            return
        before = self._delays
        longest = max((d - before[t] for t, d in delays.items() if t in before), default=0)
        waited = longest / 1e9 / self._busy
        idle_cores = (
            0.0
            if idle is None or self._idle is None or now <= self._read_at
            else (idle - self._idle) / (now - self._read_at)
        )
        self._delays, self._idle, self._read_at, self._busy = delays, idle, now, 0.0
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
        if self.threads >= self.most:
            return
        # A core sat idle (the other process paused): try one more at once, at most once a
        # MIN_BACKOFF_S; else after the backoff.
        if now >= self._next_try or (idle_cores >= IDLE_CORE and now >= self._idle_try):
            self._change(self.threads + 1)
            self._trying = True
            self._idle_try = now + MIN_BACKOFF_S

    def _change(self, threads: int) -> None:
        self.threads = threads
        self._set_threads(threads)


def thread_governor(device: torch.device | str, threads: int | None, ranks: int) -> ThreadGovernor:
    """The governor of one of `ranks` tensor-parallel ranks of a model on `device`: at most
    `threads` threads (by default its share of this machine's physical cores), adjusting on
    the CPU with the C kernels (whose answers do not depend on the count), fixed elsewhere."""
    most = threads or max(1, physical_cores() // ranks)
    adjusts = torch.device(device).type == "cpu" and native.kernels() is not None
    return ThreadGovernor(most, thread_run_delays if adjusts else None)
