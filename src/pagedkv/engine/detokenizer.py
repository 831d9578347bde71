"""Incremental detokenisation: text pieces that join to exactly the final text.

Byte-level tokenizers spread one character over several tokens (emoji, CJK), and decoding a
prefix of them yields U+FFFD. A piece is therefore held back until it decodes cleanly. Each
step decodes only a short window of recent tokens, with a few tokens of context before it so
tokenizers that drop a leading space at the start of a decode (SentencePiece) still produce
the same text as decoding everything at once.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.tokenizer import Tokenizer

# Tokens of context decoded before the new ones; enough for any space / byte merge to settle.
CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sample's growing token list into text, a clean piece at a time."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self._token_ids = context
        self._prefix_offset = 0  # window start: context tokens, decoded but already emitted
        self._read_offset = len(context)  # tokens before this are emitted as text

    def add(self, token_ids: Sequence[int]) -> str:
        """Append output tokens; return the new text that is now certain (maybe empty)."""
        self._token_ids.extend(token_ids)
        prefix_text, new_text = self._decode_window()
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Text held back so far (an incomplete character decodes as U+FFFD)."""
        prefix_text, new_text = self._decode_window()
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return new_text[len(prefix_text) :]

    def _decode_window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        window = self._token_ids[self._prefix_offset :]
        held = self._read_offset - self._prefix_offset
        prefix_text = decode(window[:held], skip_special_tokens=self._skip_special_tokens)
        new_text = decode(window, skip_special_tokens=self._skip_special_tokens)
        return prefix_text, new_text
