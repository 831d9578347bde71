"""What the completions and chat endpoints share: limits, sampling, parsing, logprobs, the
event stream (submission and reading back: `generation`)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedkv.engine import SamplingParams, StructuredOutputsParams, TruncationTooLong
from pagedkv.engine.admission import truncate
from pagedkv.engine.errors import TooManyLogprobs
from pagedkv.engine.token_bytes import TokenBytes
from pagedkv.server.adapters import ServedAdapters
from pagedkv.server.engine_loop import EngineLoop
from pagedkv.server.errors import APIError
from pagedkv.server.protocol import (
    IGNORED_FIELDS,
    NO_VALUE,
    REFUSED_FIELDS,
    SamplingFields,
    pass_over_unknown,
    unknown_fields,
)
from pagedkv.server.response_store import ResponseStore
from pagedkv.server.responses import PromptLogprob

if TYPE_CHECKING:
    from pagedkv.engine import Logprob, LoRARequest
    from pagedkv.engine.outputs import TokenLogprobs
    from pagedkv.tokenizer import Tokenizer

T = TypeVar("T")
RequestT = TypeVar("RequestT", bound=SamplingFields)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class ServingContext:
    """What every endpoint needs to know about the model being served."""

    engine_loop: EngineLoop
    tokenizer: Tokenizer
    token_bytes: TokenBytes
    model_name: str
    max_model_len: int
    vocab_size: int  # the model's: what a logprobs count of -1 asks for
    max_logprobs: int  # the engine's cap on logprobs per token (the vocabulary's size: none)
    system_fingerprint: str  # names the server build, as OpenAI's names its backend
    adapters: ServedAdapters  # the LoRA adapters served by name (none without --enable-lora)
    # SamplingParams keywords the model's generation_config.json recommends: the defaults of
    # the fields a request leaves out (vLLM's --generation-config auto).
    sampling_defaults: Mapping[str, Any]
    strict_fields: bool = False  # refuse unknown request fields instead of ignoring them
    chat_template: str | None = None  # --chat-template: replaces the model's (None: keep it)
    chat_template_content_format: str = "auto"  # vLLM's: how message content reaches it
    trust_request_chat_template: bool = False  # render a request's own chat_template (vLLM's)
    response_role: str = "assistant"  # a chat reply's role when it starts a new turn
    reasoning_parser: str | None = None  # vLLM's: chat replies' reasoning apart (reasoning.py)
    stored_responses: ResponseStore = field(default_factory=ResponseStore)  # the Responses API's

    def parse(self, body: bytes, model: type[RequestT]) -> RequestT:
        """A validated request: known fields, this model, settings that go together. A field
        that would change the output and is not implemented is a 400 naming it; one that
        cannot change it is ignored (`protocol.REFUSED_FIELDS`, `IGNORED_FIELDS`)."""
        request = parse_body(body, model)
        for name, value in (request.model_extra or {}).items():
            harmless = REFUSED_FIELDS.get(name, NO_VALUE)
            if name in REFUSED_FIELDS and value != harmless:
                raise APIError(
                    400, f"{name} is not supported (it would change the output)", param=name
                )
        unknown = [
            name for name in unknown_fields(request)
            if name not in REFUSED_FIELDS and name not in IGNORED_FIELDS
        ]  # fmt: skip
        pass_over_unknown(unknown, self.strict_fields)
        self.check_model(request.model)
        if request.stream_options is not None and not request.stream:
            raise APIError(400, "stream_options needs stream=true", param="stream_options")
        if request.prompt_logprobs is not None and request.stream:  # vLLM refuses it too
            raise APIError(400, "prompt_logprobs need stream=false", param="prompt_logprobs")
        for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
            if getattr(request, name, None) == -1:  # vLLM's: every token of the vocabulary
                if self.vocab_size > self.max_logprobs:  # refused as the engine words it
                    too_many = TooManyLogprobs(name, self.vocab_size, self.max_logprobs, True)
                    raise APIError(400, str(too_many), param=name)
                setattr(request, name, self.vocab_size)
        return request

    def check_model(self, requested: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: the base model, also for None or
        "", as vLLM serves its one model); another name is OpenAI's 404."""
        return self.adapters.request_for(requested)

    def default_max_tokens(self, prompt_len: int) -> int:
        """OpenAI's completions default of 16 tokens, cut to the room the context leaves.

        Without the cut a long prompt would be refused for a limit the client never asked
        for; a prompt with no room at all is refused by the engine (PromptTooLong).
        """
        return max(1, min(DEFAULT_COMPLETION_MAX_TOKENS, self.max_model_len - prompt_len))


