"""WeightFootprint: how many bytes a loaded model's weights hold, and in what layouts.

Printed at start (`weights: 112.4 MiB resident ...`) so the memory that quantisation saves is
a figure, not a claim: resident bytes are counted from the tensors themselves, and the
float32 size they are compared with is what the same parameters would take at 4 bytes each.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from torch import nn

from pagedkv.quant.formats import QuantizedTensor

MIB = 1 << 20


@dataclass(frozen=True)
class WeightFootprint:
    """Resident weight bytes, their float32 equivalent, and tensors per layout."""

    resident_bytes: int
    float32_bytes: int
    layouts: dict[str, int]  # "float32", "4-bit/32", "8-bit/16", ... -> number of tensors

    @property
    def ratio(self) -> float:
        """Resident bytes over the float32 size of the same parameters."""
        return self.resident_bytes / self.float32_bytes

    def describe(self) -> str:
        kinds = ", ".join(f"{count} {layout}" for layout, count in sorted(self.layouts.items()))
        return (
            f"weights: {self.resident_bytes / MIB:.1f} MiB resident ({kinds}); "
            f"{self.ratio:.2f}x their float32 size of {self.float32_bytes / MIB:.1f} MiB"
        )


def weight_footprint(model: nn.Module) -> WeightFootprint:
    """Count every parameter and every quantised weight (`qweight`) of `model`."""
    resident = float32 = 0
    layouts: Counter[str] = Counter()
    for module in model.modules():
        qweight = getattr(module, "qweight", None)
        if isinstance(qweight, QuantizedTensor):
            rows, cols = qweight.shape
            resident += qweight.nbytes
            float32 += rows * cols * 4
            layouts[f"{qweight.bits}-bit/{qweight.group_size}"] += 1
        for param in module.parameters(recurse=False):
            resident += param.numel() * param.element_size()
            float32 += param.numel() * 4
            layouts[str(param.dtype).removeprefix("torch.")] += 1
    return WeightFootprint(resident, float32, dict(layouts))
