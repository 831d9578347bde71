"""Token embedding: the vocabulary's rows, which tied models also read their logits through.

Quantised (`quantize`), the table stays in its 4- or 8-bit layout: a lookup dequantises only
the rows it gathers, and a tied LM head multiplies by the quantised table directly. At
SmolLM2's 49k x 576 the table is a fifth of the model, so keeping it small matters. A table
that is also the LM head (`reads_logits`) is kept in the layout the kernels multiply fastest
(`kernel_layout`: panels on AVX-512 VNNI machines, where SmolLM2's logits took 27% less time at
6 rows, 34% at 32), and a lookup picks its rows out of the panels.

Under tensor parallelism (built inside `parallel.group.sharding`) the table is split by
vocabulary rows, padded to an equal share per rank: a lookup finds each token on the one rank
that holds its row (zeros elsewhere) and all-reduces, and tied logits are each rank's rows'
logits gathered on rank 0. A quantised table is sharded still quantised
(`QuantizedTensor.shard`), its padding rows zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedkv.parallel.collectives import all_reduce, gather_last_dim
from pagedkv.parallel.group import building_group
from pagedkv.parallel.split import split_padded
from pagedkv.quant.formats import QuantizedTensor, padded_shard
from pagedkv.quant.matmul import (
    as_dense,
    dequantize,
    dequantize_rows,
    float_linear,
    kernel_layout,
    quantized_linear,
)
from pagedkv.quant.quantize import GROUP_SIZE, to_scheme


class Embedding(nn.Module):
    """A `[vocab_size, hidden_size]` table, allocated uninitialised: the loader fills it."""

    def __init__(self, vocab_size: int, hidden_size: int, reads_logits: bool = False) -> None:
        super().__init__()
        self.reads_logits = reads_logits  # a tied LM head multiplies by this table
        self._dtype = torch.get_default_dtype()
        self.checkpoint_shape = (vocab_size, hidden_size)
        group = building_group()
        self.sharded = group.size > 1
        # This rank's vocabulary rows: all of them unless sharded.
        self.split = split_padded(vocab_size, group.rank, group.size)
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(self.split.local, hidden_size))
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
        """Fill the table (this rank's rows of it) from a checkpoint tensor (shape-checked)."""
        if self.sharded:
            tensor = self._rows(tensor)
        if self.scheme is None or (
            self.scheme == "auto" and not isinstance(tensor, QuantizedTensor)
        ):
            self.weight.copy_(as_dense(tensor))
            return
        qweight = to_scheme(tensor, self.scheme)
        self.qweight = kernel_layout(qweight) if self.reads_logits else qweight
        self.weight = None

    def _rows(self, tensor: Tensor | QuantizedTensor) -> Tensor | QuantizedTensor:
        """This rank's vocabulary rows of the table, padded with zero rows to an equal share."""
        split, width = self.split, self.checkpoint_shape[1]
        return padded_shard(tensor, split.first, split.count, 0, width, split.local)

    def dense_weight(self) -> Tensor:
        """The table as a float matrix (a dequantised copy when quantised)."""
        return self.weight.detach() if self.qweight is None else dequantize(self.qweight)

    def forward(self, token_ids: Tensor) -> Tensor:
        if self.sharded:
            local = token_ids - self.split.first
            mine = (local >= 0) & (local < self.split.count)
            rows = self._lookup(torch.where(mine, local, 0))
            return all_reduce(rows * mine.unsqueeze(-1))
        return self._lookup(token_ids)

    def _lookup(self, token_ids: Tensor) -> Tensor:
        """The rows of `token_ids` in the table this rank holds."""
        if self.qweight is None:
            return F.embedding(token_ids, self.weight)
        rows = dequantize_rows(self.qweight, token_ids.reshape(-1))
        return rows.to(self.dtype).view(*token_ids.shape, -1)

    def logits(self, hidden: Tensor) -> Tensor:
        """`hidden @ table.T`: the LM head of a model with tied embeddings (on rank 0 under
        tensor parallelism)."""
        if self.qweight is None:
            logits = float_linear(hidden, self.weight, None)
        else:
            logits = quantized_linear(hidden, self.qweight, None)
        return gather_last_dim(logits, self.checkpoint_shape[0]) if self.sharded else logits
