"""Prompt lookup proposes what vLLM's rule says: the tokens after the first earlier occurrence
of the longest suffix of min_n..max_n tokens. The oracle is that rule written out one window at
a time; sequences over a 3-token alphabet make long, repeated and overlapping matches common."""

from __future__ import annotations

from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine.spec.ngram import propose_ngram


def rule(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Longest n first; for it, windows from the sequence's start; the first one equal to the
    suffix (and ending before the last token) gives the k tokens after it."""
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n):
            if n < len(tokens) and tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@settings(max_examples=2000, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2), min_size=1, max_size=80),
    min_n=st.integers(1, 5),
    extra=st.integers(0, 4),
    k=st.integers(1, 7),
)
def test_drafts_follow_vllms_rule(tokens: list[int], min_n: int, extra: int, k: int) -> None:
    got = propose_ngram(array("q", tokens), min_n, min_n + extra, k)
    assert got == rule(tokens, min_n, min_n + extra, k)


def test_the_first_occurrence_of_the_longest_match_wins() -> None:
    # "1 2 3" occurs at 0 (followed by 7) and at 5 (followed by 8); "5 1 2 3" nowhere earlier;
    # a later, shorter "2 3" match (followed by 5) loses to the longer one.
    tokens = [1, 2, 3, 7, 7, 1, 2, 3, 8, 2, 3, 5, 1, 2, 3]
    assert propose_ngram(array("q", tokens), 2, 4, 3) == [7, 7, 1]
    assert propose_ngram(array("q", tokens), 1, 1, 2) == [7, 7]  # the first 3
    assert propose_ngram(array("q", [4, 5, 6]), 1, 3, 2) == []
    assert propose_ngram(array("q", [4]), 1, 3, 2) == []
