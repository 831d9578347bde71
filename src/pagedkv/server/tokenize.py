"""`POST /tokenize` and `POST /detokenize`: vLLM's endpoints for what the model reads.

A client counts a prompt's tokens, or renders a conversation the way the server will, before
it sends a request (evaluation harnesses ask `/tokenize` for the context length and the ids
of what they score). A body with `messages` is a conversation, rendered exactly as
`/v1/chat/completions` renders it (template, tools, generation prompt); any other is a text
`prompt`. The answer is vLLM's: the ids, their count, the served `max_model_len` and, with
`return_token_strs`, each id's vocabulary entry.
"""

from __future__ import annotations

import asyncio
import json

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse

from pagedkv.server.chat import render_conversation
from pagedkv.server.errors import APIError
from pagedkv.server.formats import RequestModel
from pagedkv.server.protocol import ChatCompletionRequest, NonNegativeInt
from pagedkv.server.serving import ServingContext, encode_prompts, parse_body


class TokenizeCompletionRequest(RequestModel):
    """A text prompt to tokenize, as `/v1/completions` would."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatCompletionRequest):
    """A conversation to render and tokenize, as `/v1/chat/completions` would."""

    return_token_strs: bool = False


class DetokenizeRequest(RequestModel):
    """Token ids to turn back into text."""

    model: str | None = None
    tokens: list[NonNegativeInt] = Field(max_length=1 << 20)


async def tokenize(context: ServingContext, raw: Request) -> JSONResponse:
    """The prompt's (or the rendered conversation's) token ids."""
    body = await raw.body()
    if _is_conversation(body):
        chat = context.parse(body, TokenizeChatRequest)
        _, ids = await asyncio.to_thread(render_conversation, context, chat)
        token_strs = chat.return_token_strs
    else:
        request = parse_body(body, TokenizeCompletionRequest)
        context.check_model(request.model)
        [ids] = await asyncio.to_thread(
            encode_prompts, context, [request.prompt], add_special_tokens=request.add_special_tokens
        )
        token_strs = request.return_token_strs
    vocabulary = context.tokenizer.tokenizer
    return JSONResponse(
        {
            "count": len(ids),
            "max_model_len": context.max_model_len,
            "tokens": ids,
            "token_strs": [vocabulary.id_to_token(i) for i in ids] if token_strs else None,
        }
    )


async def detokenize(context: ServingContext, raw: Request) -> JSONResponse:
    """The text of token ids, special tokens included (vLLM's `tokenizer.decode(ids)`)."""
    request = parse_body(await raw.body(), DetokenizeRequest)
    context.check_model(request.model)
    size = context.tokenizer.vocab_size
    outside = next((token for token in request.tokens if token >= size), None)
    if outside is not None:
        raise APIError(
            400,
            f"tokens: token id {outside} is outside the tokenizer's vocabulary [0, {size})",
            param="tokens",
        )
    text = context.tokenizer.decode(request.tokens, skip_special_tokens=False)
    return JSONResponse({"prompt": text})


def _is_conversation(body: bytes) -> bool:
    """Whether a body asks for a conversation (its `messages` are not null); a body that is
    not a JSON object is left to the prompt's parser, which names what is wrong."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return False
    return isinstance(parsed, dict) and parsed.get("messages") is not None
