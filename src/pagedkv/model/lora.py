"""LoRA in a forward pass: each row gets its own adapter's product, in one pass for all.

A step may mix requests of several adapters and of none. The model's resident adapters
(`DecoderModel.lora_adapters`, by id: views of their matrices where the worker put them, in
the KV pool's blocks) and the batch's per-sequence adapter ids make a `LoRAStep`: the rows of
each adapter. Every adapted projection then adds, for each adapter's rows only,

    out[rows, part] += ((x[rows] A^T) B^T) * scaling

a segmented gather-matmul: one small product pair per adapter and module, never a forward per
adapter. The products go through `quant.matmul.float_linear` (on the CPU the C kernel whose
result for a row never depends on the other rows) and the add is per element, so a request's
output does not depend on which adapters, if any, its neighbours use. A quantised base weight
stays quantised: the LoRA product is added in float32 to its output. On the CPU one C call per
projection does it all (`kernels/lora.c`, the same arithmetic); elsewhere torch, op by op.

A step with any adapted row runs the layers op by op (the one-call C decode has no LoRA), which
computes the same floats as the C decode for the rows without one (`fused_decode.py`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from pagedkv.attention.batch import ForwardBatch
from pagedkv.kernels import native
from pagedkv.quant.matmul import float_linear

# The projections an adapter may adapt, by their checkpoint names (every registry family's).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterWeights:
    """A resident adapter: per (layer, projection name) its A `[rank, in]`, B `[out, rank]`
    (float32 views) and scaling."""

    modules: Mapping[tuple[int, str], tuple[Tensor, Tensor, float]]


@dataclass(frozen=True)
class LoRAStep:
    """The step's adapted rows: per adapter, its weights and its rows of the batch; and, made
    on first use, each projection's groups as the C kernel takes them."""

    groups: tuple[tuple[AdapterWeights, Tensor], ...]
    c_groups: dict[tuple[int, tuple[str, ...]], ctypes.Array | None] = field(
        default_factory=dict, compare=False
    )

    def kernel_groups(
        self, layer: int, parts: Sequence[str], part_sizes: Sequence[int]
    ) -> ctypes.Array | None:
        """`lora.c`'s groups for layer `layer`'s projection of `parts` (None: none adapted)."""
        key = (layer, tuple(parts))
        if key not in self.c_groups:
            entries = []
            for adapter, rows in self.groups:
                offset = 0
                for part, size in zip(parts, part_sizes, strict=True):
                    module = adapter.modules.get((layer, part))
                    if module is not None:
                        a, b, scaling = module
                        entries.append(
                            native.LoRAGroupArgs(
                                rows.data_ptr(),
                                rows.numel(),
                                a.data_ptr(),
                                b.data_ptr(),
                                a.shape[0],
                                size,
                                offset,
                                scaling,
                            )
                        )
                    offset += size
            array = (native.LoRAGroupArgs * len(entries))(*entries) if entries else None
            self.c_groups[key] = array
        return self.c_groups[key]


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


def lora_active() -> bool:
    """Whether the current step has rows with an adapter."""
    return _STEP.get() is not None


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
        groups = step.kernel_groups(layer, parts, part_sizes)
        if groups is not None:
            args = (x.data_ptr(), x.shape[1], len(groups), groups, out.data_ptr(), out.shape[1])
            if kernels.lora_add(*args) != 0:
                raise MemoryError(f"LoRA products of {x.shape[0]} rows: no scratch memory")
        return out
    for adapter, rows in step.groups:
        x_rows = None
        offset = 0
        for part, size in zip(parts, part_sizes, strict=True):
            module = adapter.modules.get((layer, part))
            if module is not None:
                if x_rows is None:
                    x_rows = x.index_select(0, rows).to(torch.float32)
                a, b, scaling = module
                delta = float_linear(float_linear(x_rows, a, None), b, None) * scaling
                columns = slice(offset, offset + size)
                out[rows, columns] = out[rows, columns] + delta.to(out.dtype)
            offset += size
    return out


def _kernel_reads(x: Tensor, out: Tensor) -> bool:
    """Whether lora.c reads these: packed float32 rows."""
    return (
        x.dtype == out.dtype == torch.float32
        and x.dim() == out.dim() == 2
        and x.is_contiguous()
        and out.is_contiguous()
    )


def name_lora_targets(layer: nn.Module, index: int) -> None:
    """Tell each projection of decoder layer `index` whose checkpoint parts are all LoRA
    targets (q/k/v, o, gate/up, down) its layer index and parts, so it adds their products."""
    for name, module in layer.named_modules():
        parts = getattr(module, "checkpoint_parts", None)
        if parts is not None and all(p in TARGETS for p in parts(name.rsplit(".", 1)[-1])):
            module.lora_target = (index, parts(name.rsplit(".", 1)[-1]))


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
