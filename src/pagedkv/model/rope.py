"""Rotary position embeddings, including Llama 3 and linear frequency scaling.

Frequencies are computed in float32 and cos/sin cast to the activations' dtype only at the
end, in the same order of operations as transformers, so float32 logits agree to ~1e-6.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pagedkv.kernels import native
from pagedkv.model.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> Tensor:
    """The `head_dim / 2` rotation frequencies, after the config's scaling, in float32 on CPU."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.scaling == "linear":
        return inv_freq / rope.factor
    if rope.scaling == "llama3":
        return _llama3_scaled(inv_freq, rope)
    return inv_freq


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin tables `[num_tokens, head_dim]` for the given absolute positions.

    On the CPU the C kernel takes libm's cosf and sinf of each angle, one scalar call per value:
    a position's table is the same bits whichever positions share the step (torch's vectorised
    cos differs from its scalar tail, and where the tail falls depends on the step's length)."""
    kernels = native.cpu_kernels(positions)
    if kernels is not None and inv_freq.dtype == torch.float32 and inv_freq.is_contiguous():
        positions = positions.to(torch.int64).contiguous()
        half = inv_freq.shape[0]
        cos = torch.empty(positions.shape[0], 2 * half, dtype=torch.float32)
        sin = torch.empty_like(cos)
        kernels.rope_tables(
            positions.data_ptr(),
            positions.shape[0],
            inv_freq.data_ptr(),
            half,
            cos.data_ptr(),
            sin.data_ptr(),
        )
        return cos.to(dtype), sin.to(dtype)
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate `x` `[num_tokens, num_heads, head_dim]` by its tokens' angles (half-split pairs)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotate_qk(query: Tensor, key: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """`apply_rope` to queries and keys; on the CPU in float32, one C call rotating both in
    place (the same floats: `kernels/rope_kv.c` rounds as these ops do)."""
    kernels = native.cpu_kernels(query, key) if _rotatable(query, key, cos, sin) else None
    if kernels is None:
        return apply_rope(query, cos, sin), apply_rope(key, cos, sin)
    for x in (query, key):
        kernels.rope(
            x.data_ptr(),
            x.shape[0],
            x.stride(0),
            x.shape[1],
            x.shape[2],
            cos.data_ptr(),
            sin.data_ptr(),
        )
    return query, key


def _rotatable(query: Tensor, key: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Whether the C kernel reads these as laid out: float32 rows of contiguous heads."""
    tables_ok = all(t.dtype == torch.float32 and t.is_contiguous() for t in (cos, sin))
    return tables_ok and all(
        x.dtype == torch.float32 and native.heads_packed(x) for x in (query, key)
    )


def _llama3_scaled(inv_freq: Tensor, rope: RopeConfig) -> Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band between
    # the two cut-offs blended smoothly, so the model reaches beyond its pre-training context.
    original = rope.original_max_position_embeddings
    low_freq_wavelen = original / rope.low_freq_factor
    high_freq_wavelen = original / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (original / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
