"""Linear: every projection of a model, the one place that owns weight loading and the matmul.

A projection may hold several checkpoint tensors stacked along its output: q/k/v are one
`Linear` with parts `("q_proj", "k_proj", "v_proj")`, gate/up one with `("gate_proj",
"up_proj")`, so a layer runs two large matmuls where it ran five small ones (as vLLM and
nano-vllm fuse them). Each part is loaded into its rows by `load`; the loader asks
`checkpoint_parts` which checkpoint names feed which part, so the model code never sees how a
checkpoint was split.

How the product is computed is the layer's `LinearMethod`: a dense float matrix, or (after
`quantize(scheme)`) one `QuantizedTensor` kept at 4 or 8 bits; tensor-parallel shards would
be a further method behind the same `forward`. A quantised layer collects its parts as they
load (a GGUF file's blocks, re-packed exactly, or float tensors it quantises itself) and packs
them into one tensor when the last arrives, so a fused projection stays one matmul even when
a file stores its parts in different formats.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedkv.quant.formats import QuantizedTensor
from pagedkv.quant.matmul import as_dense, dequantize, quantized_linear
from pagedkv.quant.quantize import GROUP_SIZE, common_layout, to_scheme


class LinearMethod(ABC):
    """How a `Linear` multiplies: the weight layout it keeps and the matmul that reads it."""

    @abstractmethod
    def apply(self, layer: Linear, x: Tensor) -> Tensor:
        """`x @ W.T + b` for `x` `[num_tokens, in_features]`."""


class DenseMethod(LinearMethod):
    """Weights kept as one floating-point matrix in the model's dtype."""

    def apply(self, layer: Linear, x: Tensor) -> Tensor:
        return F.linear(x, layer.weight, layer.bias)


class QuantizedMethod(LinearMethod):
    """Weights kept as one `QuantizedTensor` (`layer.qweight`), multiplied by `quant.matmul`."""

    def apply(self, layer: Linear, x: Tensor) -> Tensor:
        return quantized_linear(x, layer.qweight, layer.bias)


DENSE = DenseMethod()
QUANTIZED = QuantizedMethod()


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
        self.dtype = torch.get_default_dtype()
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(self.out_features, in_features))
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None
        self.qweight: QuantizedTensor | None = None
        self.scheme: str | None = None  # see `quantize`
        self._pending: list[Tensor | QuantizedTensor | None] = []

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
        """The rows of `weight` (dequantised if quantised) or `bias` that part `part` fills."""
        start = sum(self.part_sizes[:part])
        if param_name == "weight" and self.qweight is not None:
            return dequantize(self.qweight)[start : start + self.part_sizes[part]]
        return getattr(self, param_name)[start : start + self.part_sizes[part]]

    def quantize(self, scheme: str) -> None:
        """Keep the weight quantised from now on; call before loading.

        `scheme` "int8" or "int4" quantises every part to that layout (a file's own blocks
        are dequantised and quantised again); "auto" keeps quantised parts as they come and
        stays dense if every part arrives in floating point. The dense matrix allocated at
        construction was never written, so dropping it frees memory that was never touched.
        """
        self.scheme = scheme
        self.weight = None
        self._pending = [None] * len(self.part_sizes)

    @torch.no_grad()
    def load(self, param_name: str, part: int, tensor: Tensor | QuantizedTensor) -> None:
        """Put checkpoint tensor `tensor` (already shape-checked) into part `part`'s rows."""
        if param_name == "weight" and self.scheme is not None:
            self._pending[part] = tensor
            if all(pending is not None for pending in self._pending):
                self._pack()
            return
        self.part_view(param_name, part).copy_(as_dense(tensor))

    def _pack(self) -> None:
        """Every part has arrived: stack them into the layer's one weight."""
        parts, self._pending = self._pending, []
        all_float = not any(isinstance(part, QuantizedTensor) for part in parts)
        if (self.scheme == "auto" and all_float) or self.in_features % GROUP_SIZE:
            dense = torch.cat([as_dense(part) for part in parts]).to(self.dtype)
            self.weight = nn.Parameter(dense, requires_grad=False)
            self.method = DENSE
            return
        self.qweight = common_layout([to_scheme(part, self.scheme) for part in parts])
        self.method = QUANTIZED
