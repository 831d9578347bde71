"""The attention backend: one interface, chosen once for a device, used by every layer.

Three implementations: `TorchAttention` (any device; `torch_backend.py`), `CPUAttention`
(the same, with steps where every sequence decodes done by one C call per layer:
`kernels/decode_attention.c`) and `TritonAttention` (the kernels of `attention/triton/`, CUDA
only). `select_backend` picks one when a model is
built for a device, so no layer asks again which path to take. Each backend builds the per-step
metadata it reads, once per forward pass, and nothing else: the PyTorch backend plans the step
(`AttentionMetadata`, one plan per sliding window, shared by every layer through the batch);
the Triton kernels read the batch's own tensors and need no plan.

Triton is imported only when a CUDA backend is selected, so `import pagedkv` and every CPU run
work without it (it is the optional `pagedkv[gpu]` extra); on CUDA without triton the PyTorch
path runs, with one warning, since it is correct there too, only slower.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from functools import cache
from typing import Protocol

import torch
from torch import Tensor

from pagedkv.attention import torch_backend
from pagedkv.attention.batch import ForwardBatch
from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.kernels import native


class PagedKVCache(Protocol):
    """What attention needs of a KV cache: each layer's K and V block tensors."""

    def layer(self, index: int) -> tuple[Tensor, Tensor]:
        """`(k_cache, v_cache)`, each `[num_blocks, block_size, num_kv_heads, head_dim]`."""
        ...

    def check_dtype(self, kv_dtype: torch.dtype) -> None:
        """Raise `KVCacheDtypeMismatch` unless K/V of `kv_dtype` can be written here."""
        ...


class AttentionBackend(ABC):
    """Writes a layer's new K/V into the paged cache and attends over it."""

    name: str

    @abstractmethod
    def write_kv(
        self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, batch: ForwardBatch
    ) -> None:
        """Store the new tokens' K/V `[num_tokens, num_kv_heads, head_dim]` at their slots."""

    @abstractmethod
    def attend(
        self,
        query: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        batch: ForwardBatch,
        scale: float,
        sliding_window: int | None,
    ) -> Tensor:
        """Attention output `[num_tokens, num_heads, head_dim]` of the batch's new tokens."""


class TorchAttention(AttentionBackend):
    """PyTorch on any device: a step plan built once per forward, then gathers and SDPA."""

    name = "torch"

    def write_kv(
        self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, batch: ForwardBatch
    ) -> None:
        torch_backend.write_kv(key, value, k_cache, v_cache, batch.slot_mapping)

    def attend(
        self,
        query: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        batch: ForwardBatch,
        scale: float,
        sliding_window: int | None,
    ) -> Tensor:
        key_bytes = torch_backend.key_bytes_per_block(k_cache)
        # Layers of one model share the window and key size, so a forward builds one plan
        # per distinct window, with the first layer that asks.
        metadata = batch.step_state(
            ("torch-plan", sliding_window, key_bytes),
            lambda: AttentionMetadata.build(
                batch.block_tables,
                batch.host_context_lens,
                batch.host_query_lens,
                batch.block_size,
                sliding_window,
                key_bytes,
            ),
        )
        return torch_backend.paged_attention(query, k_cache, v_cache, metadata, scale)


class TritonAttention(AttentionBackend):
    """The Triton kernels on CUDA; they read the batch's tensors directly."""

    name = "triton"

    def write_kv(
        self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, batch: ForwardBatch
    ) -> None:
        from pagedkv.attention.triton.kv import triton_write_kv

        triton_write_kv(key, value, k_cache, v_cache, batch.slot_mapping)

    def attend(
        self,
        query: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        batch: ForwardBatch,
        scale: float,
        sliding_window: int | None,
    ) -> Tensor:
        from pagedkv.attention.triton.attention import triton_paged_attention

        return triton_paged_attention(
            query,
            k_cache,
            v_cache,
            batch.block_tables,
            batch.context_lens,
            batch.query_start_loc,
            max(batch.host_query_lens),
            max(batch.host_context_lens),
            scale,
            sliding_window,
        )


class CPUAttention(TorchAttention):
    """PyTorch, except that a step where every sequence decodes, over float32 caches, is one
    call of the C decode kernel per layer instead of a dozen small ops."""

    name = "cpu"

    def write_kv(
        self, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, batch: ForwardBatch
    ) -> None:
        kernels = native.kernels()
        rows_ok = all(t.dtype == torch.float32 and native.heads_packed(t) for t in (key, value))
        if kernels is None or not rows_ok or not self.takes(k_cache, v_cache, key, value):
            super().write_kv(key, value, k_cache, v_cache, batch)
            return
        slots = batch.slot_mapping
        kernels.write_kv(
            key.data_ptr(),
            key.stride(0),
            value.data_ptr(),
            value.stride(0),
            key.shape[0],
            key.shape[1] * key.shape[2],
            slots.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
        )

    def attend(
        self,
        query: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        batch: ForwardBatch,
        scale: float,
        sliding_window: int | None,
    ) -> Tensor:
        kernels = native.kernels()
        all_decode = max(batch.host_query_lens) == 1
        if kernels is None or not all_decode or not self.takes(k_cache, v_cache, query):
            return super().attend(query, k_cache, v_cache, batch, scale, sliding_window)
        num_seqs, num_heads, head_dim = query.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        tables = self.decode_tables(batch)
        query = query.contiguous()
        out = torch.empty_like(query)
        status = kernels.decode_attention(
            query.data_ptr(),
            num_heads * head_dim,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            tables[0].data_ptr(),
            tables[0].shape[1],
            tables[1].data_ptr(),
            tables[2].data_ptr(),
            num_seqs,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            scale,
            sliding_window or 0,
            out.data_ptr(),
        )
        if status != 0:
            raise MemoryError(f"decode attention over {num_seqs} sequences: no scratch memory")
        return out

    @staticmethod
    def decode_tables(batch: ForwardBatch) -> tuple[Tensor, Tensor, Tensor]:
        """Block tables, each sequence's table row and context lengths as the C kernels read
        them, made once per forward pass."""
        return batch.step_state("cpu-tables", lambda: _decode_tables(batch))

    @staticmethod
    def takes(k_cache: Tensor, v_cache: Tensor, *tensors: Tensor) -> bool:
        """Whether the C kernels can read these: float32 caches in CPU memory, inputs there
        too."""
        caches_ok = all(
            c.dtype == torch.float32 and c.device.type == "cpu" and c.is_contiguous()
            for c in (k_cache, v_cache)
        )
        return caches_ok and all(t.device.type == "cpu" for t in tensors)


def _decode_tables(batch: ForwardBatch) -> tuple[Tensor, Tensor, Tensor]:
    """Block tables, each sequence's table row, context lengths: as the C kernel reads them."""
    return (
        batch.block_tables.to(torch.int32).contiguous(),
        torch.arange(batch.num_seqs, dtype=torch.int64),
        batch.context_lens.to(torch.int32).contiguous(),
    )


def select_backend(device: torch.device | str) -> AttentionBackend:
    """Triton on CUDA when it imports; on the CPU, the C decode kernel when it builds; else
    PyTorch."""
    kind = torch.device(device).type
    if kind == "cuda" and triton_available():
        return TritonAttention()
    if kind == "cpu" and native.kernels() is not None:
        return CPUAttention()
    return TorchAttention()


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
