"""`POST /v1/completions`: text (or token-id) prompts in, OpenAI completion objects out.

Everything that can be refused is refused before the first byte of a stream is sent (model
name, prompt length, sampling values, engine rejection, overload), so those failures are
plain 4xx/503 responses rather than errors buried in an event stream.
"""

from __future__ import annotations

import asyncio
import codecs
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from pagedkv.server.beams import beam_search_params
from pagedkv.server.choices import ChoiceAssembler, ChoiceState
from pagedkv.server.errors import APIError
from pagedkv.server.generation import ChoiceDelta, Generation
from pagedkv.server.protocol import CompletionRequest
from pagedkv.server.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
)
from pagedkv.server.serving import (
    ServingContext,
    cut_prompts,
    encode_prompts,
    new_id,
    sampling_params,
    sse,
    token_text,
    top_logprobs,
)
from pagedkv.server.structured import structured_outputs

if TYPE_CHECKING:
    from pagedkv.engine import CompletionOutput
    from pagedkv.engine.outputs import TokenLogprobs


async def create_completion(context: ServingContext, raw: Request) -> Response:
    """Validate, submit, then stream or collect the completion."""
    request = context.parse(await raw.body(), CompletionRequest)
    _check_unsupported(request)
    encoded = await asyncio.to_thread(
        encode_prompts, context, request.prompts(), add_special_tokens=request.add_special_tokens
    )
    prompts = cut_prompts(context, request, encoded)
    # vLLM's rule: omitted or null is OpenAI's 16 (cut to the room the context leaves).
    # max_tokens 0 (echo only) scores the prompt: the engine must sample one token, which
    # every delta then leaves out (vLLM's echo without generation).
    echo_only = request.max_tokens == 0
    max_tokens = 1 if echo_only else request.max_tokens
    if max_tokens is None:
        max_tokens = context.default_max_tokens(max(len(prompt) for prompt in prompts))
    prompt_logprobs = request.prompt_logprobs
    if request.echo and request.logprobs is not None:  # the echoed prompt's tokens get theirs
        prompt_logprobs = max(prompt_logprobs or 0, request.logprobs)
    params = sampling_params(
        request,
        max_tokens,
        request.logprobs,
        context.sampling_defaults,
        prompt_logprobs,
        structured_outputs(request),
    )
    beams = beam_search_params(request, params, context) if request.use_beam_search else None
    best_of = request.best_of or request.n
    if best_of > request.n:  # every sample's cumulative logprob is needed to rank them
        params = replace(params, n=best_of, logprobs=params.logprobs or 0)
    lora = context.check_model(request.model)
    generation = Generation(
        context.engine_loop, new_id("cmpl"), best_of, lora, prompt_only=echo_only
    )
    await generation.start(prompts, params, request, beams, request.max_tokens)
    completion = _Completion(context, request, generation)
    if request.echo:
        # The prompt that ran: a token-id prompt, or a text prompt truncate_prompt_tokens cut,
        # echoes as its ids decoded (vLLM's `tokenizer.decode(ids)`, special tokens too); any
        # other text prompt as given.
        given = request.prompts()
        completion.echoed_ids = [
            not isinstance(text, str) or len(ran) < len(whole)
            for text, ran, whole in zip(given, prompts, encoded, strict=True)
        ]
        completion.echoed = [
            context.tokenizer.decode(ran, skip_special_tokens=False) if as_ids else text
            for text, ran, as_ids in zip(given, prompts, completion.echoed_ids, strict=True)
        ]
    return await completion.respond(raw)


def _check_unsupported(request: CompletionRequest) -> None:
    """Refuse, naming the field, what vLLM accepts but this server cannot do."""
    if request.suffix is not None:
        raise APIError(400, "suffix is not supported (no insertion mode)", param="suffix")
    if request.use_beam_search and request.echo and request.logprobs is not None:
        raise APIError(
            400,
            "use_beam_search cannot be combined with echo and logprobs together: a beam search "
            "scores no prompt tokens (echo alone, or logprobs alone, works with it)",
            param="echo",
        )
    if request.max_tokens == 0 and not request.echo:
        raise APIError(
            400,
            "max_tokens must be at least 1 (0 is for echo=true: the prompt scored, no tokens)",
            param="max_tokens",
        )
    if request.max_tokens == 0 and request.min_tokens > 0:
        raise APIError(
            400,
            f"min_tokens ({request.min_tokens}) must be at most max_tokens (0)",
            param="min_tokens",
        )
    best_of = request.best_of or request.n
    if best_of < request.n:
        raise APIError(
            400, f"best_of ({best_of}) must be at least n ({request.n})", param="best_of"
        )
    if best_of > request.n and request.stream:
        raise APIError(
            400,
            f"best_of ({best_of}) above n ({request.n}) cannot stream: the best samples are "
            "known only once all have finished",
            param="best_of",
        )


