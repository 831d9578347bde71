"""Paged attention and KV writes on CUDA with Triton: the launch side of the kernels.

Same semantics as the PyTorch reference (`pagedkv.attention.torch_backend`): each sequence's new
tokens attend causally over its cached prefix plus themselves, through its block table, with
an optional sliding window. The batch is described the way the kernels want it and so that
launching needs no device-to-host sync: ``query_start_loc`` (cumulative query lengths on the
device) plus the two host-side maxima the engine already knows when it builds the batch.

A batch whose sequences all decode (``max_query_len == 1``) takes the split-KV decode kernel;
any other batch, decodes mixed in included, takes the varlen prefill kernel. Imported only on
the GPU path and in tests: it imports triton.

fp8 caches are read by the same kernels, converted tile by tile as they are loaded; the key
scale is folded into the score scale and the value scale into the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch
import triton
from torch import Tensor

from pagedkv.attention.fp8 import UNIT_SCALES, KVScales, check_cache_dtypes, is_fp8
from pagedkv.attention.triton.kernels import (
    _decode_kernel,
    _merge_partitions_kernel,
    _prefill_kernel,
)
from pagedkv.attention.triton.kv import triton_write_kv

__all__ = [
    "DecodeConfig",
    "PrefillConfig",
    "triton_paged_attention",
    "triton_write_kv",
]

# A window wider than any context: "no sliding window" without a second kernel variant.
NO_WINDOW = 1 << 30


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernel (defaults aimed at H100/H200; see bench/).

    ``partition_size`` keys per work item: small enough that one long sequence spreads over
    many SMs, large enough that the merge pass stays small next to reading K/V.
    ``programs_per_sm`` sizes the persistent grid (times the SM count, over the KV heads); it
    must not exceed the programs an SM holds at once (3 for bf16, head_dim 128: 145 registers,
    38 KiB shared), or the programs left over start only when others finish all their work.
    """

    partition_size: int = 512
    block_n: int = 64
    programs_per_sm: int = 2
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters of the prefill kernel: query rows (tokens x grouped heads) per tile.

    128 x 64 tiles on 8 warps: the flash-attention shape for head_dim 128 on Hopper; on sm_90
    it compiles to wgmma with 225 registers and no spills (tests/attention/triton/sm90_compile.py).
    """

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2


def triton_paged_attention(
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
    scales: KVScales = UNIT_SCALES,
    decode_config: DecodeConfig = DecodeConfig(),  # noqa: B008 - frozen, so shared safely
    prefill_config: PrefillConfig = PrefillConfig(),  # noqa: B008
) -> Tensor:
    """Attention of each sequence's new tokens over its keys in the paged cache.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``, the new tokens of all sequences in order.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, already holding
            the new tokens' keys and values (see :func:`triton_write_kv`): the query's dtype,
            or an fp8 dtype whose bytes are worth ``scales``.
        block_tables: ``[num_seqs, max_blocks]`` int32; entries past a sequence's last block
            are never read.
        context_lens: ``[num_seqs]`` int32, tokens per sequence including the new ones.
        query_start_loc: ``[num_seqs + 1]`` int32, where each sequence's tokens start in
            ``query`` (0 first, ``num_tokens`` last).
        max_query_len, max_context_len: host-side maxima of the two lengths (upper bounds do:
            they size the launch, never decide which keys are read).
        scale: multiplier of ``q @ k``.
        sliding_window: if set, a query at ``i`` sees keys ``j`` with ``i - j < sliding_window``.
        scales: what an fp8 cache's bytes are worth (ignored for other caches).

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in the query's dtype; accumulation is float32.
    """
    _check(query, k_cache, v_cache, block_tables, context_lens, query_start_loc, sliding_window)
    out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    window = NO_WINDOW if sliding_window is None else sliding_window
    if not is_fp8(k_cache.dtype):
        scales = UNIT_SCALES
    batch = _Batch(out, query, k_cache, v_cache, block_tables, context_lens, scale, scales, window)
    if max_query_len == 1:
        if block_tables.shape[0] != query.shape[0]:
            raise ValueError(
                f"max_query_len 1 needs one token per sequence: {query.shape[0]} tokens, "
                f"{block_tables.shape[0]} sequences"
            )
        _decode(batch, min(max_context_len, window), decode_config)
    else:
        _prefill(batch, query_start_loc, max_query_len, prefill_config)
    return out


@dataclass(frozen=True)
class _Batch:
    """One call's tensors and scalars, as both attention kernels take them."""

    out: Tensor
    query: Tensor
    k_cache: Tensor
    v_cache: Tensor
    block_tables: Tensor
    context_lens: Tensor
    scale: float
    scales: KVScales
    window: int

    @property
    def num_seqs(self) -> int:
        """Sequences in the batch (rows of the block table)."""
        return self.block_tables.shape[0]

    @property
    def num_kv_heads(self) -> int:
        """KV heads of the cache: the launch grid's second axis."""
        return self.k_cache.shape[2]

    @property
    def group(self) -> int:
        """Query heads sharing one KV head."""
        return self.query.shape[1] // self.num_kv_heads

    def shared_args(self) -> tuple:
        """Both kernels' arguments from the scale on: scale, value scale, window and every
        stride.

        The kernels exponentiate with exp2, so the scale arrives multiplied by log2(e) (and by
        an fp8 cache's key scale).
        """
        return (
            self.scale * self.scales.k * math.log2(math.e),
            self.scales.v,
            self.window,
            *self.query.stride()[:2],
            *self.out.stride()[:2],
            *self.k_cache.stride()[:3],
            *self.v_cache.stride()[:3],
            self.block_tables.stride(0),
        )

    def shared_constants(self, config: DecodeConfig | PrefillConfig) -> dict:
        """The compile-time constants and launch options both kernels take."""
        head_dim = self.query.shape[2]
        return {
            "HEAD_DIM": head_dim,
            "HEAD_DIM_P": triton.next_power_of_2(head_dim),
            "GROUP": self.group,
            "BLOCK_N": config.block_n,
            "BLOCK_SIZE": self.k_cache.shape[1],
            "SEQS_P": _seqs_bucket(self.num_seqs),
            "DOT_PRECISION": _dot_precision(self.query.dtype),
            "num_warps": config.num_warps,
            "num_stages": config.num_stages,
        }


