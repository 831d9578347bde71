"""The discrete-step serving loop: arrivals, FCFS admission, decoding, preemption.

Each step, in the order of vLLM's scheduler: requests that have arrived join the waiting
queue; every sample of every running request gains one token; then waiting requests are
admitted in order until one does not fit (it waits, and so does everyone behind it) or
`max_running` are running, and their prompts are prefilled (they decode from the next step).
When a paged sample cannot get a block for its token, the most recently admitted request is
preempted (freed, to be recomputed from the front of the queue). A slab never preempts: its
reservation covers the request's whole life. Requests leave when every sample has all its
output tokens, after the step is measured.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedkv.sim.memory_map import MemoryMap
from pagedkv.sim.schemes import MemoryState, Scheme
from pagedkv.sim.workloads import Request


class SimulationError(ValueError):
    """A request stream the pool can never serve (one request alone does not fit)."""


@dataclass
class Timeline:
    """Per-step series: requests running, and the pool's token slots by use (`MemoryState`)."""

    running: list[int] = field(default_factory=list)
    state: list[int] = field(default_factory=list)
    reservation: list[int] = field(default_factory=list)
    internal: list[int] = field(default_factory=list)
    external: list[int] = field(default_factory=list)
    shared: list[int] = field(default_factory=list)

    def record(self, running: int, memory: MemoryState) -> None:
        """Append one step."""
        self.running.append(running)
        self.state.append(memory.state)
        self.reservation.append(memory.reservation)
        self.internal.append(memory.internal)
        self.external.append(memory.external)
        self.shared.append(memory.shared)

    def held(self, step: int) -> int:
        """Token slots held by requests at `step`."""
        return self.state[step] + self.reservation[step] + self.internal[step]


@dataclass(frozen=True)
class SimResult:
    """What one scheme did with one request stream.

    `final_tokens` / `final_held`: summed over finished requests, the token slots holding their
    KV and the slots of memory they held at their last step, when each was at its largest.
    """

    scheme: str
    pool_tokens: int
    timeline: Timeline
    finished: int
    queue_delays: list[int]
    preemptions: int
    final_tokens: int
    final_held: int
    peak_held_step: int
    stats: dict[str, object]
    memory_map: MemoryMap | None

    @property
    def steps(self) -> int:
        """Steps until the last request finished."""
        return len(self.timeline.running)


@dataclass
class _Live:
    """A request's progress, kept across preemptions."""

    request: Request
    generated: list[int]
    first_admitted_step: int | None = None

    def done(self) -> bool:
        return all(count == self.request.output_len for count in self.generated)


def simulate(
    requests: list[Request],
    scheme: Scheme,
    *,
    max_running: int = 256,
    snapshot_step: int | None = None,
    on_step: Callable[[int], None] | None = None,
) -> SimResult:
    """Serve `requests` with `scheme` until all finish.

    `snapshot_step` captures the memory map at that step; `on_step` is called after each
    step with the number of tokens generated in it (for progress bars).
    """
    for request in requests:
        if scheme.capacity_needed(request) > scheme.pool_tokens:
            raise SimulationError(
                f"{scheme.name}: request {request.req_id} needs "
                f"{scheme.capacity_needed(request):,} token slots alone, the pool has "
                f"{scheme.pool_tokens:,}"
            )
    pending = deque(sorted(requests, key=lambda request: request.arrival_step))
    waiting: deque[_Live] = deque()
    running: list[_Live] = []
    timeline = Timeline()
    queue_delays: list[int] = []
    preemptions = finished = final_tokens = final_held = peak_held_step = 0
    memory_map = None
    step = 0
    while pending or waiting or running:
        while pending and pending[0].arrival_step <= step:
            request = pending.popleft()
            waiting.append(_Live(request, [0] * request.n))
        generated = 0
        preempted: set[int] = set()
        for live in list(running):
            if live.request.req_id in preempted:
                continue
            for sample, count in enumerate(live.generated):
                if count == live.request.output_len:
                    continue
                while not scheme.grow(live.request, sample):
                    victim = running.pop()
                    scheme.release(victim.request, finished=False)
                    waiting.appendleft(victim)
                    preempted.add(victim.request.req_id)
                    preemptions += 1
                    if victim is live:
                        break
                if live.request.req_id in preempted:
                    break
                live.generated[sample] += 1
                generated += 1
        blocked = False
        # A step that had to preempt admits nobody: the memory it just freed is needed by
        # the requests already running (vLLM's scheduler does the same).
        while waiting and len(running) < max_running and not preempted:
            live = waiting[0]
            if not scheme.admit(live.request, live.generated):
                blocked = True
                break
            waiting.popleft()
            running.append(live)
            if live.first_admitted_step is None:
                live.first_admitted_step = step
                queue_delays.append(step - live.request.arrival_step)
        if blocked and not running:
            # An idle pool always fits one request (checked above), so this is an allocator
            # that lost memory; stop rather than wait forever.
            raise SimulationError(
                f"{scheme.name}: request {waiting[0].request.req_id} does not fit an idle pool "
                "(memory was leaked)"
            )
        timeline.record(len(running), scheme.measure())
        if timeline.held(step) > timeline.held(peak_held_step):
            peak_held_step = step
        if step == snapshot_step:
            memory_map = scheme.memory_map(step)
        for live in [live for live in running if live.done()]:
            tokens, held = scheme.footprint(live.request)
            final_tokens += tokens
            final_held += held
            scheme.release(live.request, finished=True)
            running.remove(live)
            finished += 1
        if on_step is not None:
            on_step(generated)
        step += 1
    return SimResult(
        scheme=scheme.name,
        pool_tokens=scheme.pool_tokens,
        timeline=timeline,
        finished=finished,
        queue_delays=queue_delays,
        preemptions=preemptions,
        final_tokens=final_tokens,
        final_held=final_held,
        peak_held_step=peak_held_step,
        stats=scheme.stats(),
        memory_map=memory_map,
    )
