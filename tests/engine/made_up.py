"""Playing the runner for the scheduler with no model: one made-up token per drawing sample."""

from __future__ import annotations

from collections.abc import Iterator

from pagedkv.engine.sched.output import ModelRunnerOutput, SampledToken
from pagedkv.engine.sched.scheduler import Scheduler
from pagedkv.worker.step import SchedulerOutput


def made_up_output(
    scheduler: Scheduler, output: SchedulerOutput, token_ids: Iterator[int]
) -> ModelRunnerOutput:
    """What a runner would hand back for `output`: a token from `token_ids` for every sample
    that draws one (all n of a prompt just computed). Samples stop at their max_tokens."""
    running = {request.request_id: request for request in scheduler.running}
    result = ModelRunnerOutput()
    for chunk in output.chunks:
        if chunk.sample:
            for seq in running[chunk.seq_id[0]].samples_drawing(chunk.seq_id[1]):
                result.sampled[seq.seq_id] = [SampledToken(next(token_ids))]
    return result
