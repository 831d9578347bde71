"""Prompt-lookup drafting: the tokens that followed the sequence's latest n-gram the first time
it occurred.

vLLM's rule: the longest suffix of `n` tokens (`prompt_lookup_max` down to `prompt_lookup_min`)
that occurs earlier in the sequence wins; of its occurrences, the first; the drafts are the up
to `k` tokens that followed it. Input-grounded text (a quoted or corrected passage) repeats the
prompt's own runs of tokens, which is why this costs no model and is often right.

Each search is one vectorised comparison of every window of the sequence with its suffix
(numpy over the record's own buffer, no copy): microseconds for thousands of tokens.
"""

from __future__ import annotations

from array import array

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: array, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` drafts continuing `token_ids` (an int64 array), or none when no suffix of
    `min_n..max_n` tokens occurs earlier in it."""
    tokens = np.frombuffer(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows that end before the last token: each has at least one token after it.
        windows = sliding_window_view(tokens[: length - 1], n)
        matches = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if len(matches):
            start = int(matches[0]) + n
            return tokens[start : start + k].tolist()
    return []
