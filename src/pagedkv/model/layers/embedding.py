"""Token embedding: the vocabulary's rows, which tied models also read their logits through.

Quantised (`quantize`), the table stays in its 4- or 8-bit layout: a lookup dequantises only
the rows it gathers, and a tied LM head multiplies by the quantised table directly. At
SmolLM2's 49k x 576 the table is a fifth of the model, so keeping it small matters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedkv.quant.formats import QuantizedTensor
from pagedkv.quant.matmul import as_dense, dequantize, quantized_linear
from pagedkv.quant.quantize import GROUP_SIZE, to_scheme


class Embedding(nn.Module):
    """A `[vocab_size, hidden_size]` table, allocated uninitialised: the loader fills it."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self._dtype = torch.get_default_dtype()
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.qweight: QuantizedTensor | None = None
        self.scheme: str | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: the table's, or (quantised) the dtype it was built in."""
        return self._dtype if self.weight is None else self.weight.dtype

    def quantize(self, scheme: str) -> None:
        """Keep the table quantised (`Linear.quantize` says what `scheme` means); before loading."""
        if self.weight.shape[1] % GROUP_SIZE == 0:
            self.scheme = scheme

    @torch.no_grad()
    def load(self, tensor: Tensor | QuantizedTensor) -> None:
        """Fill the table from a checkpoint tensor (already shape-checked)."""
        if self.scheme is None or (
            self.scheme == "auto" and not isinstance(tensor, QuantizedTensor)
        ):
            self.weight.copy_(as_dense(tensor))
            return
        self.qweight = to_scheme(tensor, self.scheme)
        self.weight = None

    def dense_weight(self) -> Tensor:
        """The table as a float matrix (a dequantised copy when quantised)."""
        return self.weight.detach() if self.qweight is None else dequantize(self.qweight)

    def forward(self, token_ids: Tensor) -> Tensor:
        if self.qweight is None:
            return F.embedding(token_ids, self.weight)
        return (
            self.qweight.rows(token_ids.reshape(-1))
            .dequantize(self.dtype)
            .view(*token_ids.shape, -1)
        )

    def logits(self, hidden: Tensor) -> Tensor:
        """`hidden @ table.T`: the LM head of a model with tied embeddings."""
        if self.qweight is None:
            return F.linear(hidden, self.weight)
        return quantized_linear(hidden, self.qweight, None)
