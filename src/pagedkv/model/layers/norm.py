"""RMSNorm, as every Llama-family model applies it."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pagedkv.kernels import native


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in float32 whatever the
    activations' dtype, then scaled by a learned weight.

    On the CPU the C kernel (`kernels/rowwise.c`) normalises each row with one fixed order of
    sums, so a row's result never depends on the other rows of the call (torch may split a
    reduction across threads when there are few rows). 16-bit activations follow
    transformers' order: normalise in float32, round to the dtype, then scale.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        float32 = x.dtype == torch.float32 and self.weight.dtype == torch.float32
        kernels = native.cpu_kernels(x)
        if kernels is None:
            return self._torch_forward(x, float32)
        cols = x.shape[-1]
        rows = x.reshape(-1, cols)
        if rows.dtype != torch.float32 or rows.stride(1) != 1:
            rows = rows.to(torch.float32).contiguous()
        out = torch.empty(rows.shape, dtype=torch.float32)
        weight = self.weight.data_ptr() if float32 else None
        kernels.rms_norm(
            rows.data_ptr(), rows.stride(0), rows.shape[0], cols, weight, self.eps, out.data_ptr()
        )
        out = out.view(x.shape)
        return out if float32 else self.weight * out.to(x.dtype)

    def _torch_forward(self, x: Tensor, float32: bool) -> Tensor:
        if float32:
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
