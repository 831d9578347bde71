"""Logprob entries as vLLM reports them, for sampled tokens and for prompt tokens.

The sampler computes figures (`sampler.token_logprobs`: chosen logprob, rank, top k); this
module turns them into `{token_id: Logprob}` entries with decoded text, and scores prompt
tokens from the rows a step computed for them (`SamplingParams.prompt_logprobs`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from pagedkv.engine.outputs import Logprob, TokenLogprobs
from pagedkv.engine.request import Request
from pagedkv.engine.sampler import token_logprobs
from pagedkv.tokenizer import Tokenizer
from pagedkv.worker.runner import StepLogits
from pagedkv.worker.step import ScheduledChunk


def logprob_entry(
    tokenizer: Tokenizer | None,
    token_id: int,
    logprobs: tuple[float, int, list[int], list[float]],
) -> TokenLogprobs:
    """The chosen token's entry first, then the top k not already there, ranked 1..k; each
    token's text, or None without a tokenizer (a request with `detokenize=False`, as vLLM's)."""
    chosen, rank, top_ids, top_values = logprobs

    def text(token: int) -> str | None:
        return None if tokenizer is None else tokenizer.decode([token], False)

    entry = {token_id: Logprob(chosen, rank, text(token_id))}
    for position, (top_id, value) in enumerate(zip(top_ids, top_values, strict=True)):
        if top_id not in entry:
            entry[top_id] = Logprob(value, position + 1, text(top_id))
    return entry


def score_prompts(
    chunks: Sequence[ScheduledChunk],
    step: StepLogits,
    requests: Mapping[str, Request],
    tokenizer: Tokenizer,
) -> dict[str, list[TokenLogprobs]]:
    """Prompt logprobs from the rows of chunks that score their prompt tokens, by request.

    Row `i` of a chunk starting at position `s` holds the logits after token `s + i`, so it
    scores prompt token `s + i + 1`; each token is scored once, in order (a chunk recomputed
    after a preemption adds nothing), and the row past the prompt samples.
    """
    assert step.logits is not None, "a chunk that scores its prompt has logits"
    scored: dict[str, list[TokenLogprobs]] = {}
    for chunk, rows in zip(chunks, step.rows, strict=True):
        request = requests.get(chunk.seq_id[0])
        if request is None or not request.scores_prompt or len(rows) <= chunk.sample:
            continue
        prompt = request.prompt_token_ids
        targets = range(chunk.num_computed + 1, chunk.num_computed + 1 + len(rows))
        picked = [
            (row, target)
            for row, target in zip(rows, targets, strict=True)
            if len(request.prompt_logprobs) <= target < len(prompt)
        ]
        if not picked:
            continue
        row_index = torch.tensor([row for row, _ in picked], device=step.logits.device)
        target_ids = [prompt[target] for _, target in picked]
        entries = token_logprobs(
            step.logits[row_index],
            torch.tensor(target_ids, device=step.logits.device),
            [request.params.prompt_logprobs or 0] * len(picked),
        )
        scored[request.request_id] = [
            logprob_entry(tokenizer if request.params.detokenize else None, token_id, entry)
            for token_id, entry in zip(target_ids, entries, strict=True)
        ]
    return scored
