"""Incremental detokenisation: text pieces that join to exactly the final text.

Byte-level tokenizers spread one character over several tokens (emoji, CJK), and decoding a
prefix of them yields U+FFFD. A piece is therefore held back until it decodes cleanly. Each
step decodes only a short window of recent tokens, with a few tokens of context before it so
tokenizers that drop a leading space at the start of a decode (SentencePiece) still produce
the same text as decoding everything at once. It keeps no tokens of its own: it reads the
sequence's token array, which only ever grows, through two offsets.

A character split between the prompt's last tokens and the first output tokens belongs to the
output, whole: the prompt's text ends before it (decoded alone it ends in U+FFFD), and the
output's text starts with it once its tokens complete it.
"""

from __future__ import annotations

from array import array

from pagedkv.tokenizer import Tokenizer

# Tokens of context decoded before the new ones; enough for any space / byte merge to settle.
CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sample's growing token array into text, a clean piece at a time."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        token_ids: array,
        num_prompt_tokens: int,
        skip_special_tokens: bool,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids = token_ids  # the sequence's own array: read, never written
        # Window start: a few prompt tokens of context, decoded but never emitted.
        self._prefix_offset = max(0, num_prompt_tokens - CONTEXT_TOKENS)
        self._read_offset = num_prompt_tokens  # tokens before this are emitted as text
        self._num_fed = num_prompt_tokens  # tokens `advance` has taken in

    def advance(self) -> str:
        """Take in the tokens appended since the last call; return the text now certain.

        A token never taken in (a stop token, which ends the text) is never decoded.
        """
        self._num_fed = len(self._token_ids)
        prefix_text, new_text = self._decode_window()
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = self._num_fed
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Text held back so far, less a character its tokens left incomplete (vLLM's
        detokenizers never emit it; decoded, it would be U+FFFD)."""
        prefix_text, new_text = self._decode_window()
        self._prefix_offset = self._read_offset
        self._read_offset = self._num_fed
        return new_text[len(prefix_text) :].rstrip("\ufffd")

    def _decode_window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        window = self._token_ids[self._prefix_offset : self._num_fed].tolist()
        held = self._read_offset - self._prefix_offset
        prefix_text = decode(window[:held], skip_special_tokens=self._skip_special_tokens)
        new_text = decode(window, skip_special_tokens=self._skip_special_tokens)
        while prefix_text.endswith(REPLACEMENT_CHAR) and not new_text.startswith(prefix_text):
            # The new tokens completed a character the held ones began: it is new text.
            prefix_text = prefix_text[:-1]
        return prefix_text, new_text
