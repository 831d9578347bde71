"""Linear: every projection of a model, the one place that owns weight loading and the matmul.

A projection may hold several checkpoint tensors stacked along its output: q/k/v are one
`Linear` with parts `("q_proj", "k_proj", "v_proj")`, gate/up one with `("gate_proj",
"up_proj")`, so a layer runs two large matmuls where it ran five small ones (as vLLM and
nano-vllm fuse them). Each part is loaded into its rows by `load`; the loader asks
`checkpoint_parts` which checkpoint names feed which part, so the model code never sees how a
checkpoint was split.

How the product is computed is the layer's `LinearMethod`: a dense float matrix, or (after
`quantize(scheme)`) one `QuantizedTensor` kept at 4 or 8 bits, or a tensor-parallel shard. A
quantised layer collects its parts as they load (a GGUF file's blocks, re-packed exactly, or
float tensors it quantises itself) and packs them into one tensor when the last arrives, so a
fused projection stays one matmul even when a file stores its parts in different formats.

Under tensor parallelism (a layer built inside `parallel.group.sharding`) a layer declared
`parallel="column"` keeps its rank's rows of every part (`part_units` says how many heads a
part holds, so q/k/v split by heads; the `replicated_parts`, K and V, keep one head each when
they have fewer than the ranks, while every other part must split evenly, query heads too:
each rank's o_proj takes whole heads; see `parallel/split.py`), and with `gather_output`
(the LM head) the ranks' outputs are gathered on rank 0; `parallel="row"` keeps its rank's
input columns and all-reduces the product. The checkpoint tensors still arrive whole:
`part_shape` names their whole shape and `load` cuts the rank's slice. A quantised layer
cuts its shard of each part as the part arrives, still quantised (`QuantizedTensor.shard`:
rows, and input columns in whole groups), so every rank multiplies the file's own blocks with
the same kernels as one process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from pagedkv.model.lora import add_lora
from pagedkv.parallel.collectives import all_reduce, gather_last_dim
from pagedkv.parallel.group import building_group
from pagedkv.parallel.split import (
    NotDivisible,
    Split,
    split_even,
    split_or_replicate,
    split_padded,
)
from pagedkv.quant.formats import QuantizedTensor, padded_shard
from pagedkv.quant.matmul import (
    as_dense,
    dequantize,
    float_linear,
    kernel_layout,
    quantized_linear,
)
from pagedkv.quant.quantize import GROUP_SIZE, common_layout, to_scheme


class LinearMethod(ABC):
    """How a `Linear` multiplies: the weight layout it keeps and the matmul that reads it."""

    @abstractmethod
    def apply(self, layer: Linear, x: Tensor) -> Tensor:
        """`x @ W.T + b` for `x` `[num_tokens, in_features]`."""


class DenseMethod(LinearMethod):
    """Weights kept as one floating-point matrix in the model's dtype."""

    def apply(self, layer: Linear, x: Tensor) -> Tensor:
        return float_linear(x, layer.weight, layer.bias)


class QuantizedMethod(LinearMethod):
    """Weights kept as one `QuantizedTensor` (`layer.qweight`), multiplied by `quant.matmul`."""

    def apply(self, layer: Linear, x: Tensor) -> Tensor:
        return quantized_linear(x, layer.qweight, layer.bias)


class RowParallelMethod(LinearMethod):
    """This rank's input columns (float or quantised) times its slice of `x`, plus the LoRA
    products of that slice (its share of A: `model/lora.py`), summed over the ranks, then the
    bias (whole on every rank, so added once, after the sum)."""

    def apply(self, layer: Linear, x: Tensor) -> Tensor:
        out = all_reduce(layer.add_lora(x, _local_product(layer, x, None)))
        return out if layer.bias is None else out + layer.bias


class GatheredColumnMethod(LinearMethod):
    """This rank's output rows (float or quantised), gathered with the other ranks' on rank 0
    (the LM head)."""

    def apply(self, layer: Linear, x: Tensor) -> Tensor:
        out = _local_product(layer, x, layer.bias)
        return gather_last_dim(out, layer.full_out_features)


def _local_product(layer: Linear, x: Tensor, bias: Tensor | None) -> Tensor:
    """`x` times the weight this rank holds, whichever way it is kept."""
    if layer.qweight is not None:
        return quantized_linear(x, layer.qweight, bias)
    return float_linear(x, layer.weight, bias)


DENSE = DenseMethod()
QUANTIZED = QuantizedMethod()
ROW_PARALLEL = RowParallelMethod()
GATHERED_COLUMN = GatheredColumnMethod()
Parallel = Literal["column", "row"]


