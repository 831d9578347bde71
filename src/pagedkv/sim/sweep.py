"""Utilisation against batch size: a batch of B requests, served whole, slab against paged.

For each batch size B the first B requests of the stream arrive together into a pool just
large enough for B slab reservations at max_model_len beside the scheduler's watermark, and
every sample may run at once, so no scheme ever queues or preempts and the only difference
left is how each scheme holds memory. That isolates the tutorial's
question: what fraction of held KV memory does token state fill, as batches grow?
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from pagedkv.engine.sched.scheduler import WATERMARK_FRACTION
from pagedkv.sim.report import summarize
from pagedkv.sim.schemes import make_scheme
from pagedkv.sim.simulator import simulate
from pagedkv.sim.workloads import WorkloadError, WorkloadRequest


@dataclass(frozen=True)
class SweepPoint:
    """One scheme's utilisation serving one batch."""

    batch_size: int
    scheme: str
    utilisation_at_completion: float
    mean_utilisation: float
    peak_utilisation_over_time: float


def utilisation_by_batch_size(
    requests: list[WorkloadRequest],
    batch_sizes: list[int],
    *,
    block_size: int,
    max_model_len: int,
    schemes: tuple[str, ...] = ("slab-max", "paged"),
    on_step: Callable[[int], None] | None = None,
) -> list[SweepPoint]:
    """Serve the first B of `requests` for each B in `batch_sizes`, under each scheme."""
    if max(batch_sizes) > len(requests):
        raise WorkloadError(
            f"batch size {max(batch_sizes)} needs that many requests, the stream has "
            f"{len(requests)}"
        )
    points = []
    for batch_size in batch_sizes:
        batch = [replace(request, arrival_step=0) for request in requests[:batch_size]]
        num_samples = sum(request.n for request in batch)
        num_blocks = _pool_blocks(num_samples * max_model_len, block_size)
        for name in schemes:
            scheme = make_scheme(name, num_blocks, block_size, max_model_len)
            summary = summarize(simulate(batch, scheme, max_num_seqs=num_samples, on_step=on_step))
            points.append(
                SweepPoint(
                    batch_size,
                    name,
                    summary.utilisation_at_completion,
                    summary.mean_utilisation,
                    summary.peak_utilisation_over_time,
                )
            )
    return points


def fillable_batch_sizes(batch_sizes: list[int], num_requests: int) -> list[int]:
    """The batch sizes a stream of `num_requests` fills; its whole length if it fills none."""
    return [size for size in batch_sizes if size <= num_requests] or [num_requests]


def _pool_blocks(slab_slots: int, block_size: int) -> int:
    """Blocks for `slab_slots`, and the watermark the scheduler keeps free of a pool that
    size (a share of the pool, at least one block)."""
    slab_blocks = -(-slab_slots // block_size)
    return math.ceil(slab_blocks / (1 - WATERMARK_FRACTION)) + 1
