"""The attention backend: one interface, chosen once for a device, used by every layer.

Three implementations: `TorchAttention` (any device; `torch_backend.py`), `CPUAttention`
(one C call per layer for every step, prompt chunks and decodes alike: `kernels/attention.c`,
where each query row reduces over its keys in one fixed order, so its output never depends on
the step around it) and `TritonAttention` (the kernels of `attention/triton/`, CUDA only).
`select_backend` picks one when a model is built for a device, so no layer asks again which
path to take. Each backend builds the per-step
metadata it reads, once per forward pass, and nothing else: the PyTorch backend plans the step
(`AttentionMetadata`, one plan per sliding window, shared by every layer through the batch);
the Triton kernels read the batch's own tensors and need no plan.

Every backend writes and reads fp8 caches (`attention/fp8.py`): each write and attention call
takes the cache's `KVScales`, and a cache tensor's dtype (an fp8 view) says what it holds.

Triton is imported only when a CUDA backend is selected, so `import pagedkv` and every CPU run
work without it (it is the optional `pagedkv[gpu]` extra); on CUDA without triton the PyTorch
path runs, with one warning, since it is correct there too, only slower.
"""

from __future__ import annotations

import ctypes
import warnings
from abc import ABC, abstractmethod
from functools import cache

import torch
from torch import Tensor

from pagedkv.attention import torch_backend
from pagedkv.attention.batch import ForwardBatch
from pagedkv.attention.context import ForwardContext, PagedKVCache
from pagedkv.attention.fp8 import FP8_LAYOUTS, UNIT_SCALES, KVScales, byte_values, is_fp8
from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.kernels import native


class AttentionBackend(ABC):
    """Writes a layer's new K/V into the paged cache and attends over it.

    `scales` say what an fp8 cache's bytes are worth; other caches ignore them.
    """

    name: str

    @abstractmethod
    def write_kv(
        self,
        key: Tensor,
        value: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        batch: ForwardBatch,
        scales: KVScales = UNIT_SCALES,
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
        scales: KVScales = UNIT_SCALES,
    ) -> Tensor:
        """Attention output `[num_tokens, num_heads, head_dim]` of the batch's new tokens."""


class TorchAttention(AttentionBackend):
    """PyTorch on any device: a step plan built once per forward, then gathers and SDPA."""

    name = "torch"

    def write_kv(
        self,
        key: Tensor,
        value: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        batch: ForwardBatch,
        scales: KVScales = UNIT_SCALES,
    ) -> None:
        torch_backend.write_kv(key, value, k_cache, v_cache, batch.slot_mapping, scales)

    def attend(
        self,
        query: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        batch: ForwardBatch,
        scale: float,
        sliding_window: int | None,
        scales: KVScales = UNIT_SCALES,
    ) -> Tensor:
        key_bytes = torch_backend.key_bytes_per_block(k_cache, query.dtype)
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
        return torch_backend.paged_attention(query, k_cache, v_cache, metadata, scale, scales)


class TritonAttention(AttentionBackend):
    """The Triton kernels on CUDA; they read the batch's tensors directly."""

    name = "triton"

    def write_kv(
        self,
        key: Tensor,
        value: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        batch: ForwardBatch,
        scales: KVScales = UNIT_SCALES,
    ) -> None:
        from pagedkv.attention.triton.kv import triton_write_kv

        triton_write_kv(key, value, k_cache, v_cache, batch.slot_mapping, scales)

    def attend(
        self,
        query: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        batch: ForwardBatch,
        scale: float,
        sliding_window: int | None,
        scales: KVScales = UNIT_SCALES,
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
            scales=scales,
        )


