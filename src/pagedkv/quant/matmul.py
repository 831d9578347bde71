"""The CPU matmuls: `quantized_linear` for a QuantizedTensor W, `float_linear` for a float one.

Each is one numeric path whatever the row count, so a token's result never depends on how
many other rows share its step (prompt chunks, decode batches, a prefix-cache hit that leaves
a prompt's last few tokens alone). On the CPU with the C kernels built (`native.py`):
- quantised weights: the activations are quantised to int8 per group and multiplied by the
  weight's own bytes in integer dot products, for decode steps (4-8x fewer bytes read than
  float32 weights) and prompt chunks alike (`kernels/qmatmul.c`, tiled for many rows; a
  layer's weights in the panel layout where the kernels use AVX-512 VNNI, `kernel_layout`);
- float32, bfloat16 and float16 weights: `kernels/fmatmul.c`, with a fixed order of sums over
  the input features, where BLAS changes its blocking with the row count.
Activations are float32 inside; a 16-bit model's come back rounded to its dtype. Elsewhere (a
GPU, no C compiler) torch computes the product: correct, not batch-invariant.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedkv.kernels import native
from pagedkv.quant import panels
from pagedkv.quant.formats import QuantizedTensor

# What fmatmul.c reads for each weight dtype.
_FLOAT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def quantized_linear(x: Tensor, weight: QuantizedTensor, bias: Tensor | None) -> Tensor:
    """`x @ W.T + b` for `x` `[..., in_features]`, in `x`'s dtype."""
    kernels = native.kernels() if uses_kernels(x, weight) else None
    if kernels is None:
        return F.linear(x, weight.dequantize(x.dtype), bias)
    rows, cols = weight.shape
    flat, bias = _float32_rows(x, cols), _float32_bias(bias)
    out = torch.empty(flat.shape[0], rows, dtype=torch.float32)
    qmatmul_into(kernels, flat, weight, bias, out)
    return _shaped(out, x)


def qmatmul_into(
    kernels: native.Kernels, flat: Tensor, weight: QuantizedTensor, bias: Tensor | None, out: Tensor
) -> None:
    """`out = flat @ W.T + b` in the C kernel for the weight's layout: `flat` `[m, in]`, `bias`
    and `out` `[m, out]` float32 and contiguous (bench/matmul_bench.py times this call alone)."""
    values, scales, mins, half, has_mins = weight.pointers
    head = (flat.data_ptr(), flat.shape[0], weight.shape[1], values, scales, mins, half, has_mins)
    tail = (weight.shape[0], None if bias is None else bias.data_ptr(), out.data_ptr())
    if weight.layout == "panels":
        status = kernels.qmatmul_panels(*head, weight.bits, *tail)
    else:
        status = kernels.qmatmul(*head, weight.bits, weight.group_size, *tail)
    if status != 0:
        raise MemoryError(f"quantised matmul of {tuple(flat.shape)} by {weight.shape}: no memory")


def float_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """`x @ W.T + b` for a float `weight` `[out_features, in_features]`, in `x`'s dtype."""
    kernels = native.cpu_kernels(x, weight) if _float_kernel_takes(weight) else None
    if kernels is None:
        return F.linear(x, weight, bias)
    rows, cols = weight.shape
    flat, bias = _float32_rows(x, cols), _float32_bias(bias)
    out = torch.empty(flat.shape[0], rows, dtype=torch.float32)
    status = kernels.fmatmul(
        flat.data_ptr(),
        flat.shape[0],
        cols,
        weight.data_ptr(),
        _FLOAT_CODES[weight.dtype],
        rows,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
    )
    if status != 0:
        raise MemoryError(f"matmul of {tuple(flat.shape)} by {tuple(weight.shape)}: no memory")
    return _shaped(out, x)