def prompt_ids(
    context: ServingContext, prompts: list[str | list[int]], request: SamplingFields, **encode
) -> list[list[int]]:
    """Token ids of each prompt (text tokenized with `encode`'s options), cut to the request's
    `truncate_prompt_tokens` as the engine would cut them (so limits and usage count what runs).
    Meant for a worker thread: tokenizing a long prompt should not hold the event loop."""
    return cut_prompts(context, request, encode_prompts(context, prompts, **encode))


def encode_prompts(
    context: ServingContext, prompts: list[str | list[int]], **encode
) -> list[list[int]]:
    """Token ids of each prompt, text tokenized with `encode`'s options (a worker's job)."""
    return [context.tokenizer.encode(p, **encode) if isinstance(p, str) else p for p in prompts]


def cut_prompts(
    context: ServingContext, request: SamplingFields, ids: list[list[int]]
) -> list[list[int]]:
    """`ids` cut to the request's `truncate_prompt_tokens` as the engine would cut them."""
    if request.truncate_prompt_tokens is None:
        return ids
    keep = SamplingParams(truncate_prompt_tokens=request.truncate_prompt_tokens)
    try:
        return [truncate(prompt, keep, context.max_model_len) for prompt in ids]
    except TruncationTooLong as error:
        raise APIError(400, str(error), param="truncate_prompt_tokens") from error


def token_text(request: SamplingFields, token_id: int, text: str) -> str:
    """How a logprob entry names its token: its text, or vLLM's "token_id:N" when the request
    sets `return_tokens_as_token_ids`."""
    return f"token_id:{token_id}" if request.return_tokens_as_token_ids else text


# A request's fields a structured output can come from, in the order they are named.
STRUCTURED_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


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


def sampling_setting(request: SamplingFields, name: str, defaults: Mapping[str, Any]) -> Any:
    """A sampling field as vLLM's server resolves it: the request's value, else the model's
    generation config default (`Engine.sampling_defaults`), else the API's default."""
    if name in request.model_fields_set or name not in defaults:
        return getattr(request, name)
    return defaults[name]


