"""Beam search: vLLM's `BeamSearchParams` and rule, over beams that share their blocks.

vLLM's rule: at every step each live beam proposes its `2 * beam_width` most likely next
tokens; a beam extended with an end-of-sequence token is complete (unless `ignore_eos`); of the
other extensions the `beam_width` of highest score live on. After `max_tokens` steps the live
beams join the complete ones and the best `beam_width` of all, by score, are the answer. A
beam's score is its cumulative logprob over its length (prompt included, a final EOS not) to
the power `length_penalty` (`beam_score`).

PagedAttention's memory is what makes beams cheap here (its paper's own case): beams are
samples of one request, and a beam that several extensions keep is forked, so the children
share every block of their common past through the block tables, and the last, partly filled
block is copied when each writes its own token (copy-on-write). A beam that no extension keeps
is freed, releasing only the blocks no other beam holds. `sched/beams.py` applies the decisions
to the blocks; this module holds the rule and the bookkeeping.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedkv.engine.outputs import CompletionOutput, FinishReason, TokenLogprobs
from pagedkv.engine.params import SamplingParams
from pagedkv.tokenizer import Tokenizer

SeqId = tuple[str, int]


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam search settings (names and defaults)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # scales the logits before their logprobs (0: as they are)
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # vLLM's field; beams stop only at EOS

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")

    def sampling_params(self, skip_special_tokens: bool) -> SamplingParams:
        """The request's SamplingParams: n, the beams it may hold at once, is what the pool's
        checks count; the rest is not read (beams sample nothing), but the text's decoding."""
        return SamplingParams(
            n=self.beam_width,
            max_tokens=self.max_tokens,
            temperature=0.0,
            ignore_eos=True,
            skip_special_tokens=skip_special_tokens,
        )

    @property
    def num_candidates(self) -> int:
        """Extensions each beam proposes per step (vLLM's 2 * beam_width)."""
        return 2 * self.beam_width


def beam_score(
    num_tokens: int, cumulative_logprob: float, ended: bool, length_penalty: float
) -> float:
    """vLLM's `get_beam_search_score`: the cumulative logprob over the length (prompt and
    output, a final EOS not counted) to the power `length_penalty`."""
    return cumulative_logprob / (num_tokens - ended) ** length_penalty


@dataclass(frozen=True)
class Candidate:
    """One extension a beam proposes: its token and that token's logprob entry (the token
    first, then the beam's other candidates)."""

    token_id: int
    logprob: float
    entry: TokenLogprobs


