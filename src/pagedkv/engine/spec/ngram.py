"""Prompt-lookup drafting: the tokens that followed the sequence's latest n-gram the first time
it occurred, as far as its other occurrences agree.

vLLM's rule: the longest suffix of `n` tokens (`prompt_lookup_max` down to `prompt_lookup_min`)
that occurs earlier in the sequence wins; of its occurrences, the first; the drafts are the up
to `k` tokens that followed it. Input-grounded text (a quoted or corrected passage) repeats the
prompt's own runs of tokens, which is why this costs no model and is often right.

One change to it: where the n-gram occurred more than once and the occurrences go on
differently, the text does not say which way it goes on, and drafts past the point where they
part are a guess that costs a verification row each. So the drafts stop at the first position
where an occurrence goes on with another token (keeping the first draft, vLLM's); an
occurrence whose continuation runs into the sequence's end says nothing past it. Replayed over
bench/spec_bench.py's workload (a) this verified a fifth fewer drafts for 1.5% fewer kept, and
took its batch-1 bound (`replay_bound`, 4.6 ms a step + 0.96 ms a row) from 1.64x to 1.73x.

Every step of every drafting sample searches its whole sequence, so the search is C's: the
sequence's bytes searched for the suffix's (`bytes.find`, a hit counting where it starts on a
token's first byte), longest suffix first, the first hit its first occurrence. Only a suffix
found again further on needs the others (to see where they part), and those come from numpy
over the record's own buffer, however many there are: a model looping over a phrase repeats
it thousands of times. Measured inside the engine's step, where the layers have just left the
cores' caches, a search by numpy alone took 0.16 ms (a tenth of a verification row) on
workload (a)'s sequences of a few hundred tokens, most of it the dispatch of its ~30 calls.
"""

from __future__ import annotations

from array import array

import numpy as np


def propose_ngram(token_ids: array, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` drafts continuing `token_ids` (an int64 array), or none when no suffix of
    `min_n..max_n` tokens occurs earlier in it."""
    length, size = len(token_ids), token_ids.itemsize
    data = token_ids.tobytes()
    earlier = (length - 1) * size  # an earlier occurrence ends before the last token
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = data[(length - n) * size :]
        first = _find(data, suffix, 0, earlier, size)
        if first >= 0:
            break
    else:
        return []
    drafts = token_ids[first + n : first + n + k].tolist()
    if _find(data, suffix, (first + 1) * size, earlier, size) < 0:
        return drafts  # the only occurrence: nothing to part from
    tokens = np.frombuffer(token_ids, dtype=np.int64)
    starts = np.flatnonzero(tokens[: length - n] == tokens[length - n])
    for offset in range(1, n):
        starts = starts[tokens[starts + offset] == tokens[length - n + offset]]
    return drafts[: _agreed(tokens, starts + n, drafts)]


def _find(data: bytes, suffix: bytes, start: int, end: int, size: int) -> int:
    """The first token (index) at or after byte `start` where `suffix` occurs whole before byte
    `end`, or -1; a byte match that starts inside a token is passed over."""
    at = data.find(suffix, start, end)
    while at >= 0 and at % size:
        at = data.find(suffix, at + 1, end)
    return at // size if at >= 0 else -1


def _agreed(tokens: np.ndarray, starts: np.ndarray, drafts: list[int]) -> int:
    """How many of `drafts` (the continuation at `starts[0]`) the other continuations at
    `starts[1:]` agree with, each as far as the sequence goes: at least the first draft, vLLM's."""
    others = starts[1:]
    for position, draft in enumerate(drafts):
        at = others + position
        if (tokens[at[at < len(tokens)]] != draft).any():
            return max(position, 1)
    return len(drafts)
