"""`POST /v1/chat/completions`: a conversation rendered by the model's chat template.

As for completions, every refusal happens before a stream starts. A streamed choice begins
with a role-only delta and ends with a chunk carrying its finish reason, as OpenAI's does.
With tools (`tools.py`), a choice whose output holds tool calls carries them in `tool_calls`
(streamed as deltas), with finish_reason "tool_calls" under "auto" or "required" and "stop"
under a named function, as OpenAI's and vLLM's say.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from pagedkv.model.errors import ChatTemplateError
from pagedkv.server.beams import beam_search_params
from pagedkv.server.choices import ChoiceAssembler, ChoiceState
from pagedkv.server.errors import APIError
from pagedkv.server.formats import NamedToolChoice
from pagedkv.server.generation import ChoiceDelta, Generation
from pagedkv.server.protocol import ChatCompletionRequest
from pagedkv.server.reasoning import ReasoningSplitter, split_reasoning, thinking_prompt
from pagedkv.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from pagedkv.server.serving import (
    ServingContext,
    new_id,
    prompt_ids,
    sampling_params,
    sse,
    token_text,
    top_logprobs,
)
from pagedkv.server.structured import constraint_fields, structured_outputs
from pagedkv.server.tools import (
    ToolCallStream,
    parse_output,
    render_messages,
    tool_constraint,
)
from pagedkv.tokenizer import InvalidText

if TYPE_CHECKING:
    from pagedkv.engine import CompletionOutput


async def create_chat_completion(context: ServingContext, raw: Request) -> Response:
    """Validate, render the conversation, submit, then stream or collect."""
    request = context.parse(await raw.body(), ChatCompletionRequest)
    completion = await start_chat(context, request)
    return await completion.respond(raw)


async def start_chat(context: ServingContext, request: ChatCompletionRequest) -> ChatCompletion:
    """A parsed request checked, its conversation rendered and its generation started: what
    is left is to collect or stream it (the Responses API does so in its own shape)."""
    if request.resolved_tool_choice != "none":
        # As vLLM's tool parsers ask: some checkpoints make <tool_call> a special token, and
        # skipping special tokens would hide the calls from the parser.
        request = request.model_copy(update={"skip_special_tokens": False})
    if request.top_logprobs is not None and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    constraint = structured_outputs(request)
    tool_schema = tool_constraint(request)
    if constraint is not None and tool_schema is not None:
        raise APIError(
            400,
            "a required or named tool_choice fixes the output to a tool call: "
            "it cannot also follow response_format or structured_outputs",
            param="tool_choice",
        )
    text, prompt = await asyncio.to_thread(render_conversation, context, request)
    if not prompt:  # /tokenize answers it (no tokens); a completion needs a prompt
        raise APIError(
            400, "the chat template rendered the conversation as no tokens",
            param=_template_field(request),
        )  # fmt: skip
    thinking = None
    if context.reasoning_parser is not None:
        thinking = await asyncio.to_thread(opens_think_block, context, request, text)
        if thinking and (constraint or tool_schema) is not None:
            raise APIError(
                400,
                "the prompt opens a think block, and structured outputs or a required tool "
                "call would hold the reasoning to them: the reply would have no content (turn "
                "thinking off, e.g. chat_template_kwargs enable_thinking: false)",
                param=constraint_fields(request)[0] if constraint is not None else "tool_choice",
            )
    max_tokens = request.requested_max_tokens()  # None: the room the context leaves
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    params = sampling_params(
        request,
        max_tokens,
        logprobs,
        context.sampling_defaults,
        structured=constraint or tool_schema,
    )
    beams = beam_search_params(request, params, context) if request.use_beam_search else None
    lora = context.check_model(request.model)
    generation = Generation(context.engine_loop, new_id("chatcmpl"), request.n, lora)
    await generation.start([prompt], params, request, beams, max_tokens)
    completion = ChatCompletion(context, request, generation)
    completion.thinking = thinking
    last = request.messages[-1]
    if request.echo and last.role == completion.role:  # vLLM's: a message of the reply's role
        completion.echoed = last.text()
    return completion


def render_conversation(
    context: ServingContext, request: ChatCompletionRequest
) -> tuple[str, list[int]]:
    """The text and token ids of the conversation (and tools) plus the assistant's generation
    prompt, as the request's template switches say (vLLM's `add_generation_prompt`,
    `continue_final_message`, `chat_template`, `chat_template_kwargs`, `add_special_tokens`),
    the ids cut to `truncate_prompt_tokens`. The template is the request's, else the server's
    `--chat-template`, else the model's."""
    text = _rendered(context, request, request.add_generation_prompt)
    try:
        [ids] = prompt_ids(context, [text], request, add_special_tokens=request.add_special_tokens)
    except InvalidText as error:  # e.g. a lone surrogate a template's `tojson` let through
        field = _template_field(request)
        raise APIError(400, f"the rendered conversation: {error}", param=field) from error
    return text, ids


