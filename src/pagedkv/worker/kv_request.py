"""PoolRequest: what the KV pool sizing is told, as plain data (importable without torch, so
`EngineArgs` can make it for the simulator's commands too)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolRequest:
    """What the pool sizing is told: an explicit size, or a budget to derive one from.

    `num_gpu_blocks` wins, then `kv_cache_memory` (bytes); otherwise the device's free memory
    (`gpu_memory_utilization` on CUDA, less the activation peak of a step of
    `max_num_batched_tokens` prompt tokens in sequences of `max_model_len`) or, on a CPU,
    half the available host memory capped at `CPU_KV_CACHE_BYTES`. `kv_cache_dtype` (vLLM's
    values) says what a block stores; `kv_offloading_size` is the host tier's GiB.
    """

    block_size: int
    swap_space_gb: float
    num_gpu_blocks: int | None
    kv_cache_memory: int | None
    gpu_memory_utilization: float
    max_num_batched_tokens: int
    max_model_len: int
    kv_cache_dtype: str = "auto"
    kv_offloading_size: float = 0.0
    # Processes on this host that each allocate these CPU pools (the tensor-parallel ranks).
    host_ranks: int = 1
