"""Token embedding: the vocabulary's rows, which tied models also read their logits through."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Embedding(nn.Module):
    """A `[vocab_size, hidden_size]` table, allocated uninitialised: the loader fills it."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, token_ids: Tensor) -> Tensor:
        return F.embedding(token_ids, self.weight)
