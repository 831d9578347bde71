"""Admission: what `Engine.add_request` checks before a request is queued.

Every check here raises a `RequestRejected` naming the value and the limit, so a refused
request never reaches the scheduler and the requests already running are unaffected. The
checks are the engine's limits (vocabulary, context, pool, step size), which `SamplingParams`
cannot know when it is made.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.engine.errors import (
    EmptyPrompt,
    InvalidCacheSalt,
    InvalidPriority,
    InvalidTokenId,
    PromptTooLong,
    RequestTooLarge,
    TokenOutOfVocabulary,
    TooManyLogprobs,
    TooManySamples,
    TruncationTooLong,
)
from pagedkv.engine.params import SamplingParams
from pagedkv.tokenizer import Tokenizer


@dataclass(frozen=True)
class Limits:
    """The engine's limits a request must fit."""

    vocab_size: int
    max_model_len: int
    num_gpu_blocks: int
    block_size: int
    max_samples: int  # sequences one step can run: min(max_num_seqs, max_num_batched_tokens)
    max_logprobs: int


def special_tokens_flag(tokenization_kwargs: Mapping[str, Any]) -> bool:
    """vLLM's `tokenization_kwargs`, checked whatever the prompts: whether a text prompt is
    encoded with the tokenizer's special tokens (`add_special_tokens`, the one key taken)."""
    unknown = sorted(set(tokenization_kwargs) - {"add_special_tokens"})
    if unknown:
        raise ValueError(f"tokenization_kwargs takes add_special_tokens only, got {unknown}")
    add = tokenization_kwargs.get("add_special_tokens", True)
    if not isinstance(add, bool):
        raise ValueError(f"tokenization_kwargs add_special_tokens must be a bool, got {add!r}")
    return add


def tokenize(
    tokenizer: Tokenizer, prompt: str | Sequence[int], vocab_size: int
) -> tuple[str | None, list[int]]:
    """The prompt's text (None when given as ids) and token ids, each id checked. A prompt
    with no tokens is refused; an empty text that the tokenizer gives a BOS token is not,
    as vLLM's (the model then writes from the start of a document)."""
    if isinstance(prompt, Mapping):
        raise TypeError(
            "Engine.add_request takes a prompt as text or token ids; vLLM's prompt dicts "
            "({'prompt': ...}, {'prompt_token_ids': ...}) are LLMEngine's and LLM's forms"
        )
    if isinstance(prompt, str):
        token_ids = tokenizer.encode(prompt)
        if not token_ids:
            raise EmptyPrompt()
        return prompt, token_ids
    token_ids = []
    for position, value in enumerate(prompt):
        if isinstance(value, bool):
            raise InvalidTokenId(position, value)
        try:  # ints, and integer types such as numpy's, become plain ints
            token_ids.append(operator.index(value))
        except TypeError:
            raise InvalidTokenId(position, value) from None
    if not token_ids:
        raise EmptyPrompt()
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise TokenOutOfVocabulary(token_id, vocab_size)
    return None, token_ids


def truncate(token_ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """The prompt's last `truncate_prompt_tokens` tokens (vLLM's left truncation); -1 keeps
    as many as the context holds with room for one new token."""
    check_truncation(params, max_model_len)
    keep = params.truncate_prompt_tokens
    if keep is None:
        return token_ids
    if keep == -1:
        keep = max_model_len - 1
    return token_ids[-keep:]


def check_truncation(params: SamplingParams, max_model_len: int) -> None:
    """A `truncate_prompt_tokens` past the context is refused, as vLLM refuses it."""
    keep = params.truncate_prompt_tokens
    if keep is not None and keep > max_model_len:
        raise TruncationTooLong(keep, max_model_len)


def check_keys(priority: object, cache_salt: object) -> None:
    """A request's priority is an int, and its cache_salt None or a non-empty str."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidPriority(priority)
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise InvalidCacheSalt(cache_salt)


def check_request(
    token_ids: list[int], params: SamplingParams, limits: Limits, beams: bool = False
) -> int:
    """max_tokens, cut to the room the context leaves, after checking the request's token ids
    and logprobs against the model and that it fits the context, the pool and a step.

    As in vLLM, only a prompt that fills the context is refused: a longer max_tokens
    stops at max_model_len with finish_reason "length". A logprobs count of -1 (every token)
    becomes the vocabulary's size in `params`, the engine's own copy. All n samples (with
    `beams`, the n beams of a search) run in each step together, so n is at most the
    sequences a step runs.
    """
    _check_vocabulary(params, limits.vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        every_token = getattr(params, name) == -1
        if every_token:  # vLLM's: every token (params is the engine's copy)
            setattr(params, name, limits.vocab_size)
        count = getattr(params, name)
        if count is not None and count > limits.max_logprobs:
            raise TooManyLogprobs(name, count, limits.max_logprobs, every_token)
    num_prompt = len(token_ids)
    if num_prompt >= limits.max_model_len:
        raise PromptTooLong(num_prompt, limits.max_model_len)
    room = limits.max_model_len - num_prompt
    max_tokens = params.max_tokens
    if max_tokens is None:  # as long as the context, and the pool, allow
        pool_tokens = limits.num_gpu_blocks // params.n * limits.block_size
        max_tokens = max(1, pool_tokens - num_prompt)
    max_tokens = min(max_tokens, room)
    # Samples share the prompt's blocks while they run, but after a preemption each one
    # may come back (swapped in, or recomputed) with blocks of its own: the request must
    # fit the whole pool in that worst case too, or it could wait forever.
    needed = params.n * -(-(num_prompt + max_tokens) // limits.block_size)
    if needed > limits.num_gpu_blocks:
        raise RequestTooLarge(needed, limits.num_gpu_blocks)
    if params.n > limits.max_samples:
        raise TooManySamples(params.n, limits.max_samples, beams)
    return max_tokens


def bad_words_token_ids(tokenizer: Tokenizer, bad_words: Sequence[str]) -> list[list[int]]:
    """Each bad word's token ids, as vLLM derives them: the word as given (its leading
    spaces removed), and again after a space where that encodes as a different word of the
    same length (a word mid-text usually starts with its space)."""
    banned: list[list[int]] = []
    for word in bad_words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        banned.append(alone)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            banned.append(spaced)
    return banned


def _check_vocabulary(params: SamplingParams, vocab_size: int) -> None:
    """Every token id a parameter names indexes the logits, so it must be in the vocabulary."""
    named = (
        ("stop_token_ids token id", params.stop_token_ids or []),
        ("logit_bias token id", params.logit_bias or {}),
        ("allowed_token_ids token id", params.allowed_token_ids or []),
    )
    for where, token_ids in named:
        for token_id in token_ids:
            if token_id >= vocab_size:
                raise TokenOutOfVocabulary(token_id, vocab_size, where)
