"""When a sample stops, and how much of its text is safe to hand out.

Checked after every sampled token, in vLLM's order: nothing stops a sample before
`min_tokens`; then an end-of-sequence id (unless `ignore_eos`) or a `stop_token_ids` entry
ends it (its stop_reason the id, but None for the tokenizer's own EOS, also when it is in
`stop_token_ids`) without adding that
token's text (with `include_stop_str_in_output`, with it, as vLLM's detokenizer does); then the
first stop string of the list that ends in the token's text ends it, with the text cut just
before the string, or just after it with `include_stop_str_in_output` (the search covers the
tail where a string split across tokens can complete); then a structured output's grammar that is
complete (it would allow only EOS: vLLM's finished FSM; before min_tokens too, since nothing
else could be sampled); then `max_tokens` (which the engine cut to the room the context
leaves). A token the grammar refuses (the request's other constraints masked everything it
allows) ends the sample first, with finish_reason "abort", and so does a token drawn where
the sample's own settings masked every token (`Sampler`'s `exhausted`): no setting allowed
that token, so it is left out of the sample's tokens, logprobs and text.
While stop strings are set and excluded from the output, the last `len(longest) - 1`
characters are held back from streaming, since they may still turn out to be the start of a
stop string. (With the string included nothing is held back: all text up to its end is
output, and it completes in the newest token's text, past everything already handed out.)
"""

from __future__ import annotations

import logging

from pagedkv.engine.outputs import CompletionOutput
from pagedkv.engine.request import Request, Sequence
from pagedkv.engine.sched.output import SampledToken

logger = logging.getLogger(__name__)
EXHAUSTED = (
    "its settings masked every token (allowed_token_ids, bad_words, min_tokens or logit_bias "
    "exclude each other)"
)
GRAMMAR_FAILED = (
    "its structured output failed ({}): the request's other constraints left no token it "
    "allows, or the grammar passed llguidance's limits"
)


def apply_stops(request: Request, seq: Sequence, token_id: int) -> None:
    """Update the sample's text with its newest token and set its finish reason if it ends.

    A sequence without a detokenizer (the simulator's) makes no text, so no stop string ends it.
    """
    params = request.params
    may_stop = seq.num_output_tokens >= params.min_tokens
    is_eos = may_stop and not params.ignore_eos and token_id in request.eos_token_ids
    if is_eos or (may_stop and token_id in params.stop_token_ids):
        if params.include_stop_str_in_output and seq.detokenizer is not None:
            seq.text += seq.detokenizer.advance()
        # vLLM's order: the tokenizer's own EOS first, with no stop_reason (even when it is
        # in stop_token_ids too); any other id that stops (a stop_token_ids entry, another
        # end-of-sequence id) reports itself.
        own_eos = is_eos and request.eos_token_id in (None, token_id)
        _finish(seq, "stop", None if own_eos else token_id)
        return
    previous_length = len(seq.text)
    if seq.detokenizer is not None:
        seq.text += seq.detokenizer.advance()
    # vLLM's: a stop string must end in the text of a token past the first min_tokens.
    past_min = seq.num_output_tokens > params.min_tokens
    if past_min and params.stop_strings and len(seq.text) > previous_length:
        _find_stop_string(
            seq, params.stop_strings, previous_length, params.include_stop_str_in_output
        )
        if seq.finished:
            return
    if seq.grammar is not None and seq.grammar.finished:
        # The grammar is complete: it would allow only EOS now, which min_tokens would mask,
        # leaving nothing to sample; the constraint wins over min_tokens.
        _finish(seq, "stop", None)
        return
    if seq.num_output_tokens >= request.max_tokens:
        _finish(seq, "length", None)


def append_sampled(request: Request, seq: Sequence, sampled: list[SampledToken]) -> int:
    """A sample's new tokens, in order, into its record and what reads it (penalty counts, the
    grammar, logprobs), each followed by the stops; a stop drops the tokens after it. Returns
    how many were appended."""
    for count, token in enumerate(sampled, start=1):
        token_id = token.token_id
        if token.exhausted:
            _refused(request, seq, EXHAUSTED)
            return count - 1
        if seq.grammar is not None:
            seq.grammar.accept(token_id)
            if seq.grammar.failed:
                _refused(request, seq, GRAMMAR_FAILED.format(seq.grammar.error))
                return count - 1
        seq.token_ids.append(token_id)
        seq.new_token_ids.append(token_id)
        if seq.counts is not None:
            seq.counts.add(token_id)
        if token.logprobs is not None:
            seq.new_logprobs.append(token.logprobs)
            seq.cumulative_logprob += token.logprobs[token_id].logprob
        apply_stops(request, seq, token_id)
        if seq.finished:
            return count
    return len(sampled)


def _refused(request: Request, seq: Sequence, reason: str) -> None:
    """End a sample whose newest token no setting allowed, leaving that token out of its
    record (`reason` says which setting): it ends with finish_reason "abort", never as a
    success."""
    logger.warning(
        "request %s: %s: the sample ends with finish_reason 'abort'", request.request_id, reason
    )
    _finish(seq, "abort", None)


def take_text(request: Request, seq: Sequence) -> str:
    """Text not yet handed out, less the tail a stop string could still claim."""
    end = len(seq.text)
    params = request.params
    if not seq.finished and params.stop_strings and not params.include_stop_str_in_output:
        hold_back = max(len(s) for s in params.stop_strings) - 1
        end = max(seq.num_text_emitted, end - hold_back)
    text = seq.text[seq.num_text_emitted : end]
    seq.num_text_emitted = end
    return text


def take_outputs(request: Request) -> list[CompletionOutput]:
    """What each sample produced since the last delta: its new tokens, the text safe to hand
    out and logprobs (and its finish, once); clears its per-step buffers."""
    outputs = []
    wants_logprobs = request.params.logprobs is not None
    for seq in request.sequences:
        text = take_text(request, seq)
        finishing = seq.finished and not seq.finish_reported
        if not (seq.new_token_ids or text or finishing):
            continue
        outputs.append(
            CompletionOutput(
                index=seq.index,
                text=text,
                token_ids=seq.new_token_ids,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                logprobs=seq.new_logprobs if wants_logprobs else None,
                cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
            )
        )
        seq.new_token_ids = []
        seq.new_logprobs = []
        seq.finish_reported = seq.finished
    return outputs


def _find_stop_string(
    seq: Sequence, stop_strings: tuple[str, ...], previous_length: int, include: bool
) -> None:
    """Cut the text before (or after, to `include` it) the first stop string, in the list's
    order, that ends in the newest token's text (vLLM's check_stop_strings, at its first such
    occurrence). An occurrence that ended in older text, inside min_tokens, does not count.
    Called once a token, so speculation, which adds several a step, stops where plain decoding
    does."""
    for stop in stop_strings:
        start = seq.text.find(stop, max(0, previous_length - len(stop) + 1))
        if start != -1:
            seq.text = seq.text[: start + len(stop) if include else start]
            seq.finish_reason = "stop"
            seq.stop_reason = stop
            return


def _finish(seq: Sequence, reason: str, stop_reason: int | None) -> None:
    """End the sample; text held back for an incomplete character is added, less that
    character."""
    if seq.detokenizer is not None:
        seq.text += seq.detokenizer.flush()
    seq.finish_reason = reason  # type: ignore[assignment]
    seq.stop_reason = stop_reason
