"""Request and sequence state: what the scheduler moves between queues.

A request is a prompt plus `SamplingParams`. Its samples are sequences: one while the prompt
is computed, then `n` once the prompt's last token has produced logits (the first sequence is
forked, so all samples share the prompt's blocks and copy on write only the last partial one).
Samples 1..n-1 are made with the request and wait in `forks` until then.

A sequence's `tokens` record (`memory.tokens.SequenceTokens`) holds the prompt and every
sampled token: the one record of them, which the memory manager shares (no copy) and the
detokenizer decodes from. `num_computed`, the scheduler's count, says how many of them have
KV; the rest are computed by the next forward passes. Computing the last token yields the
logits of the next sample. This one rule covers a new prompt, a chunked prompt, a decode,
and a sequence recomputed after preemption.

With speculative decoding a sample also carries `draft_token_ids`: tokens drafted to follow
its record, verified by its next step. They are never in the record until accepted; their KV
goes into lookahead slots the memory manager reserves past the record's end.

Nothing here imports torch or a tokenizer when it runs (the detokenizer and the generator are
named for type checkers only): the simulator schedules these same requests with no model.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedkv.engine.outputs import (
    FinishReason,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
    report,
)
from pagedkv.engine.params import SamplingParams
from pagedkv.engine.spec.acceptance import Acceptance
from pagedkv.memory.tokens import SequenceTokens

if TYPE_CHECKING:
    from array import array

    import torch

    from pagedkv.engine.beam_search import BeamState
    from pagedkv.engine.detokenizer import IncrementalDetokenizer
    from pagedkv.engine.lora_request import LoRARequest
    from pagedkv.engine.penalties import TokenCounts
    from pagedkv.engine.structured.compiler import CompiledGrammar
    from pagedkv.engine.structured.state import GrammarState


class RequestStatus(enum.Enum):
    """Which scheduler queue a request is in."""

    WAITING = "waiting"  # no blocks: new, or preempted by recompute
    RUNNING = "running"  # blocks on the GPU, scheduled every step
    SWAPPED = "swapped"  # blocks in the CPU pool, resumed before new requests are admitted
    FINISHED = "finished"


@dataclass(eq=False)  # compared by identity: queues hold the objects themselves
class Sequence:
    """One sample: its tokens, its text so far and how it ended."""

    seq_id: tuple[str, int]  # (request id, sample index): the memory manager's key
    index: int
    tokens: SequenceTokens  # prompt and sampled ids
    num_prompt_tokens: int
    num_computed: int = 0  # leading tokens whose KV is written: the scheduler's count
    detokenizer: IncrementalDetokenizer | None = None  # the engine's; the simulator makes no text
    generator: torch.Generator | None = None  # its own random stream (None: greedy)
    counts: TokenCounts | None = None  # what its penalties read, when the request has any
    grammar: GrammarState | None = None  # its place in the request's structured output
    # Speculative decoding: drafts its next step verifies (their slots reserved), and how
    # often its drafts have been kept of late.
    draft_token_ids: list[int] = field(default_factory=list)
    acceptance: Acceptance = field(default_factory=Acceptance)
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    cumulative_logprob: float = 0.0
    # What this step produced, handed out as a delta and then cleared.
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Characters of `text` already handed out; the rest may still be cut by a stop string.
    num_text_emitted: int = 0
    finish_reported: bool = False

    @property
    def token_ids(self) -> array:
        """The prompt and every sampled token (the record's int64 array, not a copy)."""
        return self.tokens.token_ids

    @property
    def output_token_ids(self) -> list[int]:
        """Sampled tokens only."""
        return self.token_ids[self.num_prompt_tokens :].tolist()

    @property
    def num_output_tokens(self) -> int:
        """How many tokens have been sampled."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        """True once the sample has a finish reason."""
        return self.finish_reason is not None


@dataclass(eq=False)
class Request:
    """A prompt, its parameters, its samples and its place in the scheduler."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens, or what is left of max_model_len when that is None
    sequences: list[Sequence]
    metrics: RequestMetrics
    cache_salt: str | None = None
    priority: int = 0  # under the "priority" policy, lower runs first
    arrival_index: int = 0  # the scheduler's count of arrivals: breaks ties in priority
    status: RequestStatus = RequestStatus.WAITING
    # Samples 1..n-1 until the prompt is computed; then forked from sample 0 and emptied.
    forks: list[Sequence] = field(default_factory=list)
    # The model's end-of-sequence ids (a sample stops on one unless params.ignore_eos), and
    # the tokenizer's own among them: stopping on another (generation_config's) reports it as
    # the stop_reason, as vLLM's stop_token_ids do.
    eos_token_ids: frozenset[int] = frozenset()
    eos_token_id: int | None = None
    # params.bad_words as token sequences (tokenized once, when the request is added).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # With params.prompt_logprobs: one entry per prompt token scored so far (the first is
    # None: nothing predicts it), complete once the prompt is computed.
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=lambda: [None])
    prompt_logprobs_reported: bool = False
    # params.structured_outputs compiling (or compiled): admitted only once it is ready.
    grammar: CompiledGrammar | None = None
    # Beam search (`beam_search.py`): its live beams are the samples, forked and freed by it.
    beam: BeamState | None = None
    # Its LoRA adapter (0: none), the pool blocks that adapter takes, and whether the request
    # holds a reference on it (from admission until it leaves the scheduler).
    lora_id: int = 0
    lora_blocks: int = 0
    holds_adapter: bool = False
    lora_request: LoRARequest | None = None  # as given, reported in its outputs (vLLM's)
    # Its output so far, kept where params.output_kind reports whole outputs, not deltas.
    whole_output: RequestOutput | None = None

    def report(self, delta: RequestOutput) -> RequestOutput | None:
        """A step's `delta` as params.output_kind asks for it (None: nothing this step)."""
        shown, self.whole_output = report(delta, self.params.output_kind, self.whole_output)
        return shown

    def sequence(self, index: int) -> Sequence:
        """The sample of index `index` (beams come and go, so not always at that position)."""
        if index < len(self.sequences) and self.sequences[index].index == index:
            return self.sequences[index]
        return next(seq for seq in self.sequences if seq.index == index)

    @property
    def grammar_ready(self) -> bool:
        """False while the request's grammar compiles (vLLM's WAITING_FOR_FSM)."""
        return self.grammar is None or self.grammar.ready

    @property
    def scores_prompt(self) -> bool:
        """Whether every prompt token's logprob is asked for (params.prompt_logprobs)."""
        return self.params.prompt_logprobs is not None

    @property
    def live_sequences(self) -> list[Sequence]:
        """Samples still generating."""
        return [seq for seq in self.sequences if not seq.finished]

    @property
    def forked(self) -> bool:
        """True once all n samples are sequences (from the start when n == 1)."""
        return not self.forks

    @property
    def num_samples_to_run(self) -> int:
        """How many sequences the request will occupy once forked (for max_num_seqs)."""
        return len(self.live_sequences) + len(self.forks)

    def samples_drawing(self, index: int) -> list[Sequence]:
        """The samples that draw their next token from sample `index`'s logits this step:
        that sample, or all n when the prompt was just computed and not forked yet."""
        if self.forked:
            return [self.sequences[index]]
        return [self.sequences[0], *self.forks]

    def end(self, reason: str) -> None:
        """End every sample not finished yet with `reason`, the ones not forked from the
        prompt yet too: they join `sequences`, so the last delta reports all n."""
        self.sequences.extend(self.forks)
        self.forks = []
        for seq in self.sequences:
            if not seq.finished:
                seq.finish_reason = reason

    @property
    def all_samples_finished(self) -> bool:
        """True once all n samples exist and each has a finish reason."""
        return self.forked and all(seq.finished for seq in self.sequences)
