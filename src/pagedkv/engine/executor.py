"""StepExecutor: runs a scheduled step and says what it produced, as plain data.

The middle stage of the one-way step: `SchedulerOutput` in, `ModelRunnerOutput` out. The
runner (this process's, or rank 0's of a tensor-parallel group) runs the memory plan and the
forward pass; then prompt tokens are scored and every sampling chunk's samples draw their next
token from its row (all n samples from the prompt's row when it was just computed). A chunk
with speculative drafts has a row per position: each verifies its draft as the sample's own
sampling would have drawn at that position (`sampler.py`), and the sample keeps the drafts up
to the first that fails, then the token drawn there (or after the last draft). Last, the
drafter proposes each sample's drafts for its next step. Nothing here changes a request:
`Scheduler.update` records the output.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Mapping

import torch

from pagedkv.engine.beam_search import Candidate
from pagedkv.engine.logprobs import logprob_entry, score_prompts
from pagedkv.engine.request import Request, Sequence
from pagedkv.engine.sampler import Sampler, SamplingRow, argmax, sampling_row, token_logprobs
from pagedkv.engine.sched.output import ModelRunnerOutput, SampledToken
from pagedkv.engine.spec.drafter import Drafter, DraftRequest, SeqId
from pagedkv.engine.structured.state import GrammarState
from pagedkv.tokenizer import Tokenizer
from pagedkv.worker.runner import ModelRunner
from pagedkv.worker.step import SchedulerOutput


class StepExecutor:
    """The runner, the sampler, the tokenizer that names logprob tokens, and the drafter of
    speculative decoding (None: off) with the most drafts a sample verifies per step."""

    def __init__(
        self,
        runner: ModelRunner,
        sampler: Sampler,
        tokenizer: Tokenizer,
        drafter: Drafter | None = None,
        num_speculative_tokens: int = 0,
    ) -> None:
        self.runner = runner
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.num_speculative_tokens = num_speculative_tokens

    def execute(
        self, output: SchedulerOutput, requests: Mapping[str, Request]
    ) -> ModelRunnerOutput:
        """Run `output` over the requests it schedules (by id); the sampled tokens and scores."""
        if not output.chunks and not output.plan and not output.adapters:
            return ModelRunnerOutput()  # nothing to run: e.g. a step that only reports aborts
        started = time.perf_counter()
        result = self._execute(output, requests)
        result.step_seconds = time.perf_counter() - started
        return result

    def _execute(
        self, output: SchedulerOutput, requests: Mapping[str, Request]
    ) -> ModelRunnerOutput:
        if self.drafter is not None:
            output = self.drafter.fill(output, _grammars(output, requests))
        step = self.runner.execute(output)
        result = ModelRunnerOutput(logits_rows=list(step.rows))
        if step.logits is None:
            return result
        result.prompt_logprobs = score_prompts(output.chunks, step, requests, self.tokenizer)
        rows: list[int] = []
        sampling_rows: list[SamplingRow] = []
        drawing: list[tuple[Request, Sequence, int]] = []  # (request, sample, its rows)
        beams: list[tuple[Request, tuple[str, int], int]] = []  # (request, beam, its row)
        for chunk, chunk_rows in zip(output.chunks, step.rows, strict=True):
            if not chunk.sample:
                continue
            request = requests[chunk.seq_id[0]]
            if request.beam is not None:
                beams.append((request, chunk.seq_id, chunk_rows[-1]))
                continue
            if chunk.num_draft_tokens:
                seq = request.sequence(chunk.seq_id[1])
                drafts = chunk.token_ids[len(chunk.token_ids) - chunk.num_draft_tokens :]
                rows.extend(chunk_rows[len(chunk_rows) - len(drafts) - 1 :])
                # A draft the grammar refuses is masked out, so never kept: the rows after it
                # are never read, and take the grammar as it stands before it.
                valid = len(drafts) if seq.grammar is None else seq.grammar.valid_prefix(drafts)
                for index in range(len(drafts) + 1):
                    draft = drafts[index] if index < len(drafts) else None
                    kept = drafts[: min(index, valid)]
                    sampling_rows.append(sampling_row(request, seq, kept, draft))
                drawing.append((request, seq, len(drafts) + 1))
                continue
            for seq in request.samples_drawing(chunk.seq_id[1]):
                rows.append(chunk_rows[-1])
                sampling_rows.append(sampling_row(request, seq))
                drawing.append((request, seq, 1))
        if beams:
            result.beam_candidates = self._beam_candidates(step.logits, beams)
        if not drawing:
            return result
        logits = step.logits
        if rows != list(range(logits.shape[0])):
            logits = logits[torch.tensor(rows, device=logits.device)]
        sampled = self.sampler(logits, sampling_rows)
        row = 0
        for request, seq, num_rows in drawing:
            tokens = []
            tokenizer = self.tokenizer if request.params.detokenize else None
            for position in range(row, row + num_rows):
                token_id, logprobs = sampled.token_ids[position], sampled.logprobs[position]
                entry = None if logprobs is None else logprob_entry(tokenizer, token_id, logprobs)
                tokens.append(SampledToken(token_id, entry, sampled.exhausted[position]))
                if not sampled.drafts_kept[position]:  # a draft refused, or the last row
                    break
            result.sampled[seq.seq_id] = tokens
            row += num_rows
        if self.drafter is not None:
            result.draft_token_ids = self._propose(drawing, result)
        return result

    def _beam_candidates(
        self, logits: torch.Tensor, beams: list[tuple[Request, tuple[str, int], int]]
    ) -> dict[tuple[str, int], list[Candidate]]:
        """Each beam's `2 * beam_width` most likely next tokens (its row's logprobs, after the
        request's temperature when it sets one), each with its logprob entry (itself first, then
        the others by rank). A beam's top tokens are decoded once for all its candidates: each
        candidate decoding them again made beam_width^3 decodes a step."""
        candidates = {}
        for request, seq_id, row in beams:
            params = request.beam.params  # type: ignore[union-attr]
            row_logits = logits[row : row + 1]
            if params.temperature > 0:
                row_logits = row_logits / params.temperature
            count = min(params.num_candidates, row_logits.shape[-1])
            top = token_logprobs(row_logits, argmax(row_logits), [count])[0]
            _, _, top_ids, top_values = top
            ranked = logprob_entry(self.tokenizer, top_ids[0], top)  # the argmax ranks first
            candidates[seq_id] = [
                Candidate(token_id, value, {token_id: ranked[token_id], **ranked})
                for token_id, value in zip(top_ids, top_values, strict=True)
            ]
        return candidates

    def _propose(
        self, drawing: list[tuple[Request, Sequence, int]], result: ModelRunnerOutput
    ) -> dict[tuple[str, int], list[int]]:
        """Drafts for the next step of every sample that drew tokens and still drafts."""
        assert self.drafter is not None
        wanted = []
        for request, seq, _ in drawing:
            new = [token.token_id for token in result.sampled[seq.seq_id]]
            room = request.max_tokens - seq.num_output_tokens - len(new) - 1
            if room <= 0 or not seq.acceptance.drafting:
                continue
            token_ids = array(seq.token_ids.typecode, seq.token_ids)
            token_ids.extend(new)
            wanted.append(
                DraftRequest(seq.seq_id, token_ids, min(room, self.num_speculative_tokens))
            )
        proposed = self.drafter.propose(wanted)
        return {
            request.seq_id: drafts
            for request, drafts in zip(wanted, proposed, strict=True)
            if drafts
        }


def _grammars(
    output: SchedulerOutput, requests: Mapping[str, Request]
) -> dict[SeqId, GrammarState]:
    """The grammar of each sample that verifies drafts this step under structured outputs."""
    grammars = {}
    for chunk in output.chunks:
        if chunk.num_draft_tokens:
            grammar = requests[chunk.seq_id[0]].sequence(chunk.seq_id[1]).grammar
            if grammar is not None:
                grammars[chunk.seq_id] = grammar
    return grammars