class CPUAttention(TorchAttention):
    """The C kernels on the CPU: the K/V write (float32 or fp8 caches) and attention over
    float32, bfloat16, float16 or fp8 caches, one call per layer for any step; and, for a step
    over float32 or fp8 caches, consecutive decoder layers in one call (`decode_layers`, which
    the model's layer path feeds: `model/fused_decode.py`).

    The kernels are resolved once, here: the backend exists only where they built. What stays
    per call is whether the tensors at hand are ones they read (CPU memory, their dtypes).
    """

    name = "cpu"

    def __init__(self) -> None:
        kernels = native.kernels()
        if kernels is None:
            raise RuntimeError(
                f"the CPU attention backend needs the C kernels: {native.unavailable_reason()}"
            )
        self.kernels = kernels

    def write_kv(
        self,
        key: Tensor,
        value: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        batch: ForwardBatch,
        scales: KVScales = UNIT_SCALES,
    ) -> None:
        rows_ok = all(t.dtype == torch.float32 and native.heads_packed(t) for t in (key, value))
        if not rows_ok or not self.writes(k_cache, v_cache):
            super().write_kv(key, value, k_cache, v_cache, batch, scales)
            return
        rows = (
            key.data_ptr(),
            key.stride(0),
            value.data_ptr(),
            value.stride(0),
            key.shape[0],
            key.shape[1] * key.shape[2],
            batch.slot_mapping.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
        )
        fp8 = self.fp8_args(k_cache, scales)
        if fp8 is None:
            self.kernels.write_kv(*rows)
            return
        self.kernels.write_kv_fp8(
            *rows,
            fp8.mantissa_bits,
            fp8.exponent_bias,
            fp8.max,
            fp8.k_inverse_scale,
            fp8.v_inverse_scale,
        )

    def attend(
        self,
        query: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        batch: ForwardBatch,
        scale: float,
        sliding_window: int | None,
        scales: KVScales = UNIT_SCALES,
    ) -> Tensor:
        if not self.takes(k_cache, v_cache, query):
            return super().attend(query, k_cache, v_cache, batch, scale, sliding_window, scales)
        num_tokens, num_heads, head_dim = query.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        tables, query_starts, context_lens = self.step_tables(batch)
        fp8 = self.fp8_args(k_cache, scales)
        rows = query.reshape(num_tokens, num_heads * head_dim)
        if rows.dtype != torch.float32 or not native.heads_packed(query):
            rows = rows.to(torch.float32).contiguous()
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
        status = self.kernels.attention(
            rows.data_ptr(),
            rows.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            _FP8_CODE if fp8 is not None else _CACHE_CODES[k_cache.dtype],
            None if fp8 is None else fp8.table,
            1.0 if fp8 is None else fp8.k_scale,
            1.0 if fp8 is None else fp8.v_scale,
            tables.data_ptr(),
            tables.shape[1],
            query_starts.data_ptr(),
            context_lens.data_ptr(),
            batch.num_seqs,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            scale,
            sliding_window or 0,
            out.data_ptr(),
        )
        if status != 0:
            raise MemoryError(f"attention over {batch.num_seqs} sequences: no scratch memory")
        return out if query.dtype == torch.float32 else out.to(query.dtype)

    def takes_decode_step(self, hidden: Tensor, context: ForwardContext) -> bool:
        """Whether `decode_layers` can run this step, decided once per step: packed float32
        hidden rows and rope tables in CPU memory, into caches the C write takes (float32 or
        fp8: the C code rounds into fp8 bytes as torch does), whatever each sequence's chunk
        (a decode's token, a speculative step's token and drafts, a prompt chunk). A cache
        holds every layer in one tensor, so the first layer's speaks for all."""
        k_cache, v_cache = context.kv_cache.layer(0)
        return (
            hidden.dtype == torch.float32
            and hidden.device.type == "cpu"
            and hidden.is_contiguous()
            and all(
                t.dtype == torch.float32 and t.is_contiguous() for t in (context.cos, context.sin)
            )
            and self.writes(k_cache, v_cache)
        )

    def layer_caches(
        self, kv_cache: PagedKVCache, index: int
    ) -> tuple[int, int, native.Fp8CacheArgs | None]:
        """Layer `index`'s K and V block addresses and its fp8 format (None for float32), as
        a `native.DecodeLayerArgs` names them."""
        k_cache, v_cache = kv_cache.layer(index)
        fp8 = self.fp8_args(k_cache, kv_cache.layer_scales(index))
        return k_cache.data_ptr(), v_cache.data_ptr(), fp8

    def decode_layers(
        self,
        hidden: Tensor,
        layers: ctypes.Array,
        heads: tuple[int, int, int],
        scale: float,
        context: ForwardContext,
        lora: tuple[int, int] | None = None,
    ) -> Tensor:
        """The hidden states after `layers` (consecutive `native.DecodeLayerArgs`), in one C
        call over a step `takes_decode_step` accepted; `heads` is `(num_heads, num_kv_heads,
        head_dim)`. Their new K/V are in the cache afterwards, as op by op. `lora` is the
        step's LoRA groups table of these layers and its group count (`model/lora.py`)."""
        num_heads, num_kv_heads, head_dim = heads
        batch = context.batch
        tables, query_starts, context_lens = self.step_tables(batch)
        out = hidden.clone()
        status = self.kernels.decode_layers(
            out.data_ptr(),
            out.shape[0],
            out.shape[1],
            len(layers),
            layers,
            num_heads,
            num_kv_heads,
            head_dim,
            context.cos.data_ptr(),
            context.sin.data_ptr(),
            batch.slot_mapping.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            query_starts.data_ptr(),
            context_lens.data_ptr(),
            batch.num_seqs,
            context.kv_cache.layer(0)[0].shape[1],
            scale,
            *(lora or (None, 0)),
        )
        if status != 0:
            raise MemoryError(f"decoder layers over {hidden.shape[0]} rows: no scratch memory")
        return out

    @staticmethod
    def step_tables(batch: ForwardBatch) -> tuple[Tensor, Tensor, Tensor]:
        """Block tables, where each sequence's query rows start and its context length, as
        the C kernels read them, made once per forward pass."""
        return batch.step_state("cpu-tables", lambda: _step_tables(batch))

    @staticmethod
    def takes(k_cache: Tensor, v_cache: Tensor, *tensors: Tensor) -> bool:
        """Whether the C kernels can read these: packed float32, 16-bit or fp8 caches in CPU
        memory, inputs there too."""
        caches_ok = all(
            (c.dtype in _CACHE_CODES or is_fp8(c.dtype))
            and c.device.type == "cpu"
            and c.is_contiguous()
            for c in (k_cache, v_cache)
        )
        return caches_ok and all(t.device.type == "cpu" for t in tensors)

    @staticmethod
    def writes(k_cache: Tensor, v_cache: Tensor) -> bool:
        """Whether the C K/V write takes these caches: float32 or fp8 (16-bit caches are
        written by torch's exact copy)."""
        stored = all(c.dtype == torch.float32 or is_fp8(c.dtype) for c in (k_cache, v_cache))
        return stored and CPUAttention.takes(k_cache, v_cache)

    @staticmethod
    def fp8_args(k_cache: Tensor, scales: KVScales) -> native.Fp8CacheArgs | None:
        """An fp8 cache's format and scales as the C kernels take them; None for the others."""
        return _fp8_args(k_cache.dtype, scales) if is_fp8(k_cache.dtype) else None


# attention.c's code for what a cache holds; fp8 bytes are read through their value table.
_CACHE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_FP8_CODE = 3


@cache
def _fp8_args(dtype: torch.dtype, scales: KVScales) -> native.Fp8CacheArgs:
    """Made once per format and scales: every layer of every step passes the same."""
    layout = FP8_LAYOUTS[dtype]
    return native.Fp8CacheArgs(
        byte_values(dtype).data_ptr(),
        layout.mantissa_bits,
        layout.exponent_bias,
        layout.max,
        scales.k,
        scales.v,
        1.0 / scales.k,  # the multiplier fp8.quantize uses, so the bytes are torch's
        1.0 / scales.v,
    )


def _step_tables(batch: ForwardBatch) -> tuple[Tensor, Tensor, Tensor]:
    """Block tables, query row starts, context lengths: as the C kernels read them."""
    return (
        batch.block_tables.to(torch.int32).contiguous(),
        batch.query_start_loc.to(torch.int64).contiguous(),
        batch.context_lens.to(torch.int32).contiguous(),
    )


def select_backend(device: torch.device | str) -> AttentionBackend:
    """Triton on CUDA when it imports; on the CPU, the C kernels when they build; else
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
