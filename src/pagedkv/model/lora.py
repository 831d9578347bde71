"""LoRA in a forward pass: each row gets its own adapter's products, in one pass for all.

A step may mix requests of several adapters and of none. The model's resident adapters
(`DecoderModel.lora_adapters`, by id: views of their matrices where the worker put them, in
the KV pool's blocks) and the batch's per-sequence adapter ids make a `LoRAStep`: the rows of
each adapter. Every adapted projection then adds, for each adapter's rows only,

    out[rows, part] += ((x[rows] A^T) B^T) * scaling

a segmented gather-matmul, never a forward per adapter. A projection's parts have their A
matrices stacked (`t = x A^T` for q, k and v in one `quant.matmul.float_linear`: a product of
16 columns is mostly overhead) and B kept transposed (`[rank, out]`): `t B^T` is the rank's
rows of B^T scaled by t's columns and added in order, with no reduction however small the rank.
`float_linear` is, on the CPU, the C kernel whose result for a row never depends on the other
rows, and the rest is per element, so a request's output does not depend on which adapters, if
any, its neighbours use. A quantised base weight stays quantised: the products are added in
float32 to its output.

Under tensor parallelism each rank holds its share of an adapter as its `Linear` holds the
base weight (`lora_slices`): B's rows of a column-parallel projection (q/k/v, gate/up: the
rank's heads or channels) with A whole, A's input columns of a row-parallel one (o, down)
with B whole. A column-parallel product is then the rank's own columns of the whole one; a
row-parallel one is a partial sum, added to the rank's partial product before the all-reduce
sums both (`Linear`), so the bias and the sum stay as without LoRA.

On the CPU one C call per projection does it all (`kernels/lora.c`, the same arithmetic as the
torch loop here, which serves other devices), from the tables `LoRAStep` lays out; the one-call
C decode of the layers (`fused_decode.py`) calls it too (`fused_lora`), so either path gives the
same floats.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

from pagedkv.attention.batch import ForwardBatch
from pagedkv.kernels import native
from pagedkv.kvmath.lora import PROJECTIONS, TARGETS
from pagedkv.quant.matmul import float_linear


@dataclass(frozen=True)
class LoRAPart:
    """One adapted part of a projection: its index among the projection's parts, where its
    rank's columns start in the stacked A product, B transposed `[rank, out]`, its scaling."""

    index: int
    rank_offset: int
    b_t: Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.b_t.shape[0]


@dataclass(frozen=True)
class ProjectionLoRA:
    """An adapter's parts of one projection: their A matrices stacked `[sum of ranks, in]`."""

    a: Tensor
    parts: list[LoRAPart]


class AdapterWeights:
    """A resident adapter: per (layer, projection's parts) its `ProjectionLoRA` (float32 views
    into the pool); and, made once per projection, the table of them the C kernel reads."""

    def __init__(
        self, projections: Mapping[tuple[int, tuple[str, ...]], ProjectionLoRA], num_layers: int
    ) -> None:
        self.projections = projections
        self.num_layers = num_layers
        self._kernel_arrays: list[ctypes.Array] = []  # kept alive: the tables point into them
        self._tables: dict[tuple[str, ...], np.ndarray] = {}

    def kernel_table(self, parts: tuple[str, ...]) -> np.ndarray:
        """Per layer, `(a, total rank, parts array, number of parts)` as `lora.c` reads them
        (all 0 where the layer does not adapt this projection)."""
        table = self._tables.get(parts)
        if table is None:
            table = np.zeros((self.num_layers, 4), dtype=np.int64)
            for layer in range(self.num_layers):
                projection = self.projections.get((layer, parts))
                if projection is None:
                    continue
                array = (native.LoRAPartArgs * len(projection.parts))(
                    *(
                        native.LoRAPartArgs(
                            part.b_t.data_ptr(),
                            part.rank,
                            part.rank_offset,
                            part.index,
                            part.scaling,
                        )
                        for part in projection.parts
                    )
                )
                self._kernel_arrays.append(array)
                a = projection.a
                table[layer] = (a.data_ptr(), a.shape[0], ctypes.addressof(array), len(array))
            self._tables[parts] = table
        return table


@dataclass(frozen=True)
class LoRAStep:
    """The step's adapted rows: per adapter, its weights and its rows of the batch; and, made
    on first use, per projection the `lora.c` groups of every layer."""

    groups: tuple[tuple[AdapterWeights, Tensor], ...]
    # Per projection's parts, and per run of layers ("layers", start, stop): made on first use.
    tables: dict[tuple, np.ndarray] = field(default_factory=dict, compare=False)

    def kernel_groups(self, layer: int, parts: tuple[str, ...]) -> int | None:
        """The address of layer `layer`'s `LoRAGroup`s for the projection of `parts` (one per
        adapter), or None when no adapter of the step adapts it there."""
        table = self.tables.get(parts)
        if table is None:
            # [layer, adapter, (rows, num_rows, a, total rank, parts, num parts)]: lora.c's
            # LoRAGroup, six int64s
            table = np.empty((self.groups[0][0].num_layers, len(self.groups), 6), dtype=np.int64)
            for index, (adapter, rows) in enumerate(self.groups):
                table[:, index, 0] = rows.data_ptr()
                table[:, index, 1] = rows.numel()
                table[:, index, 2:] = adapter.kernel_table(parts)
            self.tables[parts] = table
        if not table[layer, :, 2].any():
            return None
        return table.ctypes.data + table.strides[0] * layer

    def layers_table(self, start: int, stop: int) -> np.ndarray:
        """Layers `[start, stop)`'s groups per projection (`PROJECTIONS` order; 0: none), as
        the one-call C decode (`kernels/decode_layer.c`) reads them."""
        key = ("layers", start, stop)
        table = self.tables.get(key)
        if table is None:
            table = np.array(
                [
                    [self.kernel_groups(layer, parts) or 0 for parts in PROJECTIONS]
                    for layer in range(start, stop)
                ],
                dtype=np.int64,
            )
            self.tables[key] = table
        return table


