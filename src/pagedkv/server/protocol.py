"""Request bodies of the OpenAI API, as pydantic models (responses: `responses`).

Requests are strict about types: wrong types are not coerced ("5" is not an int), NaN and
infinity are refused. Besides OpenAI's fields the requests accept vLLM's extensions (sampling:
`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`,
`skip_special_tokens`, ...; the older `guided_*` names of structured outputs; `return_token_ids`,
`return_tokens_as_token_ids`, `truncate_prompt_tokens`; the chat template's switches).

Every field a vLLM or OpenAI client may send that is not implemented here is on one of two
lists: `REFUSED_FIELDS` would change the output, so setting one (to anything but the value that
changes nothing) is a 400 naming it; `IGNORED_FIELDS` cannot change it, so it is ignored. A
field on neither list (unknown to both APIs) is ignored with a log line, as vLLM does, or
refused under `--strict-fields` (`unknown_fields` names them).
Range checks that need the model (prompt length, token ids) live in `serving`, next to the
engine. The parts of structured outputs and tools live in `formats`. The Responses API's
request (`ResponsesRequest`) is translated into a chat request (`responses_api`), which the
chat rules then check.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    field_validator,
    model_validator,
)

from pagedkv.server.errors import APIError
from pagedkv.server.formats import (
    NamedToolChoice,
    RequestModel,
    ResponseFormat,
    StructuredOutputsFields,
    Tool,
    ToolCall,
)

MAX_N = 128  # choices per request: each one is a sequence holding KV blocks
MAX_STOP_STRINGS = 16
MAX_PROMPTS = 1024  # prompts in one completions request (vLLM's VLLM_MAX_COMPLETION_PROMPTS)

NonNegativeInt = Annotated[int, Field(ge=0)]
logger = logging.getLogger(__name__)

# Fields of vLLM's and OpenAI's requests that would change the output and are not implemented:
# field -> the value that changes nothing (sent with that value, the field is accepted).
NO_VALUE = object()
REFUSED_FIELDS: dict[str, object] = {
    "guided_whitespace_pattern": NO_VALUE,  # vLLM: whitespace inside guided JSON
    "structural_tag": NO_VALUE,  # vLLM: tags switching structured outputs on and off
    "logits_processors": NO_VALUE,  # vLLM: user logits processors
    "vllm_xargs": NO_VALUE,  # vLLM: arguments of custom logits processors
    "early_stopping": False,  # vLLM's beam search stopping rule
    "spaces_between_special_tokens": True,  # vLLM: detokenisation of special tokens
    "documents": NO_VALUE,  # vLLM chat: documents for a RAG chat template
    "mm_processor_kwargs": NO_VALUE,  # vLLM: multimodal processing (no multimodal models)
    "prompt_embeds": NO_VALUE,  # vLLM completions: embeddings instead of tokens
    "reasoning_effort": NO_VALUE,  # OpenAI: reasoning models
    "audio": NO_VALUE,  # OpenAI: audio output
    "modalities": ["text"],  # OpenAI: output modalities
    "web_search_options": NO_VALUE,  # OpenAI: web search
    "functions": NO_VALUE,  # OpenAI's deprecated function calling (use tools)
    "function_call": NO_VALUE,
    "prediction": NO_VALUE,  # OpenAI: predicted outputs
}
# Fields that cannot change the output: accepted and ignored.
IGNORED_FIELDS = frozenset(
    {
        "metadata",  # OpenAI: tags stored with the request
        "service_tier",  # OpenAI: billing tier
        "request_id",  # vLLM: the id in logs (the response's id is the server's)
        "guided_decoding_backend",  # vLLM: which grammar library (llguidance here)
        "kv_transfer_params",  # vLLM: disaggregated prefill
        "parallel_tool_calls",  # on completions: no tools there
    }
)


def unknown_fields(request: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of the fields `request` and its nested models did not declare."""
    names = [prefix + name for name in request.model_extra or {}]
    for name in type(request).model_fields:
        value = getattr(request, name)
        items = value if isinstance(value, list) else [value]
        for index, item in enumerate(items):
            if isinstance(item, BaseModel):
                place = f"{name}.{index}" if isinstance(value, list) else name
                names += unknown_fields(item, f"{prefix}{place}.")
    return names


def pass_over_unknown(names: list[str], strict: bool) -> None:
    """Fields neither API knows: ignored with one log line, as vLLM ignores them, or, when
    `strict` (--strict-fields), a 400 naming the first."""
    if names and strict:
        raise APIError(400, f"unknown field '{names[0]}' (--strict-fields)", param=names[0])
    if names:
        logger.warning("fields ignored (not supported): %s", ", ".join(names))


