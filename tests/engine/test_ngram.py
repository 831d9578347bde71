"""Prompt lookup proposes what vLLM's rule says, the tokens after the first earlier occurrence
of the longest suffix of min_n..max_n tokens, cut where another occurrence of that suffix goes
on differently (at least one kept). The oracle is that rule written out one window at a time;
sequences over a 3-token alphabet make long, repeated and overlapping matches common. The search
runs over the sequence's bytes, so ids whose bytes recur inside other ids' (256 is 1 shifted a
byte) check that a match starting inside a token is never taken for one."""

from __future__ import annotations

from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine.spec.ngram import propose_ngram


def rule(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Longest n first; for it, the windows equal to the suffix (and ending before the last
    token); the first one's k following tokens, up to the first position where another's
    following token (if the sequence has one there) differs, but at least one."""
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        found = [
            start + n
            for start in range(len(tokens) - n)
            if n < len(tokens) and tokens[start : start + n] == suffix
        ]
        if found:
            drafts = tokens[found[0] : found[0] + k]
            for position, token in enumerate(drafts):
                later = [tokens[f + position] for f in found if f + position < len(tokens)]
                if any(other != token for other in later):
                    return drafts[: max(position, 1)]
            return drafts
    return []


@settings(max_examples=2000, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2), min_size=1, max_size=80),
    min_n=st.integers(1, 5),
    extra=st.integers(0, 4),
    k=st.integers(1, 7),
)
def test_drafts_follow_the_rule(tokens: list[int], min_n: int, extra: int, k: int) -> None:
    got = propose_ngram(array("q", tokens), min_n, min_n + extra, k)
    assert got == rule(tokens, min_n, min_n + extra, k)


@settings(max_examples=1000, deadline=None)
@given(
    tokens=st.lists(st.sampled_from((0, 1, 256, 257, 65537, 1 << 40)), min_size=1, max_size=60),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 2),
    k=st.integers(1, 5),
)
def test_byte_patterns_inside_tokens_are_not_matches(
    tokens: list[int], min_n: int, extra: int, k: int
) -> None:
    got = propose_ngram(array("q", tokens), min_n, min_n + extra, k)
    assert got == rule(tokens, min_n, min_n + extra, k)


def test_a_match_inside_a_token_is_passed_over() -> None:
    # [1, 0] is the bytes 01 00..00 00..00; [256, 0, ...] holds them from its second byte
    tokens = [256, 0, 0, 9, 1, 0]
    assert propose_ngram(array("q", tokens), 2, 2, 2) == []
    assert propose_ngram(array("q", [256, 0, 0, 1, 0, 4, 1, 0]), 2, 2, 1) == [4]


def test_the_first_occurrence_of_the_longest_match_wins() -> None:
    # "1 2 3" occurs at 0 (followed by 7 7) and at 5 (followed by 8): the first wins, one draft
    # as the two part at once; "5 1 2 3" nowhere earlier; a later, shorter "2 3" match
    # (followed by 5) loses to the longer one.
    tokens = [1, 2, 3, 7, 7, 1, 2, 3, 8, 2, 3, 5, 1, 2, 3]
    assert propose_ngram(array("q", tokens), 2, 4, 3) == [7]
    assert propose_ngram(array("q", tokens), 1, 1, 2) == [7]  # the first 3, parting at once


def test_drafts_stop_where_the_occurrences_part() -> None:
    # "4 5" goes on "6 7 8 9" at 0 and "6 7 0" at 7: the drafts stop after "6 7"
    tokens = [4, 5, 6, 7, 8, 9, 1, 4, 5, 6, 7, 0, 2, 4, 5]
    assert propose_ngram(array("q", tokens), 2, 2, 4) == [6, 7]
    # a continuation that runs into the present ("4 5 4 5 | 4 5") agrees as far as it goes
    assert propose_ngram(array("q", [4, 5, 4, 5, 4, 5]), 2, 2, 5) == [4, 5, 4, 5]
    assert propose_ngram(array("q", [4, 5, 6]), 1, 3, 2) == []
    assert propose_ngram(array("q", [4]), 1, 3, 2) == []
