"""The bytes each token id stands for, for logprobs that report what a token really is.

A token may hold only part of a character (byte-level BPE splits UTF-8 sequences; SentencePiece
falls back to `<0xNN>` tokens). Decoding such a token alone gives U+FFFD, so its bytes are read
from the vocabulary instead, by the rule the tokenizer's decoder uses: GPT-2's byte-to-character
table for `ByteLevel`, `<0xNN>` plus `▁` for a space for `ByteFallback`. Added (special) tokens
and tokenizers with neither decoder fall back to the UTF-8 of the decoded token.
"""

from __future__ import annotations

import json
import re
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedkv.tokenizer import Tokenizer

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SENTENCEPIECE_SPACE = "\u2581"


class TokenBytes:
    """`token_bytes(token_id)`: the bytes of one token, cached per id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        raw = tokenizer.tokenizer
        added_tokens = raw.get_added_tokens_decoder()
        self._added = {token_id: added.content for token_id, added in added_tokens.items()}
        # Special tokens add no text when a request skips them (`skip_special_tokens`).
        self.special_ids = frozenset(i for i, added in added_tokens.items() if added.special)
        self._decoders = _decoder_types(raw.decoder.__getstate__() if raw.decoder else None)
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        """The bytes `token_id` adds to a text."""
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._bytes(token_id)
        return found

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self.tokenizer.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if "ByteLevel" in self._decoders:
            table = _unicode_to_byte()
            if all(char in table for char in piece):
                return bytes(table[char] for char in piece)
        if "ByteFallback" in self._decoders:
            match = _BYTE_FALLBACK.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
            return piece.replace(_SENTENCEPIECE_SPACE, " ").encode()
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()


def _decoder_types(state: bytes | None) -> set[str]:
    """The `type` of a decoder and of every decoder nested in it (a Sequence's)."""
    if state is None:
        return set()
    types: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                types.add(node["type"])
            for child in node.get("decoders") or []:
                walk(child)

    walk(json.loads(state))
    return types


@cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's table, reversed: the printable character byte-level BPE uses for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}
