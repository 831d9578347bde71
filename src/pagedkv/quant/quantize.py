"""Float weights -> QuantizedTensor (int8 or int4, groups of 32), and mixed layouts -> one.

`--quantization int8` keeps each group of 32 weights as int8 with one scale (amax / 127,
symmetric, like Q8_0); `int4` as 4-bit values with a scale and a min (`(max - min) / 15`
and the group's min, like Q4_1), which fits groups with an offset better than a symmetric
4-bit code. Both round to nearest; their error on a model is measured by `pagedkv perplexity`.

A fused projection is one matrix whose parts may arrive in different layouts (a Q4_K_M file
stores v in Q6_K beside q and k in Q4_K); `common_layout` re-packs them losslessly into the
widest width and the smallest group of the set, so the layer runs one matmul.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from pagedkv.quant.formats import QuantizedTensor
from pagedkv.quant.schemes import SCHEMES

GROUP_SIZE = 32


def quantize(weight: Tensor, scheme: str) -> QuantizedTensor:
    """`weight` `[rows, cols]` (cols a multiple of 32) in `scheme`'s layout."""
    if scheme == "int8":
        return quantize_int8(weight)
    if scheme == "int4":
        return quantize_int4(weight)
    raise ValueError(f"quantization scheme must be one of {SCHEMES}, got {scheme!r}")


def to_scheme(tensor: Tensor | QuantizedTensor, scheme: str) -> QuantizedTensor:
    """What a checkpoint tensor is kept as under `scheme` once it is to be quantised.

    "auto" keeps a file's quantised blocks as they are and quantises a float tensor to int8
    (near-lossless: it only happens beside quantised parts of the same layer); "int8" and
    "int4" quantise every tensor to that layout, a file's blocks dequantised first.
    """
    if scheme == "auto":
        return tensor if isinstance(tensor, QuantizedTensor) else quantize_int8(tensor)
    if isinstance(tensor, QuantizedTensor):
        tensor = tensor.dequantize()
    return quantize(tensor, scheme)


def quantize_int8(weight: Tensor) -> QuantizedTensor:
    """Symmetric int8 per group of 32: `w ~ scale * q`, q in -127..127."""
    groups = _groups(weight)
    scales = groups.abs().amax(dim=-1) / 127
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round(groups / safe.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return QuantizedTensor.from_ggml(
        values.view(weight.shape[0], -1).contiguous(),
        scales.contiguous(),
        torch.zeros_like(scales),
        bits=8,
        group_size=GROUP_SIZE,
    )


def quantize_int4(weight: Tensor) -> QuantizedTensor:
    """Asymmetric 4-bit per group of 32: `w ~ scale * q + min`, q in 0..15."""
    groups = _groups(weight)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = (high - low) / 15
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((groups - low.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
    # ggml's order within a group: byte j = value j (low nibble) | value j + 16 (high nibble)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return QuantizedTensor.from_ggml(
        packed.view(weight.shape[0], -1).contiguous(),
        scales.contiguous(),
        low.contiguous(),
        bits=4,
        group_size=GROUP_SIZE,
    )


def common_layout(parts: Sequence[QuantizedTensor]) -> QuantizedTensor:
    """The parts stacked by rows into one QuantizedTensor, re-packed exactly if they differ.

    4-bit values widen to int8 unchanged, and a group of 32 becomes two groups of 16 with the
    same scale and min, so every weight keeps its exact value.
    """
    bits = max(part.bits for part in parts)
    group_size = min(part.group_size for part in parts)
    converted = [_relayout(part, bits, group_size) for part in parts]
    return QuantizedTensor(
        torch.cat([part.values for part in converted]),
        torch.cat([part.scales for part in converted]),
        torch.cat([part.mins for part in converted]),
        bits=bits,
        group_size=group_size,
    )


def _relayout(part: QuantizedTensor, bits: int, group_size: int) -> QuantizedTensor:
    if (part.bits, part.group_size) == (bits, group_size):
        return part
    values = part.ggml_values() if part.bits == bits else part.integers().to(torch.int8)
    repeat = part.group_size // group_size
    return QuantizedTensor.from_ggml(
        values.contiguous(),
        part.scales.repeat_interleave(repeat, dim=1),
        part.mins.repeat_interleave(repeat, dim=1),
        bits=bits,
        group_size=group_size,
    )


def _groups(weight: Tensor) -> Tensor:
    rows, cols = weight.shape
    if cols % GROUP_SIZE:
        raise ValueError(f"a weight with {cols} columns cannot be cut into groups of 32")
    return weight.detach().to(torch.float32).reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
