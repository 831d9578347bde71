"""A request's `response_format` or vLLM's `structured_outputs` field, as the engine's
StructuredOutputsParams (None when the output is free text).

`json_object` is any JSON object; `json_schema` is its schema, enforced whether or not the
client says `strict` (OpenAI enforces only strict ones; a constraint kept is never worse).
Asking for both fields at once is refused: they would be two constraints on one output.
"""

from __future__ import annotations

from pagedkv.engine import StructuredOutputsParams
from pagedkv.server.errors import APIError
from pagedkv.server.protocol import SamplingFields


def structured_outputs(request: SamplingFields) -> StructuredOutputsParams | None:
    """The constraint the request's fields ask for; a 400 naming the field if it is malformed."""
    response_format = request.response_format
    wanted = response_format is not None and response_format.type != "text"
    fields = request.structured_outputs
    if wanted and fields is not None:
        raise APIError(
            400,
            "set response_format or structured_outputs, not both",
            param="structured_outputs",
        )
    try:
        if fields is not None:
            return StructuredOutputsParams(
                json=fields.json_,
                regex=fields.regex,
                choice=fields.choice,
                grammar=fields.grammar,
                json_object=fields.json_object,
            )
        if not wanted:
            return None
        assert response_format is not None
        if response_format.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        assert response_format.json_schema is not None
        schema = response_format.json_schema.json_schema
        return StructuredOutputsParams(json=schema if schema is not None else {})
    except ValueError as error:
        param = "structured_outputs" if fields is not None else "response_format"
        raise APIError(400, str(error), param=param) from error
