"""StepExecutor: runs a scheduled step and says what it produced, as plain data.

The middle stage of the one-way step: `SchedulerOutput` in, `ModelRunnerOutput` out. The
runner (this process's, or rank 0's of a tensor-parallel group) runs the memory plan and the
forward pass; then prompt tokens are scored and every sampling chunk's samples draw their next
token from its row (all n samples from the prompt's row when it was just computed). Nothing
here changes a request: `Scheduler.update` records the output.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pagedkv.engine.logprobs import logprob_entry, score_prompts
from pagedkv.engine.request import Request, Sequence
from pagedkv.engine.sampler import Sampler, sampling_row
from pagedkv.engine.sched.output import ModelRunnerOutput, SampledToken
from pagedkv.tokenizer import Tokenizer
from pagedkv.worker.runner import ModelRunner
from pagedkv.worker.step import SchedulerOutput


class StepExecutor:
    """The runner, the sampler and the tokenizer that names logprob tokens."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, tokenizer: Tokenizer) -> None:
        self.runner = runner
        self.sampler = sampler
        self.tokenizer = tokenizer

    def execute(
        self, output: SchedulerOutput, requests: Mapping[str, Request]
    ) -> ModelRunnerOutput:
        """Run `output` over the requests it schedules (by id); the sampled tokens and scores."""
        if not output.chunks and not output.plan:
            return ModelRunnerOutput()  # nothing to run: e.g. a step that only reports aborts
        step = self.runner.execute(output)
        result = ModelRunnerOutput(logits_rows=list(step.rows))
        if step.logits is None:
            return result
        result.prompt_logprobs = score_prompts(output.chunks, step, requests, self.tokenizer)
        rows: list[int] = []
        drawing: list[tuple[Request, Sequence]] = []
        for chunk, chunk_rows in zip(output.chunks, step.rows, strict=True):
            if chunk.sample:
                request = requests[chunk.seq_id[0]]
                for seq in request.samples_drawing(chunk.seq_id[1]):
                    rows.append(chunk_rows[-1])
                    drawing.append((request, seq))
        if not drawing:
            return result
        logits = step.logits
        if rows != list(range(logits.shape[0])):
            logits = logits[torch.tensor(rows, device=logits.device)]
        sampled = self.sampler(logits, [sampling_row(request, seq) for request, seq in drawing])
        for (_, seq), token_id, logprobs in zip(
            drawing, sampled.token_ids, sampled.logprobs, strict=True
        ):
            entry = None if logprobs is None else logprob_entry(self.tokenizer, token_id, logprobs)
            result.sampled[seq.seq_id] = SampledToken(token_id, entry)
        return result
