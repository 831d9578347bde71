"""Prompt lookup proposes what its rule says: the longest suffix of min_n..max_n tokens that
occurs earlier; of its occurrences, the one whose preceding tokens equal the sequence's
furthest back (up to MATCH_CONTEXT), the latest of equals; the k tokens after it, those past
the sequence's end repeating its period. The oracle is that rule written out one window at a
time; sequences over a 3-token alphabet make long, repeated and overlapping matches common, and
repeated runs make contexts longer than MATCH_CONTEXT. The search runs over the sequence's
bytes, so ids whose bytes recur inside other ids' (256 is 1 shifted a byte) check that a match
starting inside a token is never taken for one."""

from __future__ import annotations

from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine.spec.ngram import MATCH_CONTEXT, propose_ngram


def rule(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Longest n first; for it, the windows equal to the suffix and ending before the last
    token; the one with the longest agreeing context (then the latest); the k tokens after it
    in the sequence extended token by token with the continuation itself."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[length - n :]
        found = [s for s in range(length - n) if n < length and tokens[s : s + n] == suffix]
        if not found:
            continue

        best = max(found, key=lambda start: (context(tokens, start, length - n), start))
        extended = list(tokens)
        for index in range(k):
            extended.append(extended[best + n + index])
        return extended[length:]
    return []


def context(tokens: list[int], start: int, suffix_at: int) -> int:
    """How many tokens before `start` equal those before `suffix_at`, up to MATCH_CONTEXT."""
    agreed = 0
    while (
        agreed < MATCH_CONTEXT
        and start - 1 - agreed >= 0
        and tokens[start - 1 - agreed] == tokens[suffix_at - 1 - agreed]
    ):
        agreed += 1
    return agreed


@settings(max_examples=1000, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2), min_size=1, max_size=80),
    min_n=st.integers(1, 5),
    extra=st.integers(0, 4),
    k=st.integers(1, 7),
)
def test_drafts_follow_the_rule(tokens: list[int], min_n: int, extra: int, k: int) -> None:
    got = propose_ngram(array("q", tokens), min_n, min_n + extra, k)
    assert got == rule(tokens, min_n, min_n + extra, k)


@settings(max_examples=500, deadline=None)
@given(
    run=st.lists(st.integers(0, 2), min_size=1, max_size=12),
    repeats=st.integers(2, 12),
    changes=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 2)), max_size=4),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
    k=st.integers(1, 9),
)
def test_repeated_runs_follow_the_rule(
    run: list[int],
    repeats: int,
    changes: list[tuple[int, int]],
    min_n: int,
    extra: int,
    k: int,
) -> None:
    """A run repeated, a few tokens changed: contexts longer than MATCH_CONTEXT, many ties, and
    continuations that reach the sequence's end."""
    tokens = run * repeats
    for at, token in changes:
        tokens[at % len(tokens)] = token
    got = propose_ngram(array("q", tokens), min_n, min_n + extra, k)
    assert got == rule(tokens, min_n, min_n + extra, k)


@settings(max_examples=500, deadline=None)
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


def test_the_occurrence_in_the_same_context_wins() -> None:
    # "3 4" occurs at 0 (then 6), at 5 after "1 2" (then 5 9) and at 10 after 7 (then 8); the
    # sequence ends "1 2 3 4": the occurrence after "1 2" wins, neither the first nor the last
    tokens = [3, 4, 6, 1, 2, 3, 4, 5, 9, 7, 3, 4, 8, 1, 2, 3, 4]
    assert propose_ngram(array("q", tokens), 2, 2, 2) == [5, 9]


def test_of_equal_contexts_the_latest_wins() -> None:
    assert propose_ngram(array("q", [3, 4, 6, 3, 4, 7, 3, 4]), 2, 2, 3) == [7, 3, 4]
    # contexts compared MATCH_CONTEXT tokens back: the first occurrence agrees further back
    # than the second, but both agree that far, so they are equal and the later one wins ...
    head = list(range(10, 10 + MATCH_CONTEXT))
    tokens = [99, *head, 3, 4, 1, 98, *head, 3, 4, 2, 99, *head, 3, 4]
    assert propose_ngram(array("q", tokens), 2, 2, 1) == [2]
    # ... and that far, one agreeing a token less loses, though it is the later one
    short = [0, *head[1:]]
    tokens = [98, *head, 3, 4, 1, 97, *short, 3, 4, 2, 99, *head, 3, 4]
    assert propose_ngram(array("q", tokens), 2, 2, 1) == [1]


def test_drafts_past_the_end_repeat_the_run() -> None:
    assert propose_ngram(array("q", [4, 5, 4, 5, 4, 5]), 2, 2, 5) == [4, 5, 4, 5, 4]
    assert propose_ngram(array("q", [9, 1, 2, 3, 1, 2, 3, 1, 2]), 2, 2, 4) == [3, 1, 2, 3]
    assert propose_ngram(array("q", [7, 7]), 1, 1, 3) == [7, 7, 7]
    assert propose_ngram(array("q", [4, 5, 6]), 1, 3, 2) == []
    assert propose_ngram(array("q", [4]), 1, 3, 2) == []
