"""The prompt forms `LLM.generate` reads, and vLLM's prompt dicts by name (`from pagedkv
import TokensPrompt` as from vllm).

`LLM.generate` reads any mapping with these keys; the TypedDicts only name them, so code
written against vLLM's `TextPrompt(prompt=...)` and `TokensPrompt(prompt_token_ids=...)` runs
unchanged (and a type checker sees the same keys).
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

Prompt = str | Sequence[int]
# vLLM's TextPrompt {"prompt": str} and TokensPrompt {"prompt_token_ids": list[int]}
# (named below); any mapping with those keys is read.
PromptDict = Mapping[str, Any]


class _Text(TypedDict):
    prompt: str


class TextPrompt(_Text, total=False):
    """A text prompt; prefix-cache blocks are shared only between prompts with the same
    `cache_salt`."""

    cache_salt: str


class _Tokens(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_Tokens, total=False):
    """A prompt of token ids; `cache_salt` as TextPrompt's."""

    cache_salt: str


def as_prompts(
    prompts: Prompt | PromptDict | Sequence[Prompt | PromptDict],
) -> tuple[list[Prompt], list[str | None], list[str | None]]:
    """The prompts as text or token ids, each one's cache salt (a prompt dict's
    `"cache_salt"`, else None) and each one's text as outputs report it (`prompt_text`); a
    TypeError names the first prompt that is neither."""
    if isinstance(prompts, str | Mapping):
        items = [prompts]
    elif not is_sequence(prompts):
        raise _not_a_prompt(prompts)
    else:
        items = list(prompts)  # type: ignore[arg-type]
        if items and all(isinstance(p, int) and not isinstance(p, bool) for p in items):
            items = [items]  # one prompt given as token ids
    salts = [item.get("cache_salt") if isinstance(item, Mapping) else None for item in items]
    return [as_prompt(item) for item in items], salts, [prompt_text(item) for item in items]


def prompt_text(prompt: object) -> str | None:
    """A prompt's text as its output reports it: a text prompt's own, or the `"prompt"` a
    dict gives beside its token ids (vLLM's TokensPrompt, "the text the ids stand for")."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping) and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    return None


def as_prompt(prompt: object) -> Prompt:
    """One prompt as text or token ids (the engine checks the ids themselves)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        if prompt.get("multi_modal_data") is not None:  # never silently left out
            raise ValueError("multi_modal_data is not supported: the models here read text only")
        if "prompt_token_ids" in prompt:  # vLLM reads the ids first when both are given
            token_ids = prompt["prompt_token_ids"]
            if is_sequence(token_ids):
                return token_ids
        elif isinstance(prompt.get("prompt"), str):
            return prompt["prompt"]
        raise _not_a_prompt(prompt)
    if is_sequence(prompt):
        return prompt  # type: ignore[return-value]
    raise _not_a_prompt(prompt)


def is_sequence(value: object) -> bool:
    """A list or tuple (of token ids, prompts, messages or params): text and bytes are
    sequences too, but not of those; a dict is none."""
    return isinstance(value, Sequence) and not isinstance(value, str | bytes | bytearray)


def _not_a_prompt(prompt: object) -> TypeError:
    return TypeError(
        f"prompt {reprlib.repr(prompt)} is {type(prompt).__name__}: give a string, a list "
        "of token ids, {'prompt': str}, {'prompt_token_ids': list[int]}, or a list of them"
    )
