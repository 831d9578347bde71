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

from pagedkv.engine.args import EngineArgs
from pagedkv.model.batch import ForwardBatch, SequenceInput
from pagedkv.model.config import ModelConfig
from pagedkv.model.kv_cache import KVCache, bytes_per_block
from pagedkv.model.llama import LlamaModel
from pagedkv.spec import format_bytes

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


def kv_budget(
    args: EngineArgs, model: LlamaModel, config: ModelConfig, dtype: torch.dtype
) -> KVBudget:
    """Size the pools from the arguments, or from the device's free memory."""
    per_block = bytes_per_block(config, args.block_size, dtype)
    num_cpu_blocks = int(args.swap_space_gb * GIB) // per_block
    if args.num_gpu_blocks is not None:
        return KVBudget(args.num_gpu_blocks, num_cpu_blocks, per_block)
    if args.kv_cache_memory is not None:
        memory = args.kv_cache_memory
    elif torch.device(args.device).type == "cuda":
        memory = _free_device_memory(args, model)
    else:
        memory = min(CPU_KV_CACHE_BYTES, _available_host_memory() // 2)
    num_blocks = memory // per_block
    if num_blocks <= 0:
        raise KVCacheTooSmallForModel(
            f"{format_bytes(max(memory, 0))} left for the KV cache holds no block of "
            f"{format_bytes(per_block)} (block_size {args.block_size}): lower block_size or "
            "give more memory"
        )
    return KVBudget(num_blocks, num_cpu_blocks, per_block)


def _free_device_memory(args: EngineArgs, model: LlamaModel) -> int:
    """Bytes for KV: the utilisation share of the device, less what is used and the peak step."""
    device = torch.device(args.device)
    torch.cuda.synchronize(device)
    activation_peak = _profile_activations(args, model, device)
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    return int(total * args.gpu_memory_utilization) - used - activation_peak


def _profile_activations(args: EngineArgs, model: LlamaModel, device: torch.device) -> int:
    """Peak extra memory of one forward pass over a full token budget of prompt tokens."""
    config = model.config
    num_tokens = args.max_num_batched_tokens
    seq_len = min(num_tokens, args.max_model_len or config.max_position_embeddings)
    num_full, rest = divmod(num_tokens, seq_len)
    lengths = [seq_len] * num_full + ([rest] if rest else [])
    blocks_per_seq = -(-seq_len // args.block_size)
    cache = KVCache.for_model(
        model, block_size=args.block_size, num_blocks=blocks_per_seq * len(lengths)
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
    model(ForwardBatch.build(sequences, args.block_size, device=device), cache)
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
