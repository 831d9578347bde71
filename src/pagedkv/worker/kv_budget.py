"""How many KV blocks the engine gets: given, from a byte budget, or from free memory.

On a GPU the pool is what `gpu_memory_utilization` of the device leaves after the weights
and the activation peak of the largest step (measured by one forward pass), as vLLM sizes
it. On a CPU the pool takes half the available memory, at most `CPU_KV_CACHE_BYTES` (vLLM's
CPU backend reserves 4 GiB by default), so a laptop keeps room for everything else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pagedkv.attention.batch import ForwardBatch, SequenceInput
from pagedkv.kvmath.spec import format_bytes
from pagedkv.model.decoder import DecoderModel
from pagedkv.worker.kv_cache import KVCache, bytes_per_block

CPU_KV_CACHE_BYTES = 4 << 30
GIB = 1 << 30


class KVCacheTooSmallForModel(ValueError):
    """The memory left for the KV pool holds no block at all."""


@dataclass(frozen=True)
class KVBudget:
    """Block counts of the device pool and the CPU swap pool, and the bytes per block."""

    num_gpu_blocks: int
    num_cpu_blocks: int
    bytes_per_block: int

    def describe(self, block_size: int, max_model_len: int) -> str:
        """vLLM-style start-up line: pool size and how many full-length requests fit."""
        tokens = self.num_gpu_blocks * block_size
        gib = self.num_gpu_blocks * self.bytes_per_block / GIB
        return (
            f"KV cache: {self.num_gpu_blocks} blocks x {block_size} tokens = {tokens} tokens "
            f"({gib:.2f} GiB); max concurrency at max_model_len ({max_model_len} tokens): "
            f"{tokens / max_model_len:.2f}"
        )


@dataclass(frozen=True)
class PoolRequest:
    """What the pool sizing is told: an explicit size, or a budget to derive one from.

    `num_gpu_blocks` wins, then `kv_cache_memory` (bytes); otherwise the device's free memory
    (`gpu_memory_utilization` on CUDA, less the activation peak of a step of
    `max_num_batched_tokens` prompt tokens in sequences of `max_model_len`) or, on a CPU,
    half the available host memory capped at `CPU_KV_CACHE_BYTES`.
    """

    block_size: int
    swap_space_gb: float
    num_gpu_blocks: int | None
    kv_cache_memory: int | None
    gpu_memory_utilization: float
    max_num_batched_tokens: int
    max_model_len: int


def kv_budget(request: PoolRequest, model: DecoderModel) -> KVBudget:
    """Size the pools for `model` (its config, dtype and device) as `request` says."""
    per_block = bytes_per_block(model.config, request.block_size, model.dtype)
    num_cpu_blocks = int(request.swap_space_gb * GIB) // per_block
    if request.num_gpu_blocks is not None:
        return KVBudget(request.num_gpu_blocks, num_cpu_blocks, per_block)
    if request.kv_cache_memory is not None:
        memory = request.kv_cache_memory
    elif model.device.type == "cuda":
        memory = _free_device_memory(request, model)
    else:
        memory = min(CPU_KV_CACHE_BYTES, _available_host_memory() // 2)
    num_blocks = memory // per_block
    if num_blocks <= 0:
        raise KVCacheTooSmallForModel(
            f"{format_bytes(max(memory, 0))} left for the KV cache holds no block of "
            f"{format_bytes(per_block)} (block_size {request.block_size}): lower block_size or "
            "give more memory"
        )
    return KVBudget(num_blocks, num_cpu_blocks, per_block)


def _free_device_memory(request: PoolRequest, model: DecoderModel) -> int:
    """Bytes for KV: the utilisation share of the device, less what is used and the peak step."""
    device = model.device
    torch.cuda.synchronize(device)
    activation_peak = _profile_activations(request, model, device)
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    return int(total * request.gpu_memory_utilization) - used - activation_peak


def _profile_activations(request: PoolRequest, model: DecoderModel, device: torch.device) -> int:
    """Peak extra memory of one forward pass over a full token budget of prompt tokens."""
    block_size = request.block_size
    num_tokens = request.max_num_batched_tokens
    seq_len = min(num_tokens, request.max_model_len)
    num_full, rest = divmod(num_tokens, seq_len)
    lengths = [seq_len] * num_full + ([rest] if rest else [])
    blocks_per_seq = -(-seq_len // block_size)
    cache = KVCache.for_model(
        model, block_size=block_size, num_blocks=blocks_per_seq * len(lengths)
    )
    sequences = [
        SequenceInput(
            [0] * length,
            0,
            list(range(index * blocks_per_seq, (index + 1) * blocks_per_seq)),
        )
        for index, length in enumerate(lengths)
    ]
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    model(ForwardBatch.build(sequences, block_size, device=device), cache)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del cache
    torch.cuda.empty_cache()
    return peak


def _available_host_memory() -> int:
    """MemAvailable from /proc/meminfo, else physical memory (POSIX systems without it)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