class StreamOptions(RequestModel):
    """`stream_options`: whether the last chunk before [DONE] carries the usage, and (vLLM's
    `continuous_usage_stats`, with include_usage) whether every chunk carries its choice's usage
    so far: its own prompt's tokens and its tokens, as vLLM counts them."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(RequestModel):
    """Fields both endpoints share; names and ranges follow OpenAI's, then vLLM's extensions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # int64, as vLLM and OpenAI
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user tag: accepted for compatibility, unused
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None  # vLLM's
    priority: int = 0  # vLLM's: lower runs first under --scheduling-policy priority
    # vLLM's beam search: n beams per prompt, ranked by cumulative logprob over the length
    # to the power length_penalty (`beams.py`).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's: prefix-cache blocks are shared only between requests with the same salt.
    cache_salt: str | None = Field(None, min_length=1)
    # OpenAI's: token id (as a string) -> bias added to its logit, -100 to 100.
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions, passed to SamplingParams as they are.
    allowed_token_ids: list[NonNegativeInt] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    # vLLM's: each prompt token's logprob and its top k (in the response's prompt_logprobs).
    prompt_logprobs: int | None = Field(None, ge=-1)  # -1: every token (vLLM's)
    # vLLM's older names of structured outputs (one of them, or structured_outputs).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: the token ids in the response (prompt_token_ids, token_ids), and logprob tokens
    # written as "token_id:N" rather than as text.
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    # vLLM's: keep the prompt's last N tokens (-1: as many as the context holds).
    truncate_prompt_tokens: int | None = Field(None, ge=-1)

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncate(cls, keep: int | None) -> int | None:
        if keep == 0:
            raise ValueError("must be >= 1, or -1 for as many as the context holds")
        return keep

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias is None:
            return None
        for token, value in bias.items():
            if not token.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {token!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value}")
        return bias

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> list[str] | None:
        if stop is None:
            return None
        stops = [stop] if isinstance(stop, str) else stop
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`."""

    prompt: Any
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS before a text prompt
    # omitted or null: 16; 0 (with echo): the prompt scored, nothing generated
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=-1)  # -1: every token (vLLM's)
    echo: bool = False  # the prompt's text is prepended to each choice
    suffix: str | None = None  # refused in `completions`: no insertion mode
    best_of: int | None = Field(None, ge=1, le=MAX_N)  # samples per prompt; the best n return

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, prompt: Any) -> str | list[int] | list[str] | list[list[int]]:
        """One prompt (text or token ids) or a non-empty list of them."""
        if _is_single_prompt(prompt):
            return prompt
        if isinstance(prompt, list) and prompt and all(_is_single_prompt(p) for p in prompt):
            if len(prompt) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
            return prompt
        raise ValueError(
            "must be a string, a non-empty list of token ids, or a non-empty list of those"
        )

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list, one entry per prompt."""
        return [self.prompt] if _is_single_prompt(self.prompt) else list(self.prompt)


def _is_single_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    )


class TextPart(RequestModel):
    """One part of a message's content; only text parts are supported."""

    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    """One message of the conversation, rendered by the model's chat template."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool's result: the call it answers
    # An assistant turn's reasoning, as vLLM's responses carry it (`reasoning`, or its older
    # name): thinking models' templates get it as `reasoning_content`.
    reasoning: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _check_parts(cls, content: Any) -> Any:
        """Name what is wrong with a content list: a part of another kind (an image, audio)
        cannot be read by a text model, so say that rather than that a string was expected."""
        if content is None or isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise ValueError("content must be a string or a list of content parts")
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is None:
                raise ValueError('each content part must be an object with a "type"')
            if kind != "text":
                raise ValueError(
                    f"content parts of type {kind!r} are not supported: the model reads text "
                    "only (parts of type 'text')"
                )
            if not isinstance(part.get("text"), str):
                raise ValueError("a content part of type 'text' needs a string 'text'")
        return content

    @model_validator(mode="after")
    def _check_content(self) -> ChatMessage:
        """Only an assistant message may come without content (OpenAI's tool-call turns)."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        if self.thinking() is not None and self.role != "assistant":
            raise ValueError("only an assistant message carries reasoning")
        return self

    def thinking(self) -> str | None:
        """The reasoning an assistant turn carries, under either name (`reasoning` first)."""
        return self.reasoning if self.reasoning is not None else self.reasoning_content

    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def template_content(self) -> str | list[dict[str, str]] | None:
        """The content as the tokenizer takes it, parts kept: the chat template's content
        format (vLLM's `--chat-template-content-format`) decides how they are joined."""
        if isinstance(self.content, list):
            return [part.model_dump() for part in self.content]
        return self.content


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI, still widely sent
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=-1)  # -1: every token (vLLM's)
    store: bool | None = None  # OpenAI's: nothing is stored here; accepted for compatibility
    tools: list[Tool] | None = None
    # Default: "auto" with tools, "none" without (OpenAI's).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # False: at most one call (with "required")
    # vLLM's chat template switches: the assistant turn's opening, continuing the last message
    # instead (add_generation_prompt false then), variables for the template, the template
    # itself, the tokenizer's special tokens on the rendered text (the template places them).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    add_special_tokens: bool = False
    # vLLM's: the reply's content starts with the last message's, when that is the
    # assistant's (a continued message comes back whole).
    echo: bool = False
    # vLLM's, with --reasoning-parser: false leaves a thinking model's reasoning out.
    include_reasoning: bool = True

    @property
    def resolved_tool_choice(self) -> str | NamedToolChoice:
        """The tool choice, its default filled in."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens`, else the older `max_tokens`, else None (the model's room)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class TextFormat(RequestModel):
    """`text.format`: plain text, any JSON object, or a named JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(RequestModel):
    """`text`: the output's format (and OpenAI's `verbosity`, which changes nothing here)."""

    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(RequestModel):
    """`POST /v1/responses`."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    # Refused where set (they would change the output)
    background: bool = False
    truncation: Literal["disabled", "auto"] = "disabled"
    include: list[str] | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    # Taken and left: they change no output here
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)  # read only with `include`
    stream_options: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