def opens_think_block(context: ServingContext, request: ChatCompletionRequest, text: str) -> bool:
    """Whether the reply starts inside a think block: what the template adds after the
    conversation (the generation prompt, DeepSeek-R1's ending in `<think>`), or the assistant
    message being continued, leaves one open. `text` is the rendered prompt
    (`render_conversation`). The conversation itself never counts: a user asking about
    `<think>` tags opens nothing."""
    if request.continue_final_message:
        return thinking_prompt(request.messages[-1].text())
    if not request.add_generation_prompt:
        return False
    conversation = _rendered(context, request, add_generation_prompt=False)
    return thinking_prompt(text[len(os.path.commonprefix([text, conversation])) :])


def _rendered(
    context: ServingContext, request: ChatCompletionRequest, add_generation_prompt: bool
) -> str:
    """The conversation's text by the chat template, with or without the generation prompt."""
    tokenizer = context.tokenizer
    kwargs = dict(request.chat_template_kwargs or {})
    given = kwargs.pop("chat_template", None)
    if given is not None and not isinstance(given, str):
        message = "chat_template_kwargs' chat_template must be a string"
        raise APIError(400, message, param="chat_template_kwargs")
    own = given if given is not None else request.chat_template  # vLLM's: the kwarg wins
    if own is not None and not context.trust_request_chat_template:
        raise APIError(
            400,
            "a chat template was given with the request, and this server renders only its "
            "own: a template is a program the server runs (start it with "
            "--trust-request-chat-template to allow them, as vLLM's)",
            param=_template_field(request),
        )
    chat_template = own or context.chat_template
    messages, variables = render_messages(request, chat_template or tokenizer.chat_template)
    try:
        return tokenizer.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template=chat_template,
            template_kwargs={**kwargs, **variables},
            content_format=context.chat_template_content_format,
        )
    except ChatTemplateError as error:
        raise APIError(400, str(error), param=_template_field(request)) from error
    except ValueError as error:  # the two switches asked together
        raise APIError(400, str(error), param="continue_final_message") from error


def _template_field(request: ChatCompletionRequest) -> str:
    """The field a rendering error is blamed on: the request's own template where it brought
    one (its program failed, or it rendered text the tokenizer refuses), else `messages`."""
    if (request.chat_template_kwargs or {}).get("chat_template") is not None:
        return "chat_template_kwargs"
    return "chat_template" if request.chat_template is not None else "messages"


@dataclass
class _Choice(ChoiceState):
    """One chat choice: its message text, plus its token logprobs (if requested) and, when
    streamed with tools, what of it has gone out as content and tool calls."""

    logprobs: list[TokenLogprob] = field(default_factory=list)
    tool_stream: ToolCallStream | None = None
    reasoning: ReasoningSplitter | None = None  # streamed with a reasoning parser


