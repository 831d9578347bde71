"""What every rank does the same way before the first step: load its shard, agree on the pool.

Rank 0 and the workers call these with the same arguments (rank 0 broadcasts them), so each
rank's model is its slice of the same weights and each rank's KV cache has the same number of
blocks: a block id means the same block everywhere, and each rank's block holds only its heads.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pagedkv.parallel.group import TPGroup, sharding
from pagedkv.weights.load import LoadedModel, load
from pagedkv.worker.kv_budget import KVCacheConfig, kv_budget
from pagedkv.worker.kv_request import PoolRequest
from pagedkv.worker.parallel.link import Link
from pagedkv.worker.parallel.messages import LoadSpec


def load_shard(spec: LoadSpec, group: TPGroup, device: torch.device) -> LoadedModel:
    """This rank's shard of the model, quantised weights included (each layer cuts its slice
    of the file's blocks, `Linear._shard`)."""
    with sharding(group):
        return load(spec.model, device=device, **spec.load_options())


def agreed_budget(
    link: Link, request: PoolRequest, model: torch.nn.Module, draft: torch.nn.Module | None = None
) -> KVCacheConfig:
    """Every rank sizes its pool from its own memory (a GPU pool profiles one forward pass,
    which every rank runs together); the group keeps the smallest count of device, CPU swap
    and host-tier blocks, so every rank holds every block. Rank 0 alone runs a speculative
    `draft` model, whole: its blocks also hold the draft's K/V, so it usually holds the
    fewest, and may find no room where the others do. A rank that cannot size its pool still
    joins the agreement (with -1), so every rank stops at once: that rank with its reason,
    the others naming it."""
    try:
        budget = kv_budget(request, model, draft)
    except ValueError as error:
        link.agree_min([-1, -1, -1])
        raise error from None
    gpu_blocks, cpu_blocks, offload_blocks = link.agree_min(
        [budget.num_gpu_blocks, budget.num_cpu_blocks, budget.num_offload_blocks]
    )
    if gpu_blocks < 0:
        raise ValueError(
            "another rank cannot hold the KV pool (rank 0 says why, or that rank's log does)"
        )
    return replace(
        budget,
        num_gpu_blocks=gpu_blocks,
        num_cpu_blocks=cpu_blocks,
        num_offload_blocks=offload_blocks,
        tensor_parallel_size=link.size,
    )
