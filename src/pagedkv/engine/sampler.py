"""Sampler: the next token of every sampled sequence, from one `[num_rows, vocab]` logits tensor.

Every step is a tensor op over the whole batch; Python loops only over rows to gather their
settings, never over the vocabulary. The order is vLLM's: the structured-output grammar's mask
(tokens it does not allow masked), allowed_token_ids (every other token masked), bad_words (a
bad word's last token masked where the output ends with the rest of it), logit_bias (added),
penalties (repetition on prompt and output, presence and frequency on output), min_tokens
(stop tokens masked; EOS too under a grammar with ignore_eos), then greedy rows take the
argmax while the others are scaled by temperature and filtered by min_p, top_k and top_p
before sampling.

Sampling draws `argmax(probs / E)` with `E ~ Exp(1)` noise per token, which picks token `i`
with probability `probs[i]`. Every sampled row draws its noise from its sample's own generator
(seeded by the request's seed, else by the engine's seed and the sample's place in the order
samples were made: `samples.py`), so its tokens do not depend on what else is in the batch.

A row may verify a speculative draft (`SamplingRow.draft_token_id`): its settings are those of
the sample as if the drafts before it had been kept. Every row draws its token as it would
without drafts (greedy: the argmax; sampling: `argmax(probs / E)`) and keeps its draft when
the two are the same token. For a deterministic draft (one-hot q, as both drafters propose)
that is the standard rejection rule: the draft is kept with probability `p[draft]` = min(1,
p/q), and a refused row's token is distributed as `p` without the draft, normalised (the
residual max(p - q, 0)). Drawing it this way also spends a seeded sample's randomness as plain
decoding does, one draw per token it emits (`_noise`), so a seed gives the same tokens with
speculation as without.

Rows share every tensor op, so no row's value may size one beyond what the logits hold: a
top_k or a logprobs count above the vocabulary is clamped to it. Every other per-row value
(temperature, top_p, min_p, penalties, seeds, biases, masks) only scales or masks its own row,
and the token ids a request names (stop ids, logit_bias, allowed_token_ids) were checked
against the vocabulary when the request was added.

Past 400 lines as one module: the processors, the draw, the draft check and the logprobs
are one pass over a step's rows, in vLLM's order, each reading what the one before left.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from pagedkv.engine.params import SamplingParams
from pagedkv.engine.penalties import TokenCounts, apply_penalties, uses_penalties
from pagedkv.engine.request import Request
from pagedkv.engine.request import Sequence as SequenceState
from pagedkv.engine.structured.mask import apply_grammar_masks
from pagedkv.engine.structured.state import GrammarState

# How many of a row's most likely tokens top_p looks among before it sorts the whole row.
NUCLEUS_CANDIDATES = 1024


def argmax(values: Tensor) -> Tensor:
    """Each row's index of its largest value along the last dimension, the first of equal ones
    and a NaN above all: `Tensor.argmax(dim=-1)`. On the CPU numpy's does it: torch 2.13's
    takes 74 us a row of a 49,152-token vocabulary on 2 threads, numpy's 4, and it made most of
    a greedy row's sampling (and a tenth of what a speculative draft's row costs)."""
    if values.device.type != "cpu":
        return values.argmax(dim=-1)
    return torch.as_tensor(values.numpy().argmax(axis=-1))


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs of one sequence: its settings and what it has sampled so far,
    never its whole token list: a count, the tail bad words compare, and penalty counts."""

    params: SamplingParams
    num_output_tokens: int
    stop_token_ids: Sequence[int]  # stop_token_ids + eos ids: what min_tokens masks
    generator: torch.Generator | None  # the sample's own stream (None: a greedy sample)
    counts: TokenCounts | None = None  # kept when the params use penalties
    output_tail: Sequence[int] = ()  # the last output tokens, as many as bad words need
    bad_words_token_ids: Sequence[Sequence[int]] = ()  # the request's bad words, as tokens
    grammar: GrammarState | None = None  # with structured outputs: what the grammar allows
    draft_token_id: int | None = None  # the speculative draft this row verifies, if any

    @property
    def processes_logits(self) -> bool:
        """Whether a logits processor may write its row (`Sampler.__call__`'s order)."""
        p = self.params
        limits = p.allowed_token_ids or self.bad_words_token_ids or p.logit_bias
        return bool(limits or uses_penalties(p) or self.banned_stops())

    def banned_stops(self) -> Sequence[int]:
        """The ids the row may not pick because they would stop it: every stop and EOS id
        short of min_tokens; under a grammar with ignore_eos, the EOS ids (a grammar takes EOS
        as its end, so sampled it would end the sample there rather than run on to max_tokens
        as ignore_eos asks; the grammar's own end, where only EOS could follow, still stops
        it, `stops.py`)."""
        p = self.params
        if self.num_output_tokens < p.min_tokens:
            return self.stop_token_ids
        if p.ignore_eos and self.grammar is not None:
            return [t for t in self.stop_token_ids if t not in (p.stop_token_ids or ())]
        return ()


