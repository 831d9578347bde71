"""A request's `response_format`, vLLM's `structured_outputs` field or its older `guided_*`
fields, as the engine's StructuredOutputsParams (None when the output is free text).

`json_object` is any JSON object; `json_schema` is its schema, enforced whether or not the
client says `strict` (OpenAI enforces only strict ones; a constraint kept is never worse).
`guided_json`, `guided_regex`, `guided_choice` and `guided_grammar` are `structured_outputs`'
json, regex, choice and grammar under vLLM's older names. Asking for more than one at once is
refused: they would be several constraints on one output.
"""

from __future__ import annotations

from pagedkv.engine import StructuredOutputsParams
from pagedkv.server.errors import APIError
from pagedkv.server.protocol import SamplingFields

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")  # vLLM's older


def structured_outputs(request: SamplingFields) -> StructuredOutputsParams | None:
    """The constraint the request's fields ask for; a 400 naming the field if it is malformed."""
    asked = constraint_fields(request)
    if len(asked) > 1:
        raise APIError(400, f"set one of {', '.join(asked)}, not several", param=asked[-1])
    if not asked:
        return None
    [name] = asked
    try:
        if name in GUIDED_FIELDS:
            value = getattr(request, name)
            return StructuredOutputsParams(**{name.removeprefix("guided_"): value})
        if name == "structured_outputs":
            fields = request.structured_outputs
            declared = type(fields).model_fields  # (unknown sub-fields were logged)
            return StructuredOutputsParams(
                **{field.alias or key: getattr(fields, key) for key, field in declared.items()}
            )
        response_format = request.response_format
        assert response_format is not None
        if response_format.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        assert response_format.json_schema is not None
        schema = response_format.json_schema.json_schema
        return StructuredOutputsParams(json=schema if schema is not None else {})
    except ValueError as error:
        raise APIError(400, str(error), param=name) from error


def constraint_fields(request: SamplingFields) -> list[str]:
    """The fields of the request that ask for structured outputs (one, unless it errs)."""
    response_format = request.response_format
    named = [
        name
        for name, given in (
            ("response_format", response_format is not None and response_format.type != "text"),
            ("structured_outputs", request.structured_outputs is not None),
        )
        if given
    ]
    return named + [name for name in GUIDED_FIELDS if getattr(request, name) is not None]