def _decode(batch: _Batch, max_keys: int, config: DecodeConfig) -> None:
    """Launch the split-KV decode kernel, then the merge if any sequence has several parts."""
    out, query = batch.out, batch.query
    num_seqs, num_heads, head_dim = query.shape
    max_parts = max(1, math.ceil(max_keys / config.partition_size))
    split = max_parts > 1
    if split:
        part_acc = query.new_empty(num_seqs, num_heads, max_parts, head_dim, dtype=torch.float32)
        part_max = query.new_empty(num_seqs, num_heads, max_parts, dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
    else:  # never written: the kernel stores its output directly
        part_acc = part_max = part_sum = out
    num_programs = min(
        num_seqs * max_parts,
        max(1, config.programs_per_sm * _sm_count(query.device) // batch.num_kv_heads),
    )
    _decode_kernel[(num_programs, batch.num_kv_heads)](
        out,
        part_acc,
        part_max,
        part_sum,
        query,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.context_lens,
        num_seqs,
        num_heads,
        max_parts,
        *batch.shared_args(),
        BLOCK_M=max(16, triton.next_power_of_2(batch.group)),
        PARTITION_SIZE=config.partition_size,
        SPLIT=split,
        **batch.shared_constants(config),
    )
    if split:
        _merge_partitions_kernel[(num_seqs, num_heads)](
            out,
            part_acc,
            part_max,
            part_sum,
            batch.context_lens,
            num_heads,
            max_parts,
            batch.window,
            *out.stride()[:2],
            HEAD_DIM=head_dim,
            HEAD_DIM_P=triton.next_power_of_2(head_dim),
            PARTITION_SIZE=config.partition_size,
            PARTS_P=triton.next_power_of_2(max_parts),
        )


def _prefill(
    batch: _Batch, query_start_loc: Tensor, max_query_len: int, config: PrefillConfig
) -> None:
    """Launch the varlen prefill kernel: one program per (query tile, KV head)."""
    group_p = triton.next_power_of_2(batch.group)
    block_q = max(1, min(config.block_m // group_p, triton.next_power_of_2(max_query_len)))
    num_tiles = batch.query.shape[0] // block_q + batch.num_seqs
    _prefill_kernel[(num_tiles, batch.num_kv_heads)](
        batch.out,
        batch.query,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.context_lens,
        query_start_loc,
        batch.num_seqs,
        *batch.shared_args(),
        GROUP_P=group_p,
        BLOCK_Q=block_q,
        BLOCK_M=max(16, block_q * group_p),
        **batch.shared_constants(config),
    )


def _seqs_bucket(num_seqs: int) -> int:
    """Lanes the kernels hold per-sequence lengths in: a power of two, at least 256.

    It is a compile-time constant, so a size per batch would recompile the kernels each time
    the number of running sequences crosses a power of two; one size up to 256 sequences costs
    each program a vector of 256 lengths, loaded once (1 KiB, cached).
    """
    return max(256, triton.next_power_of_2(num_seqs))


def _dot_precision(dtype: torch.dtype) -> str:
    """Full float32 products for float32 inputs (tf32 would cost ~3e-4 relative error)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter on CPU)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    query_start_loc: Tensor,
    sliding_window: int | None,
) -> None:
    """Raise ValueError on shapes, dtypes or layouts the kernels would silently misread.

    Only host-side facts are checked: reading lengths back from the device would cost a sync.
    """
    if query.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "query must be [num_tokens, num_heads, head_dim] and both caches "
            f"[num_blocks, block_size, num_kv_heads, head_dim], got {tuple(query.shape)}, "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if head_dim != k_cache.shape[3] or num_heads % num_kv_heads:
        raise ValueError(
            f"query has {num_heads} heads of {head_dim}, the cache {num_kv_heads} KV heads of "
            f"{k_cache.shape[3]}: head_dim must match and heads be a multiple of KV heads"
        )
    check_cache_dtypes(query.dtype, k_cache.dtype, v_cache.dtype)
    if any(t.stride(-1) != 1 for t in (query, k_cache, v_cache)) or block_tables.stride(1) != 1:
        raise ValueError("query, caches and block_tables need a contiguous last dimension")
    num_seqs = block_tables.shape[0] if block_tables.dim() == 2 else -1
    if context_lens.shape != (num_seqs,) or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)}, context_lens "
            f"{tuple(context_lens.shape)} and query_start_loc {tuple(query_start_loc.shape)} "
            "must be [num_seqs, max_blocks], [num_seqs] and [num_seqs + 1]"
        )
    tensors = (k_cache, v_cache, block_tables, context_lens, query_start_loc)
    if any(t.device != query.device for t in tensors):
        raise ValueError("all tensors must be on the query's device")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
