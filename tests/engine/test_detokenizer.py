"""Incremental detokenisation against decoding everything at once.

Oracle: the tokenizer's own decode of the whole sequence. Token by token, the pieces join to
the whole text less the prompt's text, wherever multi-byte characters fall: inside the output,
split over steps, or split between the prompt's last tokens and the first output tokens (that
character is output text: the prompt's text ends before it, as decoded alone it ends in
U+FFFD). A character the output leaves unfinished at its end is never emitted.
"""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from pagedkv.tokenizer import Tokenizer
from tests.model.tiny_models import write_tokenizer_files

TEXT = ["€", "é", "中", "😀", "a", " block", " table", "x", "."]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_files(folder)
    return Tokenizer.from_folder(folder)


def byte_level_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """The ids of `text`, each multi-byte character one byte token per byte (the tiny BPE
    never merged them), so any split between tokens can fall inside a character."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    return ids


def detokenize(tokenizer: Tokenizer, prompt: list[int], output: list[int]) -> list[str]:
    token_ids = array("q", prompt)
    detokenizer = IncrementalDetokenizer(tokenizer, token_ids, len(prompt), True)
    pieces = []
    for token in output:
        token_ids.append(token)
        pieces.append(detokenizer.advance())
    return [*pieces, detokenizer.flush()]


def expected_output_text(tokenizer: Tokenizer, prompt: list[int], output: list[int]) -> str:
    whole = tokenizer.decode(prompt + output)
    prompt_text = tokenizer.decode(prompt)
    while prompt_text.endswith(REPLACEMENT_CHAR) and not whole.startswith(prompt_text):
        prompt_text = prompt_text[:-1]  # a character the output's tokens complete
    assert whole.startswith(prompt_text)
    return whole[len(prompt_text) :].rstrip(REPLACEMENT_CHAR)  # less an unfinished character


def test_a_character_split_between_prompt_and_output_is_output_text(tokenizer) -> None:
    ids = byte_level_ids(tokenizer, "ab€xx")
    euro = len(byte_level_ids(tokenizer, "ab"))
    for split in (euro + 1, euro + 2):  # after the euro sign's first byte, or its second
        prompt, output = ids[:split], ids[split:]
        assert tokenizer.decode(prompt).endswith(REPLACEMENT_CHAR)
        assert "".join(detokenize(tokenizer, prompt, output)) == "€xx"


@settings(max_examples=200, deadline=None)
@given(
    words=st.lists(st.sampled_from(TEXT), min_size=2, max_size=12),
    cut=st.integers(0, 10**6),
    prompt_cut=st.integers(0, 10**6),
)
def test_pieces_join_to_the_whole_text_less_the_prompts(tokenizer, words, cut, prompt_cut) -> None:
    ids = byte_level_ids(tokenizer, "".join(words))
    ids = ids[: 1 + cut % len(ids)]  # the output may end inside a character
    split = 1 + prompt_cut % len(ids)
    prompt, output = ids[:split], ids[split:]
    assert "".join(detokenize(tokenizer, prompt, output)) == expected_output_text(
        tokenizer, prompt, output
    )