def sampling_row(
    request: Request,
    seq: SequenceState,
    kept: Sequence[int] = (),
    draft_token_id: int | None = None,
) -> SamplingRow:
    """The row of one sample about to draw a token; with speculative decoding, the row after
    the drafts `kept` (as if the sample had sampled them), verifying `draft_token_id`."""
    # What min_tokens bans: every stop id and EOS id, even under ignore_eos (vLLM's rule).
    stop_ids = list(request.params.stop_token_ids or [])
    stop_ids += [t for t in sorted(request.eos_token_ids) if t not in stop_ids]
    num_output = seq.num_output_tokens + len(kept)
    # Bad words compare only the output's last tokens, as many as the longest word's prefix.
    tail = min(max(map(len, request.bad_words_token_ids), default=1) - 1, num_output)
    output_tail: Sequence[int] = ()
    if tail:  # what the drafts kept leave to come from the sample's own output
        from_output = max(0, tail - len(kept))
        output_tail = [*seq.token_ids[len(seq.token_ids) - from_output :], *kept][-tail:]
    counts, grammar = seq.counts, seq.grammar
    if kept:
        counts = None if counts is None else counts.with_tokens(kept)
        grammar = None if grammar is None else grammar.advanced(kept)
    return SamplingRow(
        params=request.params,
        num_output_tokens=num_output,
        stop_token_ids=stop_ids,
        generator=seq.generator,
        counts=counts,
        output_tail=output_tail,
        bad_words_token_ids=request.bad_words_token_ids,
        grammar=grammar,
        draft_token_id=draft_token_id,
    )


@dataclass(frozen=True)
class SamplerOutput:
    """Chosen token per row, and logprobs for the rows that asked for them."""

    token_ids: list[int]
    # Per row: None, or (chosen logprob, chosen rank, top-k ids, top-k logprobs).
    logprobs: list[tuple[float, int, list[int], list[float]] | None]
    # Per row: whether its draft was kept (its token is then the draft); None without one.
    drafts_kept: list[bool | None]
    # Per row: whether its processors masked every token, so that its token means nothing.
    exhausted: list[bool]