def sampling_params(
    request: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    defaults: Mapping[str, Any],
    prompt_logprobs: int | None = None,
    structured: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The engine's SamplingParams (max_tokens None: all the room the context leaves), with
    `structured` the output's constraint (from response_format, structured_outputs or tools).
    Fields the request leaves out take the model's `defaults`; its max_tokens caps the one
    asked for too, as vLLM's `get_max_tokens` takes the least of them.

    The engine checks values again and its ValueErrors (naming the parameter) become 400s.
    """
    recommended = defaults.get("max_tokens")
    if recommended is not None:
        max_tokens = recommended if max_tokens is None else min(max_tokens, recommended)
    try:
        return SamplingParams(
            n=request.n,
            temperature=sampling_setting(request, "temperature", defaults),
            top_p=sampling_setting(request, "top_p", defaults),
            # OpenAI-style -1 and our 0 both mean "off"
            top_k=max(sampling_setting(request, "top_k", defaults), 0),
            min_p=sampling_setting(request, "min_p", defaults),
            repetition_penalty=sampling_setting(request, "repetition_penalty", defaults),
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
            seed=request.seed,
            logprobs=logprobs,
            prompt_logprobs=request.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            skip_special_tokens=request.skip_special_tokens,
            logit_bias=(
                None
                if request.logit_bias is None
                else {int(token): value for token, value in request.logit_bias.items()}
            ),
            allowed_token_ids=request.allowed_token_ids,
            bad_words=request.bad_words,
            include_stop_str_in_output=request.include_stop_str_in_output,
            structured_outputs=structured,
        )
    except ValueError as error:  # SamplingParams' messages start with the field at fault
        leading = re.match(r"\w+", str(error))
        field = leading[0] if leading else None
        param = request_field(request, field) if field in type(request).model_fields else None
        raise APIError(400, str(error), param=param) from error


def check_room(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, param: str
) -> None:
    """Refuse an explicit max_tokens the context cannot hold, with a 400 naming `param` (the
    field it came from), as vLLM's server does.

    The engine would stop such a request at the limit with finish_reason "length" (vLLM's
    engine does too); a client that names a number is told instead that it will not get it.
    A prompt that fills the context on its own is left to the engine, which says just that.
    """
    if max_tokens is None or num_prompt_tokens >= max_model_len:
        return
    if num_prompt_tokens + max_tokens <= max_model_len:
        return
    raise APIError(
        400,
        f"prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}: "
        f"{num_prompt_tokens + max_tokens} tokens, model allows {max_model_len} (max_model_len)",
        param=param,
        code="context_length_exceeded",
    )


def parse_body(body: bytes, model: type[T]) -> T:
    """Validate a JSON body against a protocol model; every failure is a 400 naming the field."""
    try:
        return model.model_validate_json(body)  # type: ignore[attr-defined]
    except ValidationError as error:
        first = error.errors()[0]
        if first["type"] == "json_invalid":
            raise APIError(
                400, f"malformed JSON body: {first['msg']}", code="json_invalid"
            ) from None
        loc, message = _union_error(error.errors())
        param = ".".join(str(part) for part in loc) or None
        message = message.removeprefix("Value error, ")
        raise APIError(400, f"{param}: {message}" if param else message, param=param) from None


# How pydantic names a member of a union in an error's location (`str`, `list[str]`,
# `literal['none','auto','required']`, `NamedToolChoice`): not a field of the request.
_FIELD_PART = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _is_field(part: str | int) -> bool:
    """Whether an error location's part names a field, an index or a dict key (`"5"` of
    logit_bias), rather than a union member."""
    return (
        isinstance(part, int)
        or part.isdigit()
        or (_FIELD_PART.fullmatch(part) is not None and part not in _TYPE_NAMES)
    )


def _union_error(errors: list) -> tuple[tuple, str]:
    """The first error's field path and message. Where that field is a union, pydantic lists
    one error per member (`stop.str`, `stop.list[str].0`); say what the member that got
    furthest says (`stop.0`), or, where every member failed at the top, all they wanted."""
    first = errors[0]
    tag = next((i for i, part in enumerate(first["loc"]) if not _is_field(part)), None)
    if tag is None:
        return first["loc"], first["msg"]
    members = [
        e
        for e in errors
        if e["loc"][:tag] == first["loc"][:tag]
        and len(e["loc"]) > tag
        and not _is_field(e["loc"][tag])
    ]
    deepest = max(members, key=lambda e: len(e["loc"]))
    path = tuple(part for part in deepest["loc"] if _is_field(part))
    if len(deepest["loc"]) > tag + 1:
        return path, deepest["msg"]
    wanted = dict.fromkeys(e["msg"].removeprefix("Input should be ") for e in members)
    return path, "Input should be " + ", or ".join(wanted)


def new_id(prefix: str) -> str:
    """An OpenAI-style response id."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """`created`: seconds since the epoch."""
    return int(time.time())


def shutting_down(message: str) -> APIError:
    """The 503 a draining server answers (new requests, and those it ends), in OpenAI's shape;
    the connection is closed after it, so a client's next attempt reaches a server that runs."""
    return APIError(
        503, message, type="server_error", code="shutting_down", headers={"Connection": "close"}
    )


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work` (a non-streamed response); None if the client hung up first.

    The work is cancelled then, so the caller's `finally` can abort the engine requests
    at once instead of computing an answer nobody will read.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; nobody receives it


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """A server-sent event stream that runs `on_close` however it ends.

    When the client disconnects, Starlette cancels the task sending the stream; a generator
    suspended at `yield` is then only finalised whenever it is garbage collected, so its
    `finally` cannot be trusted to abort the request. This response's own `finally` can.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream, then always run `on_close`."""
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse(data: str) -> str:
    """One server-sent event carrying `data`."""
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def top_logprobs(position: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The `k` most likely (token id, logprob) alternatives at one position (the engine adds
    the chosen token)."""
    return sorted(position.items(), key=lambda item: item[1].logprob, reverse=True)[:k]


def prompt_logprobs_json(
    entries: list[TokenLogprobs | None], k: int
) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, its own entry and the `k` most likely."""
    result: list[dict[str, PromptLogprob] | None] = []
    for position in entries:
        if position is None:
            result.append(None)
            continue
        chosen_id, chosen = next(iter(position.items()))  # the engine puts the token first
        kept = {chosen_id: chosen, **dict(top_logprobs(position, k))}
        result.append(
            {
                str(token_id): PromptLogprob(
                    logprob=entry.logprob, rank=entry.rank, decoded_token=entry.decoded_token
                )
                for token_id, entry in kept.items()
            }
        )
    return result