_STEP: ContextVar[LoRAStep | None] = ContextVar("lora_step", default=None)


@contextmanager
def lora_step(adapters: Mapping[int, AdapterWeights], batch: ForwardBatch) -> Iterator[None]:
    """Make the batch's adapted rows the current LoRA step inside the block (none when no
    sequence has an adapter)."""
    step = _step_of(adapters, batch)
    token = _STEP.set(step)
    try:
        yield
    finally:
        _STEP.reset(token)


def fused_lora(start: int, stop: int) -> tuple[int, int] | None:
    """For the one-call C decode of layers `[start, stop)`: the address of their LoRA groups
    table and the number of groups, or None when the step has no adapted row."""
    step = _STEP.get()
    if step is None:
        return None
    table = step.layers_table(start, stop)
    return table.ctypes.data, len(step.groups)


def add_lora(
    layer: int, parts: Sequence[str], part_sizes: Sequence[int], x: Tensor, out: Tensor
) -> Tensor:
    """`out` (`x`'s projection, `[rows, sum(part_sizes)]`) with each adapted row's LoRA
    products of layer `layer`'s `parts` added to their columns."""
    step = _STEP.get()
    if step is None:
        return out
    kernels = native.cpu_kernels(x, out)
    if kernels is not None and _kernel_reads(x, out):
        groups = step.kernel_groups(layer, tuple(parts))
        if groups is not None:
            sizes = _part_sizes(tuple(part_sizes))
            args = (x.data_ptr(), x.shape[1], len(step.groups), groups, len(parts), sizes)
            if kernels.lora_add(*args, out.data_ptr(), out.shape[1]) != 0:
                raise MemoryError(f"LoRA products of {x.shape[0]} rows: no scratch memory")
        return out
    offsets = [sum(part_sizes[:i]) for i in range(len(part_sizes))]
    for adapter, rows in step.groups:
        projection = adapter.projections.get((layer, tuple(parts)))
        if projection is None:
            continue
        t = float_linear(x.index_select(0, rows).to(torch.float32), projection.a, None)
        for part in projection.parts:
            own = t[:, part.rank_offset : part.rank_offset + part.rank]
            delta = own[:, :1] * part.b_t[0]
            for k in range(1, part.rank):
                delta = delta + own[:, k : k + 1] * part.b_t[k]
            columns = slice(offsets[part.index], offsets[part.index] + part_sizes[part.index])
            out[rows, columns] = out[rows, columns] + (delta * part.scaling).to(out.dtype)
    return out


@functools.cache
def _part_sizes(sizes: tuple[int, ...]) -> ctypes.Array:
    """A projection's part sizes as lora.c reads them (one array per shape, kept)."""
    return (ctypes.c_int64 * len(sizes))(*sizes)


def _kernel_reads(x: Tensor, out: Tensor) -> bool:
    """Whether lora.c reads these: packed float32 rows."""
    return (
        x.dtype == out.dtype == torch.float32
        and x.dim() == out.dim() == 2
        and x.is_contiguous()
        and out.is_contiguous()
    )


@dataclass(frozen=True)
class RankSlice:
    """This rank's share of one adapted checkpoint part, as its `Linear` keeps the base weight:
    output rows `(first, count, local)` (B's rows; local rows past `count` are zeros) and
    input columns `(first, count)` (A's columns). Whole in one process."""

    rows: tuple[int, int, int]
    columns: tuple[int, int]


def lora_slices(model: nn.Module) -> dict[tuple[int, str], RankSlice]:
    """Per (layer, checkpoint part) that LoRA may adapt, this rank's share of it: what an
    adapter is cut to before it is written into this rank's blocks."""
    slices = {}
    for module in model.modules():
        target = getattr(module, "lora_target", None)
        if target is None:
            continue
        layer, parts = target
        for part, rows in zip(parts, module.row_splits, strict=True):
            slices[(layer, part)] = RankSlice(rows, module.col_split)
    return slices


def name_lora_targets(layer: nn.Module, index: int) -> None:
    """Tell each projection of decoder layer `index` whose checkpoint parts are all LoRA
    targets (q/k/v, o, gate/up, down) its layer index and parts, so it adds their products."""
    for name, module in layer.named_modules():
        if not hasattr(module, "checkpoint_parts"):
            continue
        parts = module.checkpoint_parts(name.rsplit(".", 1)[-1])
        if all(part in TARGETS for part in parts):
            module.lora_target = (index, parts)


def _step_of(adapters: Mapping[int, AdapterWeights], batch: ForwardBatch) -> LoRAStep | None:
    ids = batch.host_lora_ids
    if not any(ids):
        return None
    rows: dict[int, list[int]] = {}
    first = 0
    for lora_id, length in zip(ids, batch.host_query_lens, strict=True):
        if lora_id:
            rows.setdefault(lora_id, []).extend(range(first, first + length))
        first += length
    device = batch.input_ids.device
    groups = []
    for lora_id, adapter_rows in rows.items():
        adapter = adapters.get(lora_id)
        if adapter is None:
            raise KeyError(f"LoRA adapter {lora_id} is not resident: the worker never loaded it")
        groups.append((adapter, torch.tensor(adapter_rows, dtype=torch.int64, device=device)))
    return LoRAStep(tuple(groups))
