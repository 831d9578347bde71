"""Random paged batches for the kernel tests: scattered blocks, poisoned table padding."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

# Table padding points far past the cache: a kernel that reads it fails or reads garbage.
POISON_BLOCK = 1 << 20


@dataclass(frozen=True)
class PagedBatch:
    """One forward pass's attention inputs, K/V already in the cache."""

    query: Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: Tensor
    block_tables: Tensor  # [num_seqs, max_blocks] int32, padded with POISON_BLOCK
    context_lens: Tensor  # [num_seqs] int32
    query_lens: Tensor  # [num_seqs] int32
    query_start_loc: Tensor  # [num_seqs + 1] int32

    @property
    def max_query_len(self) -> int:
        """Longest run of new tokens, as the engine passes it from the host."""
        return int(self.query_lens.max())

    @property
    def max_context_len(self) -> int:
        """Longest context, as the engine passes it from the host."""
        return int(self.context_lens.max())

    def to(self, device: torch.device, dtype: torch.dtype | None = None) -> PagedBatch:
        """The same batch on ``device``, floats cast to ``dtype`` if given."""

        def move(tensor: Tensor) -> Tensor:
            return tensor.to(device, dtype if tensor.is_floating_point() else None)

        return PagedBatch(*(move(getattr(self, f)) for f in self.__dataclass_fields__))


def make_batch(
    context_lens: Sequence[int],
    query_lens: Sequence[int],
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> PagedBatch:
    """A CPU batch whose sequences own shuffled blocks of one cache, with spare blocks."""
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_needed) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    block_ids = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables = torch.full((len(context_lens), max(blocks_needed) + 1), POISON_BLOCK)
    for seq, count in enumerate(blocks_needed):
        block_tables[seq, :count] = torch.tensor(block_ids[:count])
        del block_ids[:count]
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=generator)
    lens = torch.tensor(query_lens, dtype=torch.int32)
    return PagedBatch(
        query=query.to(dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables.to(torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        query_lens=lens,
        query_start_loc=torch.cat([lens.new_zeros(1), lens.cumsum(0, dtype=torch.int32)]),
    )


def dense_attention(batch: PagedBatch, scale: float, sliding_window: int | None) -> Tensor:
    """The oracle: per sequence, gather its keys in order and run masked softmax in float64.

    Independent of every kernel and of the PyTorch paged path: no chunking, no online softmax.
    """
    _, block_size, num_kv_heads, head_dim = batch.k_cache.shape
    group = batch.query.shape[1] // num_kv_heads
    out = torch.empty(batch.query.shape, dtype=torch.float64)
    starts = batch.query_start_loc.tolist()
    for seq, context_len in enumerate(batch.context_lens.tolist()):
        positions = torch.arange(context_len)
        blocks = batch.block_tables[seq, positions // block_size].long()
        keys = batch.k_cache[blocks, positions % block_size].double()  # [ctx, kv_heads, dim]
        values = batch.v_cache[blocks, positions % block_size].double()
        rows = slice(starts[seq], starts[seq + 1])
        query = batch.query[rows].double()  # [q_len, heads, dim]
        query_pos = torch.arange(context_len - query.shape[0], context_len)[:, None]
        distance = query_pos - positions[None, :]
        visible = distance >= 0
        if sliding_window is not None:
            visible &= distance < sliding_window
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query, keys) * scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, values)
    return out