class Sampler:
    """Chooses next tokens for a batch of rows with per-row settings."""

    def __call__(self, logits: Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Sample one token per row of float32 `logits [len(rows), vocab]`."""
        constrained = [index for index, row in enumerate(rows) if row.grammar is not None]
        if constrained:  # logprobs are over what the grammar allows, as vLLM's
            logits = logits.clone()
            apply_grammar_masks(logits, constrained, [rows[i].grammar for i in constrained])
        raw_logits = logits
        # Processors write a copy, and only when one will (6 rows' copy: 0.13 ms, 1% of a step)
        processed = any(row.processes_logits for row in rows)
        if processed:
            logits = logits.clone()
        _apply_allowed_token_ids(logits, rows)
        _apply_bad_words(logits, rows)
        _apply_logit_bias(logits, rows)
        _apply_penalties(logits, rows)
        _apply_banned_stops(logits, rows)
        exhausted = _exhausted(logits, rows) if processed else [False] * len(rows)
        chosen = _choose(logits, rows)
        token_ids = chosen.tolist()
        return SamplerOutput(
            token_ids,
            _logprobs(raw_logits, chosen, rows),
            [  # a draft is kept where the row drew it (from a token it allowed)
                None if row.draft_token_id is None else token_id == row.draft_token_id and not dead
                for row, token_id, dead in zip(rows, token_ids, exhausted, strict=True)
            ],
            exhausted,
        )


def _exhausted(logits: Tensor, rows: Sequence[SamplingRow]) -> list[bool]:
    """Rows whose processors masked every token (allowed_token_ids that are all bad words,
    or all stop ids before min_tokens): what such a row draws no setting allowed. A grammar's
    rows are left to the grammar, whose refusal of the token ends them (`stops.py`)."""
    masked = torch.isneginf(logits).all(dim=-1).tolist()
    return [bool(none) and row.grammar is None for none, row in zip(masked, rows, strict=True)]


def _apply_allowed_token_ids(logits: Tensor, rows: Sequence[SamplingRow]) -> None:
    """Rows with allowed_token_ids can pick only those tokens."""
    limited = [index for index, row in enumerate(rows) if row.params.allowed_token_ids]
    if not limited:
        return
    keep = torch.zeros(len(limited), logits.shape[-1], dtype=torch.bool, device=logits.device)
    for position, index in enumerate(limited):
        allowed = rows[index].params.allowed_token_ids
        keep[position, torch.tensor(allowed, device=logits.device)] = True
    index = torch.tensor(limited, device=logits.device)
    logits[index] = logits[index].masked_fill(~keep, float("-inf"))


def _apply_bad_words(logits: Tensor, rows: Sequence[SamplingRow]) -> None:
    """A bad word's last token is masked where the output ends with the word's other tokens."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    for index, row in enumerate(rows):
        for word in row.bad_words_token_ids:
            prefix = list(word[:-1])
            output = row.output_tail
            if len(prefix) <= len(output) and list(output[len(output) - len(prefix) :]) == prefix:
                row_ids.append(index)
                token_ids.append(word[-1])
    _mask(logits, row_ids, token_ids)


def _apply_logit_bias(logits: Tensor, rows: Sequence[SamplingRow]) -> None:
    row_ids: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for index, row in enumerate(rows):
        for token_id, bias in (row.params.logit_bias or {}).items():
            row_ids.append(index)
            token_ids.append(token_id)
            biases.append(bias)
    if row_ids:
        device = logits.device
        where = (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device))
        logits.index_put_(where, torch.tensor(biases, dtype=logits.dtype, device=device), True)


def _apply_penalties(logits: Tensor, rows: Sequence[SamplingRow]) -> None:
    """Repetition, presence and frequency penalties of the rows that set any."""
    penalised = [i for i, row in enumerate(rows) if uses_penalties(row.params)]
    if not penalised:
        return
    counts = [rows[i].counts for i in penalised]
    if any(c is None for c in counts):
        raise ValueError("a row with penalties needs its TokenCounts")
    params = [rows[i].params for i in penalised]
    apply_penalties(logits, penalised, params, counts)  # type: ignore[arg-type]


def _apply_banned_stops(logits: Tensor, rows: Sequence[SamplingRow]) -> None:
    """Rows short of min_tokens (or constrained under ignore_eos) cannot pick a token that
    would stop them (`SamplingRow.banned_stops`); but a constrained row whose other tokens
    are all masked keeps EOS, which ends it as the grammar's end would (rather than draw a
    token the grammar refuses)."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    for index, row in enumerate(rows):
        banned = row.banned_stops()
        if banned and row.num_output_tokens >= row.params.min_tokens:  # ignore_eos's ban
            others = torch.isfinite(logits[index])
            others[list(banned)] = False
            if not bool(others.any()):
                continue
        row_ids.extend([index] * len(banned))
        token_ids.extend(banned)
    _mask(logits, row_ids, token_ids)


def _mask(logits: Tensor, row_ids: list[int], token_ids: list[int]) -> None:
    """Make token `token_ids[i]` impossible in row `row_ids[i]`."""
    if row_ids:
        logits[
            torch.tensor(row_ids, device=logits.device),
            torch.tensor(token_ids, device=logits.device),
        ] = float("-inf")


def _choose(logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
    """Each row's token."""
    sampled = [index for index, row in enumerate(rows) if not row.params.greedy]
    if len(sampled) < len(rows):
        chosen = argmax(logits)
    else:  # every row samples: no argmax of the logits to take
        chosen = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    if sampled:
        index = torch.tensor(sampled, device=logits.device)
        subset = [rows[i] for i in sampled]
        temperature = torch.tensor([row.params.temperature for row in subset], device=logits.device)
        probs = _filtered_probs(logits[index] / temperature[:, None], subset)
        chosen[index] = argmax(probs / _noise(probs, subset))
    return chosen


