"""The reasoning split (`server/reasoning.py`) against its rule written out on the whole text:
a think block opened by the prompt or by the output's start (after whitespace, the tag
dropped), reasoning up to the first `</think>`, content after it. Streamed, the pieces of any
cutting of the output add up to the same split (so the tags that open and close the block are
never sent). Texts are drawn from the tags, pieces of them and a few characters, so tags cut
across pieces, repeated and half-written ones are common."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.server.reasoning import ReasoningSplitter, split_reasoning, thinking_prompt

FRAGMENTS = ("<think>", "</think>", "<", "</", "<thi", "nk>", "</th", "ink>", "a", " ", "\n", ">")


def rule(text: str, prompt_open: bool) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output."""
    if text.lstrip().startswith("<think>"):
        body = text.lstrip()[len("<think>") :]
    elif prompt_open:
        body = text
    else:
        return None, text or None
    if "</think>" in body:
        reasoning, content = body.split("</think>", 1)
        return reasoning, content or None
    return body, None


texts = st.lists(st.sampled_from(FRAGMENTS), max_size=14).map("".join)


@settings(max_examples=750, deadline=None)
@given(text=texts, prompt_open=st.booleans())
def test_a_whole_output_splits_by_the_rule(text: str, prompt_open: bool) -> None:
    assert split_reasoning(text, prompt_open) == rule(text, prompt_open)


@settings(max_examples=750, deadline=None)
@given(text=texts, prompt_open=st.booleans(), cuts=st.lists(st.integers(0, 200), max_size=8))
def test_streamed_pieces_add_up_to_the_whole_split(
    text: str, prompt_open: bool, cuts: list[int]
) -> None:
    bounds = sorted({0, len(text), *(cut % (len(text) + 1) for cut in cuts)})
    pieces = [text[start:end] for start, end in zip(bounds, bounds[1:], strict=False)] or [""]
    splitter = ReasoningSplitter(prompt_open)
    sent = [splitter.feed(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    reasoning = "".join(part for part, _ in sent)
    content = "".join(part for _, part in sent)
    expected_reasoning, expected_content = rule(text, prompt_open)
    assert reasoning == (expected_reasoning or "")
    assert content == (expected_content or "")
    assert splitter.thought == (expected_reasoning is not None)


def test_examples() -> None:
    qwen = "<think>\nAdd them.\n</think>\n\n4"
    assert split_reasoning(qwen, thinking=False) == ("\nAdd them.\n", "\n\n4")
    assert split_reasoning("Add them.\n</think>\n\n4", thinking=True) == ("Add them.\n", "\n\n4")
    assert split_reasoning("\n<think>Add.</think>4", thinking=True) == ("Add.", "4")
    assert split_reasoning("Still thinking", thinking=True) == ("Still thinking", None)
    assert split_reasoning("4", thinking=False) == (None, "4")
    assert split_reasoning("<think></think>", thinking=False) == ("", None)
    # a think tag inside an answer is the answer's
    assert split_reasoning("Use <think> tags", thinking=False) == (None, "Use <think> tags")


def test_the_prompt_leaves_a_block_open_when_its_last_tag_opens_one() -> None:
    assert thinking_prompt("<|User|>2+2?<|Assistant|><think>\n")
    assert not thinking_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not thinking_prompt("<|im_start|>assistant\n")
    assert thinking_prompt("<think>a</think> ... <|im_start|>assistant\n<think>")
