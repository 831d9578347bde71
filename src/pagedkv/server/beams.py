"""`use_beam_search` on completions and chat: vLLM's beam search for a request, or the 400
that names what cannot go with it.

Beams are ranked by their logprobs alone (vLLM's `to_beam_search_params` reads n, max_tokens,
temperature, ignore_eos, include_stop_str_in_output and length_penalty), so a setting that
would reshape the sampling (penalties, stops, structured outputs, a required or named tool
call, prompt logprobs, best_of) is refused with it rather than silently ignored.
"""

from __future__ import annotations

from dataclasses import fields

from pagedkv.engine import BeamSearchParams, SamplingParams
from pagedkv.server.errors import APIError
from pagedkv.server.protocol import SamplingFields
from pagedkv.server.serving import ServingContext, sampling_setting

SAMPLING_FIELDS = [f.name for f in fields(SamplingParams) if f.init]
# What a beam search reads of a request, and what cannot change its answer.
BEAM_SEARCH_SETTINGS = frozenset(
    {
        "n",
        "max_tokens",
        "temperature",
        "ignore_eos",
        "include_stop_str_in_output",
        "logprobs",
        "seed",
        "skip_special_tokens",
        "truncate_prompt_tokens",
    }
)
# A request's fields a structured output can come from, in the order they are named.
STRUCTURED_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def beam_search_params(
    request: SamplingFields, params: SamplingParams, context: ServingContext
) -> BeamSearchParams:
    """n beams per prompt under vLLM's rule (`engine/beam_search.py`); max_tokens None runs
    to max_model_len, which the engine cuts to each prompt's room. A setting that is only
    the model's generation-config default is not the request's, so it clashes with nothing;
    the model's temperature is the beams' where the request gives none, as in vLLM."""
    defaults = context.sampling_defaults
    # A field clashes when the request set it; one it left out holds the model's default.
    left_out = {k: v for k, v in defaults.items() if k not in request.model_fields_set}
    default = SamplingParams(**left_out)
    clashing = [
        request_field(request, name)
        for name in SAMPLING_FIELDS
        if name not in BEAM_SEARCH_SETTINGS and getattr(params, name) != getattr(default, name)
    ]
    if getattr(request, "best_of", None) not in (None, request.n):
        clashing.append("best_of")
    if clashing:
        raise APIError(
            400,
            f"use_beam_search cannot be combined with {', '.join(clashing)}: beam search "
            "ranks beams by their logprobs alone",
            param=clashing[0],
        )
    try:
        return BeamSearchParams(
            beam_width=request.n,
            max_tokens=params.max_tokens or context.max_model_len,
            ignore_eos=request.ignore_eos,
            temperature=sampling_setting(request, "temperature", defaults),
            length_penalty=request.length_penalty,
            include_stop_str_in_output=request.include_stop_str_in_output,
        )
    except ValueError as error:
        raise APIError(400, str(error), param="length_penalty") from error


def request_field(request: SamplingFields, name: str) -> str:
    """The request's field behind SamplingParams field `name`, so an error names what the
    client sent: a structured output comes from one of several, or on chat from a required or
    named `tool_choice`; n from `best_of` when that asked for more samples; max_tokens from
    chat's `max_completion_tokens`; chat's logprobs count from `top_logprobs`."""
    best_of = getattr(request, "best_of", None)
    if name == "n" and best_of is not None and best_of > request.n:
        return "best_of"
    if name == "max_tokens" and getattr(request, "max_completion_tokens", None) is not None:
        return "max_completion_tokens"
    if name == "logprobs" and isinstance(getattr(request, "logprobs", None), bool):
        return "top_logprobs"
    if name != "structured_outputs":
        return name
    given = (field for field in STRUCTURED_FIELDS if getattr(request, field, None) is not None)
    fallback = "tool_choice" if getattr(request, "tools", None) else name
    return next(given, fallback)
