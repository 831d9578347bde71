"""The request and response parts of structured outputs and tools, as pydantic models.

`response_format` (OpenAI's), `structured_outputs` (vLLM's), `tools` and `tool_choice`, the
tool calls an assistant message carries, and their stream deltas. `RequestModel` is the base
of every request model (protocol's too): strict types, unknown fields kept aside.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)


class RequestModel(BaseModel):
    """Strict about types (no coercion, no NaN); unknown fields kept in `model_extra`.

    An explicit null is an omitted field unless the field itself takes null: OpenAI's and
    vLLM's servers read `"temperature": null` as the default, and clients send null for every
    setting a caller left as None.
    """

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_omitted(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            name: value
            for name, value in data.items()
            if value is not None or (name in fields and fields[name].default is None)
        }


class JsonSchemaFormat(RequestModel):
    """`response_format.json_schema`: the schema the output must match, and its name."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")  # "schema" is pydantic's
    strict: bool | None = None  # OpenAI's: every schema is enforced here, strict or not


class ResponseFormat(RequestModel):
    """`response_format`: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object")
        return self


class StructuredOutputsFields(RequestModel):
    """vLLM's `structured_outputs` extra field: exactly one constraint (checked by the engine's
    StructuredOutputsParams)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)


class FunctionCall(RequestModel):
    """The function a tool call names, and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str


class ToolCall(RequestModel):
    """One tool call: in an assistant message sent back, or in a response."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(RequestModel):
    """A function the model may call: its name and the JSON schema of its arguments."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(RequestModel):
    """One entry of `tools`."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call that function."""

    type: Literal["function"]
    function: NamedFunction


class FunctionCallDelta(BaseModel):
    """A tool call's function in a stream chunk: its name once, then arguments text."""

    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _only_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {name: value for name, value in handler(self).items() if value is not None}


class ToolCallDelta(BaseModel):
    """One tool call's part of a stream chunk (OpenAI's: id and type come with the first)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta

    @model_serializer(mode="wrap")
    def _only_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {name: value for name, value in handler(self).items() if value is not None}
