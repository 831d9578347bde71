"""The discrete-step serving loop: arrivals, then the engine's own scheduler over each scheme.

Each step, requests that have arrived join the scheduler's waiting queue; then
`Scheduler.schedule()` picks the step's work exactly as the engine's does (one token budget,
chunked prefill, preemption of the newest request by recompute when a block cannot be had,
admission in order while the watermark allows); the simulator plays the model, giving every
sample whose chunk ends its tokens one made-up token (a `ModelRunnerOutput`, as the engine's
executor makes); and `Scheduler.update()` records the step as the engine's does (tokens
computed, forks, finished samples freed). A request's first token comes from the step that
computes its prompt's last token. A slab never preempts: its
reservation covers the request's whole life. The pool is measured while the step runs, before
finished requests free their memory.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.outputs import RequestMetrics
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.request import Request, Sequence
from pagedkv.engine.sched.config import SchedulerConfig
from pagedkv.engine.sched.output import ModelRunnerOutput, SampledToken
from pagedkv.engine.sched.scheduler import Scheduler
from pagedkv.memory.tokens import SequenceTokens
from pagedkv.sim.memory_map import MemoryMap
from pagedkv.sim.schemes import MemoryState, Scheme
from pagedkv.sim.workloads import WorkloadRequest
from pagedkv.worker.step import SchedulerOutput

# The engine's default token budget of one step.
MAX_NUM_BATCHED_TOKENS = EngineArgs.max_num_batched_tokens


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


def simulate(
    requests: list[WorkloadRequest],
    scheme: Scheme,
    *,
    max_num_seqs: int = 256,
    snapshot_step: int | None = None,
    on_step: Callable[[int], None] | None = None,
) -> SimResult:
    """Serve `requests` with `scheme` until all finish.

    `max_num_seqs` caps the sequences of a step, as the engine's does (a request of n samples
    counts n). `snapshot_step` captures the memory map at that step; `on_step` is
    called after each step with the number of tokens generated in it (for progress bars).
    """
    for request in requests:
        _check_servable(request, scheme, max_num_seqs)
    scheduler = Scheduler(
        scheme.memory,
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS),
    )
    model = _MadeUpModel(scheme)
    pending = deque(sorted(requests, key=lambda request: request.arrival_step))
    timeline = Timeline()
    queue_delays: list[int] = []
    admitted: set[str] = set()
    preemptions = peak_held_step = 0
    memory_map = None
    step = 0
    while pending or scheduler.has_unfinished():
        while pending and pending[0].arrival_step <= step:
            scheme.add(pending[0])
            scheduler.add(model.engine_request(pending.popleft()))
        output = scheduler.schedule()
        preemptions += len(output.preempted)
        if scheduler.waiting and not scheduler.running and not output.preempted:
            # An idle pool always fits one request (checked above), so this is an allocator
            # that lost memory; stop rather than wait forever.
            raise SimulationError(
                f"{scheme.name}: request {scheduler.waiting.peek().request_id} does not fit "
                "an idle pool (memory was leaked)"
            )
        for running in scheduler.running:
            if running.request_id not in admitted:
                admitted.add(running.request_id)
                arrival = scheme.requests[running.request_id].arrival_step
                queue_delays.append(step - arrival)
        timeline.record(len(scheduler.running), scheme.measure())
        if timeline.held(step) > timeline.held(peak_held_step):
            peak_held_step = step
        if step == snapshot_step:
            memory_map = scheme.memory_map(step)
        result = model.sample(output, scheduler.running)
        scheduler.update(output, result)
        if on_step is not None:
            on_step(len(result.sampled))
        step += 1
    return SimResult(
        scheme=scheme.name,
        pool_tokens=scheme.pool_tokens,
        timeline=timeline,
        finished=model.finished,
        queue_delays=queue_delays,
        preemptions=preemptions,
        final_tokens=model.final_tokens,
        final_held=model.final_held,
        peak_held_step=peak_held_step,
        stats=scheme.stats(),
        memory_map=memory_map,
    )


class _MadeUpModel:
    """Plays the model: requests as the engine holds them, made-up token ids, lengths known.

    Token ids only have to compare equal where the workload shares tokens: a shared prefix
    gets the same ids in every request that carries it, everything else fresh ids. A sample
    stops after the request's `output_len` tokens; when the last sample of a request stops,
    its footprint is taken while it still holds its memory.
    """

    def __init__(self, scheme: Scheme) -> None:
        self.scheme = scheme
        self.finished = 0
        self.final_tokens = 0
        self.final_held = 0
        self._fresh_ids = itertools.count()
        self._prefixes: dict[Hashable, list[int]] = {}

    def engine_request(self, request: WorkloadRequest) -> Request:
        """The request as the engine's scheduler holds it: n samples from the start, unless
        the scheme forks them once the prompt is computed."""
        request_id = str(request.req_id)
        prompt = self._prompt_ids(request)
        samples = [_sequence(request_id, index, prompt) for index in range(request.n)]
        num_forks = request.n - 1 if self.scheme.forks else 0
        return Request(
            request_id=request_id,
            prompt=None,
            prompt_token_ids=prompt,
            params=SamplingParams(n=request.n, max_tokens=request.max_tokens, ignore_eos=True),
            # The engine's stop: a sample ends after the workload's output length.
            max_tokens=request.output_len,
            sequences=samples[: request.n - num_forks],
            forks=samples[request.n - num_forks :],
            metrics=RequestMetrics(arrival_time=request.arrival_step),
        )

    def sample(self, output: SchedulerOutput, running: list[Request]) -> ModelRunnerOutput:
        """One made-up token per sample that draws one. A request whose every sample ends
        with it has its footprint taken first, while it still holds its memory."""
        by_id = {request.request_id: request for request in running}
        result = ModelRunnerOutput()
        drawing: dict[str, list[Sequence]] = {}
        for chunk in output.chunks:
            if chunk.sample:
                request = by_id[chunk.seq_id[0]]
                drawing.setdefault(request.request_id, []).extend(
                    request.samples_drawing(chunk.seq_id[1])
                )
        for request_id, seqs in drawing.items():
            for seq in seqs:
                result.sampled[seq.seq_id] = [SampledToken(next(self._fresh_ids))]
            request = by_id[request_id]
            if all(
                seq in seqs and seq.num_output_tokens + 1 >= request.max_tokens
                for seq in [*request.live_sequences, *request.forks]
            ):
                tokens, held = self.scheme.footprint(self.scheme.requests[request_id])
                self.final_tokens += tokens
                self.final_held += held
                self.finished += 1
        return result

    def _prompt_ids(self, request: WorkloadRequest) -> list[int]:
        prefix: list[int] = []
        if request.prefix_id is not None:
            prefix = self._prefixes.setdefault(request.prefix_id, [])
            missing = max(0, request.prefix_len - len(prefix))
            prefix.extend(itertools.islice(self._fresh_ids, missing))
            prefix = prefix[: request.prefix_len]
        unique = request.prompt_len - len(prefix)
        return prefix + list(itertools.islice(self._fresh_ids, unique))


def _sequence(request_id: str, index: int, prompt: list[int]) -> Sequence:
    return Sequence(
        seq_id=(request_id, index),
        index=index,
        tokens=SequenceTokens((request_id, index), prompt),
        num_prompt_tokens=len(prompt),
    )


def _check_servable(request: WorkloadRequest, scheme: Scheme, max_num_seqs: int) -> None:
    """Refuse up front what could never run, as the engine's `add_request` does."""
    if scheme.capacity_needed(request) > scheme.pool_tokens:
        raise SimulationError(
            f"{scheme.name}: request {request.req_id} needs "
            f"{scheme.capacity_needed(request):,} token slots alone, the pool has "
            f"{scheme.pool_tokens:,}"
        )
    max_samples = min(max_num_seqs, MAX_NUM_BATCHED_TOKENS)
    if request.n > max_samples:
        raise SimulationError(
            f"request {request.req_id} has n={request.n} samples, but one step runs at most "
            f"{max_samples} sequences (max_num_seqs / the step's token budget)"
        )
