"""The grammar's token mask, applied to the constrained rows of a step's logits.

Masks of all constrained rows are computed together by llguidance's thread pool into one
bitmask (a bit per token), unpacked by numpy into one bool per token and applied to those
rows; rows without a grammar are not touched and cost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import llguidance
import llguidance.numpy
import numpy as np
import torch
from torch import Tensor

from pagedkv.engine.structured.state import GrammarState


@cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()


def apply_grammar_masks(
    logits: Tensor, rows: Sequence[int], states: Sequence[GrammarState]
) -> None:
    """Set to -inf, in row `rows[i]` of `logits`, every token `states[i]` does not allow."""
    if not rows:
        return
    vocab = logits.shape[-1]
    # Rows may share a state (the positions of a speculative sample whose drafts the grammar
    # refuses from the first): each distinct state's mask is computed once.
    distinct: dict[int, int] = {}
    for state in states:
        distinct.setdefault(id(state), len(distinct))
    bitmask = llguidance.numpy.allocate_token_bitmask(len(distinct), vocab)
    unique = {id(state): state for state in states}
    matchers = [(unique[key].matcher, position) for key, position in distinct.items()]
    llguidance.numpy.fill_next_token_bitmask_par(_executor(), matchers, bitmask)
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab, bitorder="little")
    bits = bits[[distinct[id(state)] for state in states]]
    banned = torch.from_numpy(bits == 0).to(logits.device)
    if len(rows) == logits.shape[0]:  # every row constrained: in place, no gather
        logits.masked_fill_(banned, float("-inf"))
        return
    index = torch.tensor(list(rows), device=logits.device)
    logits[index] = logits[index].masked_fill(banned, float("-inf"))