@dataclass
class Hypothesis:
    """A beam that is done: its output tokens (a final EOS included), their logprob entries,
    its cumulative logprob and why it ended ("stop": EOS, "length": max_tokens, "abort")."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    cumulative_logprob: float
    finish_reason: FinishReason


@dataclass(frozen=True)
class Extension:
    """A kept extension: the beam it extends (by sample index) and the candidate."""

    parent: int
    candidate: Candidate
    cumulative_logprob: float


@dataclass
class BeamState:
    """One beam-search request's rule and history: what each live beam has produced, the
    complete beams, and the next sample index (each new beam is a new sample)."""

    params: BeamSearchParams
    num_prompt_tokens: int
    max_tokens: int  # params.max_tokens, cut to the room the context leaves
    eos_token_ids: frozenset[int]
    outputs: dict[int, list[int]] = field(default_factory=lambda: {0: []})
    logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=lambda: {0: []})
    cumulative: dict[int, float] = field(default_factory=lambda: {0: 0.0})
    completed: list[Hypothesis] = field(default_factory=list)
    # Candidates of beams whose next row is computed, until every live beam's is (beams
    # recomputed after a preemption, or cut by a step's budget, may finish at other steps).
    pending: dict[int, Sequence[Candidate]] = field(default_factory=dict)
    next_index: int = 1
    steps: int = 0

    def propose(self, index: int, candidates: Sequence[Candidate]) -> None:
        """Beam `index`'s extensions for the next step."""
        self.pending[index] = candidates

    def ready(self, live: Sequence[int]) -> bool:
        """Whether every live beam has proposed its extensions."""
        return all(index in self.pending for index in live)

    def select(self) -> list[Extension]:
        """One step of the rule over the live beams' proposals: EOS extensions complete; of
        the others, the `beam_width` best live on (best first)."""
        proposals, self.pending = self.pending, {}
        kept: list[Extension] = []
        for parent, candidates in proposals.items():
            for candidate in candidates:
                total = self.cumulative[parent] + candidate.logprob
                if candidate.token_id in self.eos_token_ids and not self.params.ignore_eos:
                    self.completed.append(
                        Hypothesis(
                            [*self.outputs[parent], candidate.token_id],
                            [*self.logprobs[parent], candidate.entry],
                            total,
                            "stop",
                        )
                    )
                else:
                    kept.append(Extension(parent, candidate, total))
        length = self.num_prompt_tokens + self.steps + 1
        penalty = self.params.length_penalty

        def score(extension: Extension) -> float:
            ended = extension.candidate.token_id in self.eos_token_ids  # with ignore_eos
            return beam_score(length, extension.cumulative_logprob, ended, penalty)

        kept.sort(key=score, reverse=True)
        self.steps += 1
        return kept[: self.params.beam_width]

    def extend(self, index: int, parent: int, extension: Extension) -> None:
        """Sample `index` is now beam `parent` extended by `extension` (the parent itself,
        or a fork of it given a new index)."""
        candidate = extension.candidate
        self.outputs[index] = [*self.outputs[parent], candidate.token_id]
        self.logprobs[index] = [*self.logprobs[parent], candidate.entry]
        self.cumulative[index] = extension.cumulative_logprob

    def drop(self, index: int) -> None:
        """Forget a beam no extension kept."""
        for history in (self.outputs, self.logprobs, self.cumulative, self.pending):
            history.pop(index, None)

    def finish(self, live: Sequence[int], reason: FinishReason = "length") -> None:
        """The search is over (or aborted): the live beams complete too, those with a history
        (an abort in the middle of a step's rule may find a fork not extended yet, or a beam
        already dropped)."""
        for index in live:
            if index not in self.outputs:
                continue
            self.completed.append(
                Hypothesis(
                    self.outputs[index], self.logprobs[index], self.cumulative[index], reason
                )
            )
            self.drop(index)

    @property
    def done(self) -> bool:
        """Whether the search has run its `max_tokens` steps."""
        return self.steps >= self.max_tokens

    def best(self) -> list[Hypothesis]:
        """The answer: the `beam_width` complete beams of highest score, best first."""
        penalty = self.params.length_penalty

        def score(hypothesis: Hypothesis) -> float:
            # a search aborted before its first step completes its root beam, with no tokens
            ended = bool(hypothesis.token_ids) and hypothesis.token_ids[-1] in self.eos_token_ids
            length = self.num_prompt_tokens + len(hypothesis.token_ids)
            return beam_score(length, hypothesis.cumulative_logprob, ended, penalty)

        return sorted(self.completed, key=score, reverse=True)[: self.params.beam_width]

    def answer(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> list[CompletionOutput]:
        """The answer as the engine's outputs, as vLLM's server gives it: a final EOS (its
        text, its logprob entry) left out unless `include_stop_str_in_output`, and the EOS
        id as the stop reason."""
        outputs = []
        for index, beam in enumerate(self.best()):
            token_ids, logprobs = beam.token_ids, beam.logprobs
            stop_reason = token_ids[-1] if beam.finish_reason == "stop" else None
            if stop_reason is not None and not self.params.include_stop_str_in_output:
                token_ids, logprobs = token_ids[:-1], logprobs[:-1]
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens),
                    token_ids=token_ids,
                    finish_reason=beam.finish_reason,
                    stop_reason=stop_reason,
                    logprobs=logprobs,
                    cumulative_logprob=beam.cumulative_logprob,
                )
            )
        return outputs


@dataclass
class BeamSearchSequence:
    """One beam of `LLM.beam_search`'s answer, as vLLM's: its tokens (the prompt's, then
    the output's, a final EOS included), one logprob entry per output token, its cumulative
    logprob, its text (all its tokens decoded, special ones too) and why it ended."""

    tokens: list[int]
    logprobs: list[TokenLogprobs]
    cum_logprob: float
    text: str
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first (vLLM's shape)."""

    sequences: list[BeamSearchSequence]
