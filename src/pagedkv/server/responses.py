"""Response bodies of the OpenAI API, as pydantic models: plain models, serialised with
OpenAI's field names and nulls (vLLM's `return_token_ids` fields only when asked for)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    PlainSerializer,
    SerializerFunctionWrapHandler,
    model_serializer,
)

from pagedkv.server.formats import ToolCall, ToolCallDelta

MIN_LOGPROB = -9999.0
# A logprob as JSON carries it: JSON has no -inf (a token a grammar forbids has it), so it is
# written as vLLM writes it, -9999.0.
Logprob = Annotated[float, PlainSerializer(lambda value: max(value, MIN_LOGPROB))]


class WithTokenIds(BaseModel):
    """A response part that carries vLLM's `return_token_ids` fields only when asked for them
    (left out otherwise, as vLLM leaves them)."""

    @model_serializer(mode="wrap")
    def _without_unasked_ids(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        fields = handler(self)
        for name in ("prompt_token_ids", "token_ids"):
            if name in fields and fields[name] is None:
                del fields[name]
        return fields


class ErrorInfo(BaseModel):
    """The body of OpenAI's `{"error": ...}`."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """`{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    """Prompt tokens read from the prefix cache instead of being computed."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """Token counts of a whole request (all prompts, all choices), or of one streamed choice
    so far (vLLM's `continuous_usage_stats`, without details)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Logprob | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, Logprob] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token's entry in vLLM's `prompt_logprobs` (keyed by token id, as a string)."""

    logprob: Logprob
    rank: int
    decoded_token: str


# vLLM's shape: one dict per prompt token (None for the first: nothing predicts it).
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(WithTokenIds):
    """One choice of a completion, or one choice's delta in a stream chunk. With vLLM's
    `return_token_ids`: its prompt's token ids (in a stream, on the choice's first chunk) and
    its output's (the chunk's own in a stream)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    """A completion, or (with `usage` usually None) one chunk of a streamed one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    """One alternative token and its log probability."""

    token: str
    logprob: Logprob
    bytes: list[int]


class TokenLogprob(TopLogprob):
    """A generated token, its log probability and the most likely alternatives."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """Chat logprobs: one entry per generated token."""

    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    """The generated message of one chat choice: text, or tool calls (content then None,
    unless the model wrote text before them). Without calls `tool_calls` is left out, as
    vLLM leaves it (clients read None). With a reasoning parser, a thinking model's reasoning
    is `reasoning` and, for clients of vLLM before 0.16, `reasoning_content` too; both are
    left out where there is none."""

    role: str = "assistant"  # the server's --response-role, or a continued message's own
    content: str | None
    tool_calls: list[ToolCall] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _without_empty_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        fields = handler(self)
        for name in ("tool_calls", "reasoning", "reasoning_content"):
            if fields.get(name) in (None, []):
                fields.pop(name, None)
        return fields


class ChatChoice(WithTokenIds):
    """One choice of a chat completion (`token_ids`: vLLM's `return_token_ids`)."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(WithTokenIds):
    """A whole chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class ChatDelta(BaseModel):
    """What one stream chunk adds to a choice's message: only the fields it sets are sent."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning: str | None = None  # with a reasoning parser (AssistantMessage's fields)
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _only_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {name: value for name, value in handler(self).items() if value is not None}


class ChatChunkChoice(WithTokenIds):
    """One choice's part of a chat stream chunk."""

    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(WithTokenIds):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class ModelCard(BaseModel):
    """One entry of `GET /v1/models`."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedkv"
    max_model_len: int
    root: str | None = None  # the model or LoRA adapter as given (a path or a Hub name)
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    """`GET /v1/models`: the model this server runs, then its LoRA adapters."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
