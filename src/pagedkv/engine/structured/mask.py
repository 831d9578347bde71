"""The grammar's token mask, applied to the constrained rows of a step's logits.

Masks of all constrained rows are computed together by llguidance's thread pool into one
bitmask (a bit per token), moved to the logits' device and unpacked there; rows without a
grammar are not touched and cost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import llguidance
import llguidance.numpy
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
    bitmask = llguidance.numpy.allocate_token_bitmask(len(rows), vocab)
    matchers = [(state.matcher, position) for position, state in enumerate(states)]
    llguidance.numpy.fill_next_token_bitmask_par(_executor(), matchers, bitmask)
    bits = torch.from_numpy(bitmask).to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bits[:, :, None] >> shifts) & 1).bool().reshape(len(rows), -1)[:, :vocab]
    index = torch.tensor(list(rows), device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
