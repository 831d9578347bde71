"""Prompt-lookup drafting: the tokens that followed the sequence's latest n-gram where it
occurred before in the same context.

vLLM's rule: the longest suffix of `n` tokens (`prompt_lookup_max` down to `prompt_lookup_min`)
that occurs earlier in the sequence wins, and the drafts are the up to `k` tokens that followed
it. Input-grounded text (a quoted or corrected passage) repeats the prompt's own runs of
tokens, which is why this costs no model and is often right.

Where the n-gram occurred more than once, vLLM takes its first occurrence. Here the occurrence
whose preceding tokens agree with the sequence's furthest back wins (compared up to
`MATCH_CONTEXT` tokens before the n-gram; equals: the most recent). A passage quoted back
repeats its phrases in several sentences, and the sentence being copied is the one whose words
before the phrase are the sequence's; a model repeating itself has its latest round nearest.
And where the winner's continuation runs into the sequence's end (the n-gram ends a repeating
run), the drafts go on as the run does: draft i is the token `period` places before it, the
sequence followed by its drafts repeating with the period the match showed. Replayed over
bench/spec_bench.py's greedy outputs with the engine's adaptive rule (`acceptance.py`) at its
batch-1 step cost, workload (a) went from 1.82x to 1.86x and 2.14 to 2.27 tokens a step, (b)
from 1.18x to 1.19x, against the first occurrence with its drafts stopped where the
occurrences go on differently (the rule before this one; vLLM's own first occurrence: 1.78x).

Every step of every drafting sample searches its whole sequence, so the search is C's: the
sequence's bytes searched for the suffix's (`bytes.rfind`, a hit counting where it starts on a
token's first byte), longest suffix first. Only a suffix found twice needs the others, and
those come from numpy over the record's own buffer, however many there are: a model looping
over a phrase repeats it thousands of times.
"""

from __future__ import annotations

from array import array

import numpy as np

# Tokens before an n-gram compared with those before the sequence's suffix, at most, to choose
# among the n-gram's occurrences (replayed, 6 to 64 chose alike; the compare stops once one
# occurrence is left).
MATCH_CONTEXT = 16


def propose_ngram(token_ids: array, min_n: int, max_n: int, k: int) -> list[int]:
    """`k` drafts continuing `token_ids` (an array of ints), or none when no suffix of
    `min_n..max_n` tokens occurs earlier in it."""
    length, size = len(token_ids), token_ids.itemsize
    data = token_ids.tobytes()
    earlier = (length - 1) * size  # an earlier occurrence ends before the last token
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = data[(length - n) * size :]
        start = _rfind(data, suffix, earlier, size)
        if start >= 0:
            break
    else:
        return []
    if _rfind(data, suffix, (start + n - 1) * size, size) >= 0:  # another one, before it
        start = _closest_context(np.frombuffer(token_ids, dtype=token_ids.typecode), n)
    return _continuation(token_ids, start + n, k)


def _rfind(data: bytes, suffix: bytes, end: int, size: int) -> int:
    """The last token (index) where `suffix` occurs whole before byte `end`, or -1; a byte
    match that starts inside a token is passed over."""
    at = data.rfind(suffix, 0, end)
    while at > 0 and at % size:
        at = data.rfind(suffix, 0, at + len(suffix) - 1)
    return at // size if at >= 0 else -1


def _closest_context(tokens: np.ndarray, n: int) -> int:
    """Where the earlier occurrence of the sequence's last `n` tokens starts whose preceding
    tokens equal the sequence's furthest back (up to MATCH_CONTEXT); equals: the latest."""
    length = len(tokens)
    suffix_at = length - n
    starts = np.flatnonzero(tokens[:suffix_at] == tokens[suffix_at])
    for offset in range(1, n):
        starts = starts[tokens[starts + offset] == tokens[suffix_at + offset]]
    for back in range(1, min(MATCH_CONTEXT, suffix_at) + 1):
        reach = starts[starts >= back]
        agree = reach[tokens[reach - back] == tokens[suffix_at - back]]
        if len(agree) == 0:
            break
        starts = agree
        if len(starts) == 1:
            break
    return int(starts[-1])


def _continuation(token_ids: array, follows: int, k: int) -> list[int]:
    """The `k` tokens from index `follows` on, the ones past the sequence's end taken as the
    run goes on: each the token `len(token_ids) - follows` places before it."""
    drafts = token_ids[follows : follows + k].tolist()
    period = len(token_ids) - follows
    while len(drafts) < k:
        drafts.append(drafts[len(drafts) - period])
    return drafts
