"""The forward context: what every layer of one forward pass shares, set once per step; and
`PagedKVCache`, what attention needs of the KV cache it holds.

The model sets it for the duration of its forward pass (`with forward_context(...)`), so a
decoder layer is called with its hidden states alone and its attention reads the step's batch,
KV cache and rope tables from here instead of having them threaded through every module (vLLM's
`set_forward_context`). It is a `ContextVar`, so a forward pass on another thread never sees
this one's step, and the `with` block restores whatever was set before, even on an error.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from pagedkv.attention.batch import ForwardBatch
from pagedkv.attention.errors import NoForwardContext
from pagedkv.attention.fp8 import KVScales


@dataclass(frozen=True)
class ForwardContext:
    """One step: its flat batch, the paged KV cache its layers write and read, and the rope
    tables of its positions (`[num_tokens, head_dim]` each), computed once for every layer."""

    batch: ForwardBatch
    kv_cache: PagedKVCache
    cos: Tensor
    sin: Tensor


class PagedKVCache(Protocol):
    """What attention needs of a KV cache: each layer's K and V block tensors, and what an
    fp8 cache's bytes are worth."""

    def layer(self, index: int) -> tuple[Tensor, Tensor]:
        """`(k_cache, v_cache)`, each `[num_blocks, block_size, num_kv_heads, head_dim]`."""
        ...

    def layer_scales(self, index: int) -> KVScales:
        """What layer `index`'s fp8 key and value bytes are worth (1 for other caches)."""
        ...

    def check_dtype(self, kv_dtype: torch.dtype) -> None:
        """Raise `KVCacheDtypeMismatch` unless K/V of `kv_dtype` can be written here."""
        ...


_CURRENT: ContextVar[ForwardContext | None] = ContextVar("forward_context", default=None)


@contextmanager
def forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    """Make `context` the current step inside the block."""
    token = _CURRENT.set(context)
    try:
        yield context
    finally:
        _CURRENT.reset(token)


def get_forward_context() -> ForwardContext:
    """The step being computed; `NoForwardContext` outside a forward pass."""
    context = _CURRENT.get()
    if context is None:
        raise NoForwardContext()
    return context
