"""How many KV blocks the engine gets: given, from a byte budget, or from free memory.

`kv_budget` resolves the cache settings once into a `KVCacheConfig` (block counts of every
pool, what a block stores and its bytes), which the engine hands whole to both the memory
manager and the cache tensors (`kv_pool`).

On a GPU the pool is what `gpu_memory_utilization` of the device leaves after the weights
and the activation peak of the largest step (measured by one forward pass), as vLLM sizes
it. On a CPU the pool takes half the available memory, at most `CPU_KV_CACHE_BYTES` (vLLM's
CPU backend reserves 4 GiB by default), so a laptop keeps room for everything else.

Blocks are counted in the KV dtype the cache stores (`kv_cache_dtype`: an fp8 cache fits twice
the blocks of a 16-bit one), by the planner's own arithmetic (`kvmath.capacity`), so the
start-up line and `pagedkv plan` agree on blocks and concurrency. With a speculative draft
model, each block id also holds the draft model's K/V of the same tokens (`draft_kv_pool`): a
block costs both models' bytes, and the pool holds that many fewer blocks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pagedkv.attention.batch import ForwardBatch, SequenceInput
from pagedkv.kvmath.capacity import max_concurrency
from pagedkv.kvmath.spec import KVSpec, format_bytes
from pagedkv.model.decoder import DecoderModel
from pagedkv.worker.kv_cache import KVCache, kv_cache_torch_dtype, kv_dtype_name, kv_spec
from pagedkv.worker.kv_request import PoolRequest

CPU_KV_CACHE_BYTES = 4 << 30
GIB = 1 << 30
HOST_POOL_SHARE = 0.7  # vLLM refuses a swap space above 70% of the host's memory


class KVCacheTooSmallForModel(ValueError):
    """The memory left for the KV pool holds no block at all."""


class HostPoolTooLarge(ValueError):
    """The pools in host memory ask for more of it than the host can spare."""


@dataclass(frozen=True)
class KVCacheConfig:
    """The KV cache, resolved once: tokens per block, block counts of the device pool, the CPU
    swap pool and the prefix cache's host tier (`num_offload_blocks`, 0: none), what a block
    stores and its bytes."""

    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    num_offload_blocks: int
    bytes_per_block: int  # the model's K/V and, with a draft model, the draft's
    kv_dtype: torch.dtype  # what K/V are stored as: the model's dtype or fp8
    spec: KVSpec  # the arithmetic the counts came from (one rank's under tensor parallelism)
    tensor_parallel_size: int = 1  # ranks that each hold every block (their heads of it)
    draft_bytes_per_block: int = 0  # of `bytes_per_block`, the draft model's K/V

    @property
    def kv_dtype_name(self) -> str:
        """What blocks store, as reports name it (`float32`, `fp8_e4m3`, ...)."""
        return kv_dtype_name(self.kv_dtype)

    def describe(self, max_model_len: int) -> str:
        """vLLM-style start-up line: pool size, KV dtype, and how many full-length requests
        fit (whole blocks each, as `pagedkv plan` counts them)."""
        block_size = self.block_size
        tokens = self.num_gpu_blocks * block_size
        fit = max_concurrency(self.spec, self.num_gpu_blocks, max_model_len, block_size)
        ranks = self.tensor_parallel_size
        on_each_rank = f" on each of {ranks} ranks" if ranks > 1 else ""
        per_block, draft = self.bytes_per_block, ""
        draft_bytes = format_bytes(self.draft_bytes_per_block)
        if self.draft_bytes_per_block and ranks > 1:  # the draft runs on rank 0 only
            per_block -= self.draft_bytes_per_block
            draft = f", and {draft_bytes} of the draft model's on rank 0"
        elif self.draft_bytes_per_block:
            draft = f", {draft_bytes} of it the draft model's"
        gib = self.num_gpu_blocks * per_block / GIB
        concurrency = (
            f"max concurrency at max_model_len ({max_model_len} tokens): {fit} requests"
            if fit
            else f"less than one request at max_model_len ({max_model_len} tokens)"
        )
        return (
            f"KV cache: {self.num_gpu_blocks} blocks x {block_size} tokens = {tokens} tokens "
            f"of {self.kv_dtype_name} ({gib:.2f} GiB, "
            f"{format_bytes(per_block)} per block{draft}){on_each_rank}; "
            f"{concurrency}"
        )


def kv_budget(
    request: PoolRequest, model: DecoderModel, draft: DecoderModel | None = None
) -> KVCacheConfig:
    """Size the pools for `model` (its config, dtype and device) as `request` says; with a
    speculative `draft` model, for blocks that hold both models' K/V."""
    kv_dtype = kv_cache_torch_dtype(request.kv_cache_dtype, model.dtype)
    spec = kv_spec(model, kv_dtype)
    block_size = request.block_size
    draft_per_block = 0
    if draft is not None:
        draft_dtype = kv_cache_torch_dtype(request.kv_cache_dtype, draft.dtype)
        draft_per_block = kv_spec(draft, draft_dtype).bytes_per_block(block_size)
    per_block = spec.bytes_per_block(block_size) + draft_per_block
    num_cpu_blocks = int(request.swap_space_gb * GIB) // per_block
    num_offload_blocks = int(request.kv_offloading_size * GIB) // per_block
    host_bytes = (num_cpu_blocks + num_offload_blocks) * per_block
    asked = "swap_space_gb and kv_offloading_size ask"
    if model.device.type == "cpu" and request.num_gpu_blocks is not None:
        host_bytes += request.num_gpu_blocks * per_block  # on a CPU the pool is host memory too
        asked = "num_gpu_blocks, swap_space_gb and kv_offloading_size ask"
    elif model.device.type == "cpu" and request.kv_cache_memory is not None:
        host_bytes += request.kv_cache_memory
        asked = "kv_cache_memory, swap_space_gb and kv_offloading_size ask"
    _check_host_pool(host_bytes, request.host_ranks, asked)

    def config(num_gpu_blocks: int) -> KVCacheConfig:
        return KVCacheConfig(
            block_size,
            num_gpu_blocks,
            num_cpu_blocks,
            num_offload_blocks,
            per_block,
            kv_dtype,
            spec,
            draft_bytes_per_block=draft_per_block,
        )

    if request.num_gpu_blocks is not None:
        return config(request.num_gpu_blocks)
    if request.kv_cache_memory is not None:
        memory = request.kv_cache_memory
    elif model.device.type == "cuda":
        memory = _free_device_memory(request, model, kv_dtype)
    else:
        memory = min(CPU_KV_CACHE_BYTES, _available_host_memory() // 2)
    num_blocks = memory // per_block
    if num_blocks <= 0:
        drafts = ""
        if draft is not None:
            drafts = f", {format_bytes(draft_per_block)} of it the draft model's"
        raise KVCacheTooSmallForModel(
            f"{format_bytes(max(memory, 0))} left for the KV cache holds no block of "
            f"{format_bytes(per_block)}{drafts} (block_size {request.block_size}): lower "
            "block_size or give more memory"
        )
    return config(num_blocks)


def draft_kv_pool(draft: DecoderModel, config: KVCacheConfig, kv_cache_dtype: str) -> KVCache:
    """The draft model's K/V for the same block ids as the pool `config` sizes (and the same
    CPU blocks): every plan the memory manager makes moves both models' blocks alike."""
    return KVCache.for_model(
        draft,
        block_size=config.block_size,
        num_blocks=config.num_gpu_blocks,
        num_cpu_blocks=config.num_cpu_blocks + config.num_offload_blocks,
        dtype=kv_cache_torch_dtype(kv_cache_dtype, draft.dtype),
    )


def kv_pool(model: DecoderModel, config: KVCacheConfig) -> KVCache:
    """The cache tensors `config` sizes, on the model's device: the swap space's blocks
    followed by the host tier's in the one CPU tensor (split, not shared: see
    memory/host_tier.py)."""
    return KVCache.for_model(  # the model's device; its dtype or fp8
        model,
        block_size=config.block_size,
        num_blocks=config.num_gpu_blocks,
        num_cpu_blocks=config.num_cpu_blocks + config.num_offload_blocks,
        dtype=config.kv_dtype,
    )


def _free_device_memory(request: PoolRequest, model: DecoderModel, kv_dtype: torch.dtype) -> int:
    """Bytes for KV: the utilisation share of the device, less what is used and the peak step."""
    device = model.device
    torch.cuda.synchronize(device)
    activation_peak = _profile_activations(request, model, device, kv_dtype)
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    return int(total * request.gpu_memory_utilization) - used - activation_peak


def _profile_activations(
    request: PoolRequest, model: DecoderModel, device: torch.device, kv_dtype: torch.dtype
) -> int:
    """Peak extra memory of one forward pass over a full token budget of prompt tokens, into
    a cache of the dtype the pool will store (an fp8 write has its own scratch)."""
    block_size = request.block_size
    num_tokens = request.max_num_batched_tokens
    seq_len = min(num_tokens, request.max_model_len)
    num_full, rest = divmod(num_tokens, seq_len)
    lengths = [seq_len] * num_full + ([rest] if rest else [])
    blocks_per_seq = -(-seq_len // block_size)
    cache = KVCache.for_model(
        model, block_size=block_size, num_blocks=blocks_per_seq * len(lengths), dtype=kv_dtype
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


def _check_host_pool(num_bytes: int, ranks: int, asked: str) -> None:
    """Refuse pools in host memory (swap space, host tier and, on a CPU, a KV pool sized by
    hand; once per rank on this host) above `HOST_POOL_SHARE` of the host's physical memory,
    before anything is allocated: a clear error naming the settings (`asked`), not an
    allocator's, or the machine running out of memory while serving."""
    total = _physical_host_memory()
    if num_bytes * ranks > HOST_POOL_SHARE * total:
        each = f" on each of {ranks} ranks" if ranks > 1 else ""
        raise HostPoolTooLarge(
            f"{asked} for {num_bytes / GIB:.2f} GiB of host memory{each}, more than "
            f"{HOST_POOL_SHARE:.0%} of this host's {total / GIB:.2f} GiB"
        )


def _physical_host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _available_host_memory() -> int:
    """MemAvailable from /proc/meminfo, else physical memory (POSIX systems without it)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return _physical_host_memory()