def _noise(probs: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
    """Exp(1) noise for each row of `probs` from its sample's generator, one draw per token the
    sample emits: its rows after one whose draft it refuses (rows whose tokens are never read)
    draw nothing (their noise is 1), so the generator advances as in plain decoding, however
    many drafts a step verifies.

    Drawn as -log(U), U uniform on [2^-53, 1) in float64: torch's `exponential_` draws the same
    distribution about 4x slower on the CPU (25 against 7 ms for 32 rows of a 49,152-token
    vocabulary; a greedy step of 32 sequences takes ~45). Float64 because a token of
    probability p wins only when its E is below about p: U on float32's 2^-24 grid near 1 would
    make E's smallest values 6e-8 apart, and tokens below ~1e-7 would almost never be drawn.
    E lies in [1.1e-16, 36.7]: never 0 (0 / 0 would be NaN, which argmax takes as the
    maximum)."""
    noise = torch.ones_like(probs)
    refused: set[int] = set()  # the generators of samples that refused a draft this step
    for position, row in enumerate(rows):
        if row.generator is None:
            raise ValueError("a sampled row needs its sample's generator")
        if id(row.generator) in refused:
            continue
        _exponential(noise[position], row.generator)
        draft = row.draft_token_id
        if draft is not None and int(argmax(probs[position] / noise[position])) != draft:
            refused.add(id(row.generator))
    return noise


def _exponential(out: Tensor, generator: torch.Generator) -> Tensor:
    """`out` filled with Exp(1) draws from `generator` (see `_noise`)."""
    uniform = torch.empty(out.shape, dtype=torch.float64, device=out.device)
    return out.copy_(uniform.uniform_(2.0**-53, 1.0, generator=generator).log_().neg_())


def _filtered_probs(logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
    """Probabilities after min_p, top_k and top_p (vLLM's order), each applied only to the
    rows that set it: a row's filter never depends on what else is in the batch.

    min_p drops tokens below `min_p` times the most likely one's probability; top_k keeps the
    k most likely of the rest; top_p, over what is left renormalised, drops every token whose
    more likely tokens already reach p (vLLM's `cumsum ascending <= 1 - p`)."""
    vocab = logits.shape[-1]
    device = logits.device
    min_p = [row.params.min_p for row in rows]
    if max(min_p) > 0.0:
        probs = logits.softmax(dim=-1)
        floor = torch.tensor(min_p, device=device)[:, None] * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    # A top_k beyond the vocabulary keeps every token (vLLM accepts any value); clamping it
    # keeps one request's value from failing the shared `topk` of the whole step.
    top_k = [min(row.params.top_k, vocab) if row.params.top_k > 0 else vocab for row in rows]
    if min(top_k) < vocab:
        k = torch.tensor(top_k, device=device)
        kth = logits.topk(max(top_k), dim=-1).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    nucleus = [index for index, row in enumerate(rows) if row.params.top_p < 1.0]
    if nucleus:  # a row without top_p keeps even rounding's tail
        index = torch.tensor(nucleus, device=device)
        top_p = torch.tensor([rows[i].params.top_p for i in nucleus], device=device)
        selected = logits[index]
        kept = selected.masked_fill(~_nucleus(selected, top_p), float("-inf"))
        logits = logits.index_put((index,), kept)
    return logits.softmax(dim=-1)


def _nucleus(logits: Tensor, top_p: Tensor) -> Tensor:
    """Which tokens each row's top_p keeps: in order of probability (equal ones by token id,
    the lower first), a token goes once those before it reach the row's p.

    Sorting 32 rows of 49,152 tokens takes about 50 ms on 2 cores, longer than the model's
    step for them (their 1,024 largest, 6 ms). A trained model's nucleus is mostly far smaller:
    the row's NUCLEUS_CANDIDATES most likely tokens (topk, then put in that order) decide it
    whenever their last is outside it and no token left out ties with its last member; only
    the other rows are sorted whole, and so is at once a row too flat for its candidates to
    reach p (their sum is at most their count times its largest probability: random models,
    high temperatures). Both ways sum the same probabilities in the same order, so a row's
    nucleus does not depend on which way, or on the rows beside it.
    """
    probs = logits.softmax(dim=-1)
    p = top_p[:, None]
    kept = torch.zeros_like(probs, dtype=torch.bool)
    count = min(NUCLEUS_CANDIDATES, probs.shape[-1])
    hopeful = probs.amax(dim=-1) * count >= top_p
    whole = (~hopeful).nonzero()[:, 0]
    if hopeful.any():
        rows = hopeful.nonzero()[:, 0]
        values, ids = (probs if len(whole) == 0 else probs[rows]).topk(count, dim=-1)
        # In token id order first, so that the stable sort by probability leaves ties by id.
        ids, by_id = ids.sort(dim=-1)
        values, order = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
        ids = ids.gather(1, order)
        inside = values.cumsum(dim=-1) - values < p[rows]
        last = (inside.sum(dim=-1, keepdim=True) - 1).clamp(min=0)
        decided = ~inside[:, -1] & (values.gather(1, last)[:, 0] > values[:, -1])
        kept[rows[:, None], ids] = inside  # an undecided row's is rewritten whole below
        whole = torch.cat([whole, rows[~decided]])
    if len(whole):
        values, order = probs[whole].sort(dim=-1, descending=True, stable=True)
        inside = values.cumsum(dim=-1) - values < p[whole]
        kept[whole] = kept[whole].scatter(1, order, inside)
    return kept


def _logprobs(
    logits: Tensor, chosen: Tensor, rows: Sequence[SamplingRow]
) -> list[tuple[float, int, list[int], list[float]] | None]:
    """Logprobs of the model's own distribution (before penalties and temperature; under a
    grammar, over the tokens it allows), as vLLM's."""
    wanted = [index for index, row in enumerate(rows) if row.params.logprobs is not None]
    result: list[tuple[float, int, list[int], list[float]] | None] = [None] * len(rows)
    if not wanted:
        return result
    index = torch.tensor(wanted, device=logits.device)
    counts = [rows[i].params.logprobs or 0 for i in wanted]
    entries = token_logprobs(logits[index], chosen[index], counts)
    for row_index, entry in zip(wanted, entries, strict=True):
        result[row_index] = entry
    return result


def token_logprobs(
    logits: Tensor, chosen: Tensor, counts: Sequence[int]
) -> list[tuple[float, int, list[int], list[float]]]:
    """Per row: the chosen token's logprob and rank (1: the most likely), and the row's
    `counts[i]` most likely tokens with their logprobs (a count above the vocabulary is
    clamped to it; `most_likely`). Used for sampled tokens and, with the prompt's tokens,
    prompt logprobs."""
    logprobs = logits.log_softmax(dim=-1)
    chosen_logprobs = logprobs.gather(1, chosen[:, None])
    ranks = (logprobs >= chosen_logprobs).sum(dim=-1).tolist()  # vLLM's: ties rank above
    counts = [min(count, logits.shape[-1]) for count in counts]
    top_ids, top_values = most_likely(logprobs, counts)
    return list(zip(chosen_logprobs[:, 0].tolist(), ranks, top_ids, top_values, strict=True))


def most_likely(
    logprobs: Tensor, counts: Sequence[int]
) -> tuple[list[list[int]], list[list[float]]]:
    """Per row, its `counts[i]` (at most the vocabulary) largest values and their token ids,
    largest first, equal values by token id (the lower first).

    `topk` alone leaves the order of equal values, and which of them make the cut, to its
    algorithm, which depends on k and on the rows beside: a row's entries would change with
    what the rest of its step asks for (float16 and bfloat16 models tie often). So the order
    is fixed here: topk's k-th value bounds each row, and a row with more tokens at or above it
    than it asks for (a tie across the cut; every masked token, where fewer are allowed than
    asked) takes the lowest ids of the tokens at it.
    """
    max_k = max(counts, default=0)
    if not max_k:
        return [[] for _ in counts], [[] for _ in counts]
    top = logprobs.topk(max_k, dim=-1)
    last = torch.tensor([max(count, 1) - 1 for count in counts], device=logprobs.device)
    cut = top.values.gather(1, last[:, None])
    at_or_above = (logprobs >= cut).sum(dim=-1).tolist()
    all_ids, all_values = top.indices.tolist(), top.values.tolist()
    cuts = cut[:, 0].tolist()
    result_ids, result_values = [], []
    for row, count in enumerate(counts):
        entries = list(zip(all_values[row][:count], all_ids[row][:count], strict=True))
        if count and at_or_above[row] > count:  # the cut splits a tie: the lowest ids of it
            entries = [(value, token_id) for value, token_id in entries if value > cuts[row]]
            tied = (logprobs[row] == cut[row]).nonzero()[: count - len(entries), 0].tolist()
            entries += [(cuts[row], token_id) for token_id in tied]
        entries.sort(key=lambda entry: (-entry[0], entry[1]))
        result_ids.append([token_id for _, token_id in entries])
        result_values.append([value for value, _ in entries])
    return result_ids, result_values
