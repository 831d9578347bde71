"""Linear: every projection of a model, the one place that owns weight loading and the matmul.

A projection may hold several checkpoint tensors stacked along its output: q/k/v are one
`Linear` with parts `("q_proj", "k_proj", "v_proj")`, gate/up one with `("gate_proj",
"up_proj")`, so a layer runs two large matmuls where it ran five small ones (as vLLM and
nano-vllm fuse them). Each part is loaded into its rows by `load`; the loader asks
`checkpoint_parts` which checkpoint names feed which part, so the model code never sees how a
checkpoint was split.

How the product is computed is the layer's `LinearMethod`: dense weights today; quantised
weights and tensor-parallel shards are further methods behind the same `forward`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class LinearMethod(ABC):
    """How a `Linear` multiplies: the weight layout it keeps and the matmul that reads it."""

    @abstractmethod
    def apply(self, layer: Linear, x: Tensor) -> Tensor:
        """`x @ W.T + b` for `x` `[num_tokens, in_features]`."""


class DenseMethod(LinearMethod):
    """Weights kept as one floating-point matrix in the model's dtype."""

    def apply(self, layer: Linear, x: Tensor) -> Tensor:
        return F.linear(x, layer.weight, layer.bias)


DENSE = DenseMethod()


class Linear(nn.Module):
    """`y = x W^T + b`, W stacked from one checkpoint tensor per entry of `parts`.

    `parts` names the checkpoint modules whose weights are stacked, in output order, each with
    its number of output rows (`part_sizes`); a plain projection has one part, its own name.
    Parameters are allocated uninitialised, in the current default dtype and device: the
    loader fills every row.
    """

    def __init__(
        self,
        in_features: int,
        part_sizes: Sequence[int],
        *,
        bias: bool,
        parts: Sequence[str] | None = None,
        method: LinearMethod = DENSE,
    ) -> None:
        super().__init__()
        if parts is not None and len(parts) != len(part_sizes):
            raise ValueError(f"{len(parts)} part names for {len(part_sizes)} part sizes")
        self.in_features = in_features
        self.part_sizes = tuple(part_sizes)
        self.parts = None if parts is None else tuple(parts)
        self.out_features = sum(self.part_sizes)
        self.method = method
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features))
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return self.method.apply(self, x)

    def checkpoint_parts(self, own_name: str) -> tuple[str, ...]:
        """Checkpoint module names whose tensors fill this layer, in row order.

        `own_name` is this module's last name component (`qkv_proj`): a plain projection is
        filled by the checkpoint tensor of the same name.
        """
        return (own_name,) if self.parts is None else self.parts

    def part_shape(self, param_name: str, part: int) -> tuple[int, ...]:
        """The shape the checkpoint tensor of `part` must have for `weight` or `bias`."""
        rows = self.part_sizes[part]
        return (rows, self.in_features) if param_name == "weight" else (rows,)

    def part_view(self, param_name: str, part: int) -> Tensor:
        """The rows of `weight` or `bias` that part `part`'s checkpoint tensor fills."""
        start = sum(self.part_sizes[:part])
        return getattr(self, param_name)[start : start + self.part_sizes[part]]

    @torch.no_grad()
    def load(self, param_name: str, part: int, tensor: Tensor) -> None:
        """Copy checkpoint tensor `tensor` (already shape-checked) into part `part`'s rows."""
        self.part_view(param_name, part).copy_(tensor)
