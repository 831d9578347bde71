"""Attention: one layer's paged attention, as a module its layer calls with `attn(q, k, v)`.

Bound to its layer index and to the backend chosen when the model was built, it reads the step
from the forward context (`attention/context.py`): it writes the new tokens' K/V into its
layer's blocks of the cache, then attends over everything cached for each sequence. The
projections, q/k norms and rope around it are the model's; the cache and the step's plan are
this side's.
"""

from __future__ import annotations

from torch import Tensor, nn

from pagedkv.attention.backend import AttentionBackend
from pagedkv.attention.context import get_forward_context


class Attention(nn.Module):
    """Layer `index`'s attention over the paged cache, for this rank's heads."""

    def __init__(
        self,
        index: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        self.index = index
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        self.backend = backend

    def forward(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """Attention output `[num_tokens, num_heads, head_dim]` of the step's new tokens, whose
        `query` `[num_tokens, num_heads, head_dim]`, `key` and `value` `[num_tokens,
        num_kv_heads, head_dim]` are rotated already; their K/V are in the cache afterwards."""
        context = get_forward_context()
        k_cache, v_cache = context.kv_cache.layer(self.index)
        scales = context.kv_cache.layer_scales(self.index)
        self.backend.write_kv(key, value, k_cache, v_cache, context.batch, scales)
        return self.backend.attend(
            query, k_cache, v_cache, context.batch, self.scale, self.sliding_window, scales
        )