@dataclass
class _Choice(ChoiceState):
    """One completion choice: its text, plus the legacy logprobs lists (if requested)."""

    logprobs: CompletionLogprobs | None = None
    text_offset: int = 0  # characters decoded so far from the tokens' bytes
    cumulative_logprob: float = 0.0  # ranks the samples under best_of
    utf8: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace")
    )

    def characters_begun(self) -> int:
        """Characters of the text that begin before the next token: the ones decoded, plus
        the one whose first bytes wait in the decoder (completed or replaced by U+FFFD, they
        always make one character)."""
        pending, _ = self.utf8.getstate()
        return self.text_offset + (1 if pending else 0)

    def fold(self, output: CompletionOutput) -> None:
        """Fold the delta in; keep the sample's cumulative logprob (set when computed)."""
        super().fold(output)
        if output.cumulative_logprob is not None:
            self.cumulative_logprob = output.cumulative_logprob


class _Completion(
    ChoiceAssembler[CompletionRequest, _Choice, CompletionLogprobs | None, CompletionChoice]
):
    """Turns a Generation's deltas into completion objects or stream chunks."""

    choice_type = _Choice
    echoed: list[str] | None = None  # with `echo`: each prompt's text, prepended to its choices
    echoed_ids: list[bool] | None = None  # per prompt: echoed as its ids decoded (specials too)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.echo_sent: set[int] = set()  # choices whose stream already carried the prompt

    @property
    def _echo_logprobs(self) -> bool:
        """Echo with logprobs: the prompt's tokens come first in each choice's logprobs, so
        a stream sends the prompt with its first tokens, once the prompt is scored."""
        return self.echoed is not None and self.request.logprobs is not None

    def _update(self, delta: ChoiceDelta) -> CompletionLogprobs | None:
        """With echo and logprobs, fold the prompt's logprobs into the choice ahead of its
        first tokens'."""
        choice = self.choices.setdefault(delta.index, self.choice_type(delta.index))
        if not self._echo_logprobs or choice.logprobs is not None:
            return super()._update(delta)
        self._keep_prompt(delta)  # this delta, the choice's first, brings them
        entries = self.prompt_entries[delta.index // self.generation.n]
        prompt = self._legacy_logprobs(choice, entries, prompt=True)
        tokens = super()._update(delta)
        assert tokens is not None
        assert tokens is not None
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(prompt, name).extend(getattr(tokens, name))
        return prompt

    def _opening(self) -> list[str]:
        """With `echo`, each choice's stream starts with a chunk of its prompt's text (and
        with continuous usage, its usage: no tokens yet); with logprobs too, the text comes
        with the choice's first tokens instead."""
        if self.echoed is None or self._echo_logprobs:
            return []
        n = self.request.n
        return [
            self._chunk(
                [CompletionChoice(index=index, text=self.echoed[index // n])],
                usage=self._choice_usage(index) if self._usage_in_every_chunk else None,
            )
            for index in range(len(self.echoed) * n)
        ]

    def _logprobs(self, choice: _Choice, output: CompletionOutput) -> CompletionLogprobs | None:
        if self.request.logprobs is None:
            return None
        return self._legacy_logprobs(choice, list(output.logprobs or []))

    def _legacy_logprobs(
        self, choice: _Choice, positions: list[TokenLogprobs | None], prompt: bool = False
    ) -> CompletionLogprobs:
        """Positions in the legacy shape, also added to `choice`. Each position's own token is
        its first entry, and in its `top_logprobs` whatever k (vLLM's and OpenAI's k or k + 1
        entries); a prompt's first token (None) has no logprob, only its text. Offsets count
        a token's characters where the text holds it (`_shows`)."""
        k = self.request.logprobs or 0
        prompt_index = choice.index // self.generation.n
        logprobs = CompletionLogprobs()
        for position in positions:
            if position is None:  # the prompt's first token: nothing predicts it
                token_id = self.prompt_ids[prompt_index][0]
                shown = self._shows(choice, token_id, prompt)
                text = self.context.tokenizer.decode([token_id], skip_special_tokens=not shown)
                chosen_logprob, top = None, None
            else:
                token_id, chosen = next(iter(position.items()))
                shown = self._shows(choice, token_id, prompt)
                text = token_text(self.request, token_id, chosen.decoded_token)
                chosen_logprob, top = chosen.logprob, {text: chosen.logprob}
                for alt_id, alt in top_logprobs(position, k):  # most likely first: shared text
                    top.setdefault(token_text(self.request, alt_id, alt.decoded_token), alt.logprob)
            logprobs.tokens.append(text)
            logprobs.token_logprobs.append(chosen_logprob)
            logprobs.top_logprobs.append(top)
            logprobs.text_offset.append(choice.characters_begun())
            added = self.context.token_bytes(token_id) if shown else b""
            choice.text_offset += len(choice.utf8.decode(added))
        if choice.logprobs is None:
            choice.logprobs = CompletionLogprobs()
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(choice.logprobs, name).extend(getattr(logprobs, name))
        return logprobs

    def _chunk_choice(
        self, delta: ChoiceDelta, logprobs: CompletionLogprobs | None
    ) -> CompletionChoice:
        output = delta.output
        text = output.text
        if self._echo_logprobs and delta.index not in self.echo_sent:
            self.echo_sent.add(delta.index)
            text = self._echo(delta.index) + text
        prompt_token_ids, token_ids = self._stream_token_ids(delta)
        return CompletionChoice(
            index=delta.index,
            text=text,
            logprobs=logprobs,
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
            prompt_token_ids=prompt_token_ids,
            token_ids=token_ids,
        )

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        return sse(self._object(choices, usage).model_dump_json())

    def _response(self, choices: list[_Choice]) -> CompletionResponse:
        samples = self.generation.n
        return self._object(
            [
                CompletionChoice(
                    index=index,
                    text=self._echo(index) + "".join(choice.text),
                    logprobs=choice.logprobs,
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                    prompt_logprobs=self._prompt_logprobs(choice.index // self.generation.n),
                    prompt_token_ids=self._ids(self.generation.prompts[choice.index // samples]),
                    token_ids=self._ids(choice.token_ids),
                )
                for index, choice in enumerate(self._best(choices))
            ],
            usage=self.generation.usage(),
        )

    def _ids(self, token_ids: list[int]) -> list[int] | None:
        """Token ids for the response, when the request set return_token_ids."""
        return list(token_ids) if self.request.return_token_ids else None

    def _best(self, choices: list[_Choice]) -> list[_Choice]:
        """Each prompt's n samples of highest cumulative logprob (all of them without best_of),
        best first; the usage still counts every sample, as OpenAI bills them."""
        n, samples = self.request.n, self.generation.n
        if samples == n:
            return choices
        best = []
        for start in range(0, len(choices), samples):
            ranked = sorted(
                choices[start : start + samples], key=lambda c: c.cumulative_logprob, reverse=True
            )
            best += ranked[:n]
        return best

    def _object(
        self, choices: list[CompletionChoice], usage: Usage | None = None
    ) -> CompletionResponse:
        return CompletionResponse(
            id=self.generation.request_id,
            created=self.created,
            model=self.generation.served_name(self.context.model_name),
            system_fingerprint=self.context.system_fingerprint,
            choices=choices,
            usage=usage,
        )

    def _echo(self, index: int) -> str:
        return "" if self.echoed is None else self.echoed[index // self.request.n]

    def _shows(self, choice: _Choice, token_id: int, prompt: bool) -> bool:
        """Whether the choice's text holds this token's text at the current offset. Only a
        special token may be left out: from the output under `skip_special_tokens`; from an
        echoed text prompt where the text as given does not hold it (the BOS the tokenizer
        added); an echo of ids shows them all."""
        if token_id not in self.context.token_bytes.special_ids:
            return True
        if not prompt:
            return not self.request.skip_special_tokens
        assert self.echoed is not None and self.echoed_ids is not None
        prompt_index = choice.index // self.generation.n
        special = self.context.token_bytes(token_id).decode("utf-8", "replace")
        return self.echoed_ids[prompt_index] or self.echoed[prompt_index].startswith(
            special, choice.text_offset
        )