class ChatCompletion(
    ChoiceAssembler[ChatCompletionRequest, _Choice, list[TokenLogprob], ChatChunkChoice]
):
    """Turns a Generation's deltas into a chat completion or stream chunks."""

    choice_type = _Choice
    echoed = ""  # with vLLM's `echo`: the last (assistant) message, leading each reply
    thinking: bool | None = None  # with a reasoning parser: whether the prompt opens a block

    @property
    def role(self) -> str:
        """The reply's role, as vLLM's: the server's `--response-role` for a new turn, the
        last message's own when the reply continues it (no generation prompt)."""
        if self.request.add_generation_prompt:
            return self.context.response_role
        return self.request.messages[-1].role

    def _opening(self) -> list[str]:
        """A role-only delta per choice, as OpenAI's streams begin (with `echo`, the last
        message's content in it); with return_token_ids the first also carries the prompt's
        token ids, and with continuous usage each its usage (no tokens yet), as vLLM's do."""
        prompt_ids = self.generation.prompts[0] if self.request.return_token_ids else None
        return [
            self._chunk(
                [
                    ChatChunkChoice(
                        index=index, delta=ChatDelta(role=self.role, content=self.echoed)
                    )
                ],
                usage=self._choice_usage(index) if self._usage_in_every_chunk else None,
                prompt_token_ids=prompt_ids if index == 0 else None,
            )
            for index in range(self.request.n)
        ]

    def _logprobs(self, choice: _Choice, output: CompletionOutput) -> list[TokenLogprob]:
        if not self.request.logprobs:
            return []
        k = self.request.top_logprobs or 0
        token_bytes = self.context.token_bytes
        entries = []
        for token_id, position in zip(output.token_ids, output.logprobs or [], strict=True):
            chosen = position[token_id]
            top = [
                TopLogprob(
                    token=token_text(self.request, alt_id, alt.decoded_token),
                    logprob=alt.logprob,
                    bytes=list(token_bytes(alt_id)),
                )
                for alt_id, alt in top_logprobs(position, k)
            ]
            entries.append(
                TokenLogprob(
                    token=token_text(self.request, token_id, chosen.decoded_token),
                    logprob=chosen.logprob,
                    bytes=list(token_bytes(token_id)),
                    top_logprobs=top,
                )
            )
        choice.logprobs.extend(entries)
        return entries

    def _chunk_choice(
        self, delta: ChoiceDelta, logprobs: list[TokenLogprob]
    ) -> ChatChunkChoice | None:
        output = delta.output
        finish_reason = output.finish_reason
        choice = self.choices[delta.index]
        reasoning, text = "", output.text
        if self.thinking is not None:
            if choice.reasoning is None:
                choice.reasoning = ReasoningSplitter(self.thinking)
            reasoning, text = choice.reasoning.feed(text, finish_reason is not None)
            reasoning = reasoning if self.request.include_reasoning else ""
        message = self._delta(reasoning, content=text)
        if self._uses_tools:
            if choice.tool_stream is None:
                choice.tool_stream = ToolCallStream(self.request)
            content, calls = choice.tool_stream.feed(text, finish_reason is not None)
            message = self._delta(reasoning, content=content, tool_calls=calls or None)
            finish_reason = self._finish_reason(finish_reason, choice.tool_stream.called)
        said = message.content or message.tool_calls or reasoning or finish_reason
        if self._holding and not (said or self.request.logprobs or self.request.return_token_ids):
            return None  # text held back until it is known to be what it is
        return ChatChunkChoice(
            index=delta.index,
            delta=message,
            logprobs=ChatLogprobs(content=logprobs) if self.request.logprobs else None,
            finish_reason=finish_reason,
            stop_reason=output.stop_reason,
            token_ids=list(output.token_ids) if self.request.return_token_ids else None,
        )

    @staticmethod
    def _delta(reasoning: str, **fields: object) -> ChatDelta:
        """A chunk's delta: `fields`, and a piece of reasoning under both its names (then
        without an empty content, as vLLM's)."""
        if reasoning:
            fields.update(reasoning=reasoning, reasoning_content=reasoning)
            fields["content"] = fields.get("content") or None
        return ChatDelta.model_validate(fields)

    @property
    def _holding(self) -> bool:
        """Whether a delta's text may be held back: by the tool-call or reasoning parser."""
        return self._uses_tools or self.thinking is not None

    @property
    def _uses_tools(self) -> bool:
        """Whether outputs are read for tool calls (tools given, tool_choice not "none")."""
        return self.request.resolved_tool_choice != "none"

    def _message(self, choice: _Choice) -> tuple[AssistantMessage, str | None]:
        """A finished choice's message, and its finish reason ("tool_calls" if it called).
        Only the output is read for calls; an echoed message leads the content (vLLM's)."""
        text: str | None = "".join(choice.text)
        reasoning = None
        if self.thinking is not None:  # content None where nothing follows the reasoning
            reasoning, text = split_reasoning(text or "", self.thinking)
            reasoning = reasoning if self.request.include_reasoning else None
        thought = {"reasoning": reasoning, "reasoning_content": reasoning}
        if not self._uses_tools:
            message = AssistantMessage(role=self.role, content=self._echoed(text), **thought)
            return message, choice.finish_reason
        parsed = parse_output(self.request, text or "")
        content = self._echoed(None if text is None else parsed.content)  # None: all reasoning
        message = AssistantMessage(
            role=self.role, content=content, tool_calls=parsed.tool_calls or None, **thought
        )
        return message, self._finish_reason(choice.finish_reason, bool(parsed.tool_calls))

    def _echoed(self, content: str | None) -> str | None:
        """A reply's content, led by the echoed message (vLLM's `echo`) when there is one."""
        return self.echoed + (content or "") if self.echoed else content

    def _finish_reason(self, reason: str | None, called: bool) -> str | None:
        """ "tool_calls" for an output that ended by itself with calls it chose to make
        ("auto" or "required"); a named function's call ends as any output does."""
        named = isinstance(self.request.resolved_tool_choice, NamedToolChoice)
        return "tool_calls" if called and reason == "stop" and not named else reason

    def _chunk(
        self,
        choices: list[ChatChunkChoice],
        usage: Usage | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> str:
        chunk = ChatCompletionChunk(
            id=self.generation.request_id,
            created=self.created,
            model=self.generation.served_name(self.context.model_name),
            system_fingerprint=self.context.system_fingerprint,
            choices=choices,
            usage=usage,
            prompt_token_ids=prompt_token_ids,
        )
        # Every choice says `finish_reason: null` and `logprobs: null` until it has them, as
        # OpenAI's chunks do; the usage appears only in the chunk that carries it.
        return sse(chunk.model_dump_json(exclude=None if usage is not None else {"usage"}))

    def _response(self, choices: list[_Choice]) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=self.generation.request_id,
            created=self.created,
            model=self.generation.served_name(self.context.model_name),
            system_fingerprint=self.context.system_fingerprint,
            choices=[
                ChatChoice(
                    index=choice.index,
                    message=message,
                    logprobs=ChatLogprobs(content=choice.logprobs)
                    if self.request.logprobs
                    else None,
                    finish_reason=finish_reason,
                    stop_reason=choice.stop_reason,
                    token_ids=list(choice.token_ids) if self.request.return_token_ids else None,
                )
                for choice in choices
                for message, finish_reason in [self._message(choice)]
            ],
            usage=self.generation.usage(),
            prompt_logprobs=self._prompt_logprobs(0),
            prompt_token_ids=self.generation.prompts[0] if self.request.return_token_ids else None,
        )
