"""The start-up line that says whether a request's output can depend on the batch around it.

On the CPU with the C kernels built, it cannot: every kernel computes a row in one fixed order
of float operations (README, "One request, one answer"). Elsewhere it can, and the line says
so, as the README does.
"""

from __future__ import annotations

import torch

from pagedkv.kernels import native


def invariance_line(device: torch.device, tensor_parallel_size: int, dtype: str) -> str:
    """`outputs: one answer per request, ...` or `outputs: may change with batching (why)`."""
    if device.type != "cpu":
        return (
            "outputs: may change with batching (GPU kernels and cuBLAS are not batch-invariant; "
            "the guarantee covers the CPU kernels)"
        )
    kernels = native.kernels()
    if kernels is None:
        return "outputs: may change with batching (no C kernels: torch fallback)"
    line = f"outputs: one answer per request, however batched (C kernels, {kernels.vector_path})"
    if tensor_parallel_size > 1:
        rounded = f", partial sums rounded to {dtype}" if dtype != "float32" else ""
        line += f"; for {tensor_parallel_size} ranks only{rounded}"
    return line
