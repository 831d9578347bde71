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
from pagedkv.server.serving import ServingContext, request_field, sampling_setting

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
