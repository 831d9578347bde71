"""Pick the attention implementation per call: Triton kernels on CUDA, PyTorch elsewhere.

The model calls these two functions instead of choosing itself. Triton is imported only when
a CUDA tensor first arrives, so `import pagedkv` and every CPU run work without it (it is the
optional `pagedkv[gpu]` extra); on CUDA without triton the PyTorch path runs, with one warning,
since it is correct there too, only slower.
"""

from __future__ import annotations

import itertools
import warnings
from functools import cache

from torch import Tensor

from pagedkv.model import attention
from pagedkv.model.attention_metadata import AttentionMetadata


def paged_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    query_start_loc: Tensor,
    max_query_len: int,
    max_context_len: int,
    scale: float,
    sliding_window: int | None = None,
    *,
    metadata: AttentionMetadata | None = None,
) -> Tensor:
    """Paged attention with the arguments of `triton_attention.triton_paged_attention`.

    ``metadata``, the step's plan for the PyTorch path, is used off CUDA when given (the model
    builds it once per forward); without it the plan is built here from the lengths, which on
    the CPU costs no sync but repeats per layer.
    """
    if query.is_cuda and triton_available():
        from pagedkv.model.triton_attention import triton_paged_attention

        return triton_paged_attention(
            query,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            query_start_loc,
            max_query_len,
            max_context_len,
            scale,
            sliding_window,
        )
    if metadata is None:
        starts = query_start_loc.tolist()
        metadata = AttentionMetadata.build(
            block_tables,
            context_lens.tolist(),
            [stop - start for start, stop in itertools.pairwise(starts)],
            k_cache.shape[1],
            sliding_window,
            attention.key_bytes_per_block(k_cache),
        )
    return attention.paged_attention(query, k_cache, v_cache, metadata, scale)


def write_kv(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Write new K/V rows into their cache slots (see `attention.write_kv`)."""
    if key.is_cuda and triton_available():
        from pagedkv.model.triton_kv import triton_write_kv

        triton_write_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        attention.write_kv(key, value, k_cache, v_cache, slot_mapping)


@cache
def triton_available() -> bool:
    """Whether triton imports; checked once per process."""
    try:
        import triton  # noqa: F401
    except ImportError as error:
        warnings.warn(
            f"triton is not importable ({error}): attention on CUDA falls back to PyTorch; "
            "install pagedkv[gpu] for the Triton kernels",
            stacklevel=3,
        )
        return False
    return True