def kernel_layout(weight: QuantizedTensor) -> QuantizedTensor:
    """The weight in the layout this machine's kernels multiply fastest: the panel layout
    where they are built for AVX-512 VNNI (groups of 32, whole panels of rows, so no byte is
    added), else as it is. Both give the same bits, so the choice changes the speed only."""
    kernels = native.kernels() if weight.kernel_ready else None
    rows, _ = weight.shape
    if kernels is None or not kernels.panels or weight.group_size != panels.GROUP:
        return weight
    return weight.in_panels() if rows % panels.PANEL_ROWS == 0 else weight


def dequantize(weight: QuantizedTensor) -> Tensor:
    """The weight as a new float32 tensor, by the C kernel where it runs."""
    kernels = native.kernels() if weight.kernel_ready and weight.layout == "kernel" else None
    if kernels is None:
        return weight.dequantize()
    rows, cols = weight.shape
    dense = torch.empty(rows, cols, dtype=torch.float32)
    kernels.dequantize(
        weight.values.data_ptr(),
        weight.scales.data_ptr(),
        weight.mins.data_ptr(),
        int(weight.half_scales),
        weight.bits,
        weight.group_size,
        rows,
        cols,
        dense.data_ptr(),
    )
    return dense


def dequantize_rows(weight: QuantizedTensor, index: Tensor) -> Tensor:
    """Rows `index` (1-d int64) of the weight as a new float32 tensor `[len(index), cols]`,
    dequantised as `dequantize` does: by one C call that reads those rows' bytes in either
    layout where the kernels run. A decode step's embedding lookup took ~20 tensor ops gathering
    the rows out of the panels (0.2 ms a step, inside the engine, where the layers have just left
    the cores' caches)."""
    kernels = native.kernels() if weight.kernel_ready else None
    if kernels is None or index.device.type != "cpu":
        return weight.rows(index).dequantize()
    index = index.to(torch.int64).contiguous()
    rows, cols = weight.shape
    out = torch.empty(len(index), cols, dtype=torch.float32)
    values, scales, mins, half, _ = weight.pointers
    status = kernels.dequantize_rows(
        values,
        scales,
        mins,
        half,
        weight.bits,
        weight.group_size,
        rows,
        cols,
        int(weight.layout == "panels"),
        *weight.scales.stride(),
        index.data_ptr(),
        len(index),
        out.data_ptr(),
    )
    if status != 0:
        raise IndexError(f"row index out of range for a weight of {rows} rows")
    return out


def as_dense(tensor: Tensor | QuantizedTensor) -> Tensor:
    """A float tensor as it is, a quantised one dequantised (`dequantize`)."""
    return dequantize(tensor) if isinstance(tensor, QuantizedTensor) else tensor


def uses_kernels(x: Tensor, weight: QuantizedTensor) -> bool:
    """Whether the C kernels can take this product: CPU tensors, columns in chunks of 32."""
    return x.device.type == "cpu" and weight.kernel_ready


def _float_kernel_takes(weight: Tensor) -> bool:
    """Whether fmatmul.c reads this weight: a packed matrix of a dtype it knows."""
    return weight.dtype in _FLOAT_CODES and weight.dim() == 2 and weight.is_contiguous()


def _float32_rows(x: Tensor, cols: int) -> Tensor:
    """`x` as packed float32 rows `[tokens, cols]` (a view when it already is)."""
    flat = x.reshape(-1, cols)
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        flat = flat.to(torch.float32).contiguous()
    return flat


def _float32_bias(bias: Tensor | None) -> Tensor | None:
    """The bias as the kernels read it: packed float32 (a 16-bit one converted, exactly)."""
    return None if bias is None else bias.to(torch.float32).contiguous()


def _shaped(out: Tensor, x: Tensor) -> Tensor:
    """The kernel's float32 `[tokens, n]` in `x`'s leading shape and dtype."""
    out = out.view(*x.shape[:-1], out.shape[-1])
    return out if x.dtype == torch.float32 else out.to(x.dtype)
