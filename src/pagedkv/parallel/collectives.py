"""The two collectives a sharded forward pass needs, over the default process group.

Each waits at most the group's timeout (set when `worker/parallel/` starts the group), so a
rank that died or hangs makes the others raise instead of waiting for ever.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def all_reduce(partial: Tensor) -> Tensor:
    """The sum of every rank's `partial`: what a row-parallel matmul or a vocabulary-parallel
    lookup needs to become the whole layer's output.

    Gathered, then summed in rank order on every rank: each element is
    `((p0 + p1) + p2) + ...` whatever the tensor's size, where a ring all-reduce cuts the tensor
    into chunks by its size and so sums an element in an order that depends on how many rows
    share the step. Every rank gets the very same bits."""
    pieces = [torch.empty_like(partial) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, partial.contiguous())
    total = pieces[0]
    for piece in pieces[1:]:
        total = total + piece
    return total


def gather_last_dim(local: Tensor, full_size: int) -> Tensor:
    """Every rank's `local` `[rows, n]` side by side, cut to `full_size` columns, on rank 0
    (the sampler's rank); the other ranks get `local` back, which they do not use.

    Gathered rather than sampled per rank: rank 0 then samples the whole vocabulary exactly
    as a single process does (penalties, top-k/p, logprobs), at the cost of moving
    `rows x vocab` floats once a step.
    """
    local = local.contiguous()
    if dist.get_rank() != 0:
        dist.gather(local, None, dst=0)
        return local
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.gather(local, pieces, dst=0)
    return torch.cat(pieces, dim=-1)[..., :full_size]
