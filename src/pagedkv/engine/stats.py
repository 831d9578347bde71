"""What the engine reports about itself: counters and gauges, and a block-by-block pool map.

`EngineStats` feeds `/metrics` and the benchmark; `KVSnapshot` feeds the page map. Both are
plain data built on demand from the scheduler's queues and the memory manager.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class EngineStats:
    """Queues, KV memory and throughput at one moment (counters since start-up)."""

    num_running: int
    num_waiting: int
    num_swapped: int
    kv_usage: float  # held GPU blocks / all GPU blocks
    kv_utilisation: float  # token slots filled / slots of held blocks (shared blocks once)
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float
    num_swap_preemptions: int
    num_recompute_preemptions: int
    num_swapped_blocks: int  # blocks now in the CPU pool
    prompt_tokens_total: int
    generation_tokens_total: int
    tokens_per_s: float  # generated tokens per second over the last few seconds
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_size: int
    step_seconds_total: float
    forward_seconds_total: float

    def to_dict(self) -> dict[str, float | int]:
        """JSON-ready fields."""
        return asdict(self)


@dataclass(frozen=True)
class BlockState:
    """One physical block: who holds it (request, sample index, block index), shared, cached."""

    block_id: int
    ref_count: int
    cached: bool
    holders: list[tuple[str, int, int]]


@dataclass(frozen=True)
class KVSnapshot:
    """Every GPU and CPU block of the pool; a block with ref_count 0 is free."""

    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    gpu: list[BlockState]
    cpu: list[BlockState]

    def to_dict(self) -> dict[str, object]:
        """JSON-ready data: holders as [request_id, sample, block_index] lists.

        Written out by hand: `dataclasses.asdict` deep-copies every field, which is slow
        for pools of a hundred thousand blocks.
        """
        return {
            "block_size": self.block_size,
            "num_gpu_blocks": self.num_gpu_blocks,
            "num_cpu_blocks": self.num_cpu_blocks,
            "gpu": [_block_dict(block) for block in self.gpu],
            "cpu": [_block_dict(block) for block in self.cpu],
        }


def _block_dict(block: BlockState) -> dict[str, object]:
    return {
        "block_id": block.block_id,
        "ref_count": block.ref_count,
        "cached": block.cached,
        "holders": [list(holder) for holder in block.holders],
    }