class Linear(nn.Module):
    """`y = x W^T + b`, W stacked from one checkpoint tensor per entry of `parts`.

    `parts` names the checkpoint modules whose weights are stacked, in output order, each with
    its number of output rows (`part_sizes`); a plain projection has one part, its own name.
    Parameters are allocated uninitialised, in the current default dtype and device: the
    loader fills every row. `parallel`, `part_units`, `replicated_parts` and `gather_output`
    say how the layer splits under tensor parallelism (see the module docstring); outside
    `sharding` they do nothing.
    """

    def __init__(
        self,
        in_features: int,
        part_sizes: Sequence[int],
        *,
        bias: bool,
        parts: Sequence[str] | None = None,
        method: LinearMethod = DENSE,
        parallel: Parallel | None = None,
        part_units: Sequence[int] | None = None,
        replicated_parts: Sequence[str] = (),
        gather_output: bool = False,
    ) -> None:
        super().__init__()
        if parts is not None and len(parts) != len(part_sizes):
            raise ValueError(f"{len(parts)} part names for {len(part_sizes)} part sizes")
        group = building_group()
        self.parallel = parallel if group.size > 1 else None
        # The checkpoint's shapes, whole; the parameters below hold this rank's slice of them.
        self.full_in_features = in_features
        self.full_part_sizes = tuple(part_sizes)
        self.full_out_features = sum(self.full_part_sizes)
        units = tuple(part_units) if part_units is not None else self.full_part_sizes
        # Per part, the checkpoint rows this rank keeps (column-parallel) and where they go.
        self.row_splits: tuple[tuple[int, int, int], ...] = tuple(
            (0, size, size) for size in self.full_part_sizes
        )
        self.col_split = (0, in_features)
        if self.parallel == "column":
            names = parts if parts is not None else [None] * len(self.full_part_sizes)
            self.row_splits = tuple(
                _rows(
                    _column_split(
                        unit_count,
                        group.rank,
                        group.size,
                        gather_output,
                        what,
                        replicable=name in replicated_parts,
                    ),
                    size // unit_count,
                )
                for size, unit_count, what, name in zip(
                    self.full_part_sizes,
                    units,
                    _unit_names(parts, part_units),
                    names,
                    strict=True,
                )
            )
            method = GATHERED_COLUMN if gather_output else method
        elif self.parallel == "row":
            split = split_even(
                in_features, group.rank, group.size, "input features of a row-parallel projection"
            )
            self.col_split = (split.first, split.count)
            method = ROW_PARALLEL
        self.in_features = self.col_split[1]
        self.part_sizes = tuple(local for _, _, local in self.row_splits)
        self.parts = None if parts is None else tuple(parts)
        self.out_features = sum(self.part_sizes)
        self.method = method
        self.dtype = torch.get_default_dtype()
        self.weight: nn.Parameter | None = nn.Parameter(
            torch.empty(self.out_features, self.in_features)
        )
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None
        self.qweight: QuantizedTensor | None = None
        self.scheme: str | None = None  # see `quantize`
        # A scheme was asked for, but groups of GROUP_SIZE do not tile this layer's input:
        # it stays float (as it would in one process: a rank's share that cuts groups the
        # whole input has is refused, `_refuse_cut_groups`).
        self.kept_float = False
        self._pending: list[Tensor | QuantizedTensor | None] = []
        # (layer index, checkpoint parts) when the model adapts it with LoRA (`model/lora.py`).
        self.lora_target: tuple[int, tuple[str, ...]] | None = None

    def forward(self, x: Tensor) -> Tensor:
        out = self.method.apply(self, x)
        return out if self.method is ROW_PARALLEL else self.add_lora(x, out)

    def add_lora(self, x: Tensor, out: Tensor) -> Tensor:
        """`out` (this rank's product of `x`) with the step's LoRA products of this projection
        added, when the model adapts it (`model/lora.py`)."""
        if self.lora_target is None:
            return out
        layer, parts = self.lora_target
        return add_lora(layer, parts, self.part_sizes, x, out)

    def checkpoint_parts(self, own_name: str) -> tuple[str, ...]:
        """Checkpoint module names whose tensors fill this layer, in row order.

        `own_name` is this module's last name component (`qkv_proj`): a plain projection is
        filled by the checkpoint tensor of the same name.
        """
        return (own_name,) if self.parts is None else self.parts

    def part_shape(self, param_name: str, part: int) -> tuple[int, ...]:
        """The shape the checkpoint tensor of `part` must have for `weight` or `bias`."""
        rows = self.full_part_sizes[part]
        return (rows, self.full_in_features) if param_name == "weight" else (rows,)

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
        A tensor-parallel shard keeps its slice of each part as the part arrives.
        """
        self.scheme = scheme
        self.weight = None
        self._pending = [None] * len(self.part_sizes)
        self.kept_float = scheme != "auto" and bool(self.in_features % GROUP_SIZE)
        if self.kept_float and self.full_in_features % GROUP_SIZE == 0:
            self._refuse_cut_groups()

    @torch.no_grad()
    def load(self, param_name: str, part: int, tensor: Tensor | QuantizedTensor) -> None:
        """Put checkpoint tensor `tensor` (already shape-checked) into part `part`'s rows (this
        rank's slice of them under tensor parallelism)."""
        if param_name == "weight" and self.scheme is not None:
            if isinstance(tensor, QuantizedTensor) and self.in_features % GROUP_SIZE:
                self._refuse_cut_groups()  # a file's groups tile its whole input
            self._pending[part] = self._shard(tensor, part)  # only this rank's slice is kept
            if all(pending is not None for pending in self._pending):
                self._pack()
            return
        if self.parallel is None:
            self.part_view(param_name, part).copy_(as_dense(tensor))
            return
        first, count, _ = self.row_splits[part]
        dense = as_dense(tensor)[first : first + count]
        if param_name == "weight":
            dense = dense[:, self.col_split[0] : self.col_split[0] + self.col_split[1]]
        view = self.part_view(param_name, part)
        view[:count].copy_(dense)
        view[count:].zero_()  # a padded vocabulary's rows past its end

    def _pack(self) -> None:
        """Every part has arrived: stack them (this rank's slice of each) into the layer's one
        weight."""
        parts, self._pending = self._pending, []
        all_float = not any(isinstance(part, QuantizedTensor) for part in parts)
        local = self.method if self.parallel == "row" or self.method is GATHERED_COLUMN else None
        if (self.scheme == "auto" and all_float) or self.in_features % GROUP_SIZE:
            dense = torch.cat([as_dense(part) for part in parts])
            self.weight = nn.Parameter(dense.to(self.dtype), requires_grad=False)
            self.method = local or DENSE
            return
        self.qweight = kernel_layout(common_layout([to_scheme(p, self.scheme) for p in parts]))
        self.method = local or QUANTIZED

    def _shard(self, part: Tensor | QuantizedTensor, index: int) -> Tensor | QuantizedTensor:
        """This rank's rows and input columns of part `index` (all of it outside tensor
        parallelism), padded with zero rows to its local size; still quantised (`load` let
        through only shares of whole groups)."""
        if self.parallel is None:
            return part
        first, count, local = self.row_splits[index]
        return padded_shard(part, first, count, *self.col_split, local)

    def _refuse_cut_groups(self) -> None:
        """A rank's share of the input cuts the groups one process would quantise it in: its
        float product would not be that process's (vLLM refuses this split too)."""
        ranks = self.full_in_features // self.in_features
        raise NotDivisible(
            f"a row-parallel projection's {self.full_in_features} inputs give each of "
            f"tensor_parallel_size ({ranks}) ranks {self.in_features}, not whole groups of "
            f"{GROUP_SIZE}, so its quantised weights cannot be split: choose a "
            f"tensor_parallel_size that gives each rank a multiple of {GROUP_SIZE} inputs, "
            "or quantization 'none'"
        )


def _column_split(
    units: int, rank: int, group_size: int, padded: bool, what: str, *, replicable: bool
) -> Split:
    """Rank `rank`'s heads (or channels, or vocabulary rows) of one part of `units` units:
    padded (a vocabulary), replicated where `replicable` allows it, else an even split."""
    if padded:
        return split_padded(units, rank, group_size)
    if replicable:
        return split_or_replicate(units, rank, group_size, what)
    return split_even(units, rank, group_size, what)


def _unit_names(parts: Sequence[str] | None, part_units: Sequence[int] | None) -> list[str]:
    """How errors name each part's units: "heads of k_proj", "output rows of gate_proj"."""
    unit = "heads" if part_units is not None else "output rows"
    names = parts if parts is not None else ["a column-parallel projection"]
    return [f"{unit} of {name}" for name in names]


def _rows(split: Split, unit_size: int) -> tuple[int, int, int]:
    """`(first row, rows kept, local rows)` of a split of units of `unit_size` rows each."""
    return split.first * unit_size, split.count * unit_size, split.local * unit_size
