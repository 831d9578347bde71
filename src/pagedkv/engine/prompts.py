"""vLLM's prompt dicts, by name: `from pagedkv import TokensPrompt` as from vllm.

`LLM.generate` reads any mapping with these keys; the TypedDicts only name them, so code
written against vLLM's `TextPrompt(prompt=...)` and `TokensPrompt(prompt_token_ids=...)` runs
unchanged (and a type checker sees the same keys).
"""

from __future__ import annotations

from typing import TypedDict


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
