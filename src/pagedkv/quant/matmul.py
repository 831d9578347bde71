"""`quantized_linear`: `x @ W.T + b` for a QuantizedTensor W, by the fastest way available.

On the CPU with the C kernels built (`native.py`), a product of few rows (decode steps: up to
`DOT_ROWS` sequences) quantises the activations to int8 per group and computes integer dot
products over the weight's own bytes, reading 4-8x fewer bytes than float32 weights; a product
of many rows (prompt chunks) is compute-bound instead, so the weight is dequantised into a
scratch buffer shared by all layers and multiplied by BLAS. Elsewhere (a GPU, no C compiler,
a column count the kernels do not take) the weight is dequantised for the call in torch.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedkv.kernels import native
from pagedkv.quant.formats import QuantizedTensor

# Up to this many rows the int8 kernel is faster than dequantise + float32 BLAS (measured at
# SmolLM2's shapes, 60 distinct 1536x576 Q4_1 weights, 2 threads: 28.5 against 34.7 ms at 32
# rows, 59.3 against 48.1 at 64). The C side takes at most 64 (MAX_DOT_ROWS).
DOT_ROWS = 32
_scratch = threading.local()


def quantized_linear(x: Tensor, weight: QuantizedTensor, bias: Tensor | None) -> Tensor:
    """`x @ W.T + b` for `x` `[..., in_features]`, in `x`'s dtype."""
    kernels = native.kernels() if uses_kernels(x, weight) else None
    if kernels is None:
        return F.linear(x, weight.dequantize(x.dtype), bias)
    rows, cols = weight.shape
    flat = x.reshape(-1, cols)
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        flat = flat.to(torch.float32).contiguous()
    if flat.shape[0] > DOT_ROWS:
        dense = _dequantized(kernels, weight)
        return F.linear(flat, dense, bias).view(*x.shape[:-1], rows).to(x.dtype)
    out = torch.empty(flat.shape[0], rows, dtype=torch.float32)
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.to(torch.float32).contiguous()
    values, scales, mins, has_mins = weight.pointers
    status = kernels.qmatmul(
        flat.data_ptr(),
        flat.shape[0],
        cols,
        values,
        scales,
        mins,
        has_mins,
        weight.bits,
        weight.group_size,
        rows,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
    )
    if status != 0:
        raise MemoryError(f"quantised matmul of {tuple(flat.shape)} by {weight.shape}: no memory")
    out = out.view(*x.shape[:-1], rows)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def dequantize(weight: QuantizedTensor) -> Tensor:
    """The weight as a new float32 tensor, by the C kernel where it runs."""
    kernels = native.kernels() if weight.values.device.type == "cpu" else None
    if kernels is None or weight.shape[1] % 32:
        return weight.dequantize()
    return _dequantized(kernels, weight).clone()


def as_dense(tensor: Tensor | QuantizedTensor) -> Tensor:
    """A float tensor as it is, a quantised one dequantised (`dequantize`)."""
    return dequantize(tensor) if isinstance(tensor, QuantizedTensor) else tensor


def uses_kernels(x: Tensor, weight: QuantizedTensor) -> bool:
    """Whether the C kernels can take this product: CPU tensors, columns in chunks of 32."""
    return x.device.type == "cpu" and weight.kernel_ready


def _dequantized(kernels: native.Kernels, weight: QuantizedTensor) -> Tensor:
    """`weight` dequantised into this thread's scratch buffer (valid until the next call)."""
    rows, cols = weight.shape
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < rows * cols:
        buffer = _scratch.buffer = torch.empty(rows * cols, dtype=torch.float32)
    dense = buffer[: rows * cols].view(rows, cols)
    kernels.dequantize(
        weight.values.data_ptr(),
        weight.scales.data_ptr(),
        weight.mins.data_ptr(),
        weight.bits,
        weight.group_size,
        rows,
        cols,
        dense.data_ptr(),
    )
    return dense
