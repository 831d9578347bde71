"""What the engine reports about itself: counters and gauges, and a block-by-block pool map.

`EngineStats` feeds `/metrics` and the benchmark; `KVSnapshot` feeds the page map. Both are
plain data built on demand from the scheduler's queues and the memory manager.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from pagedkv.engine.request import Request
from pagedkv.engine.spec.metrics import SpecDecodingStats
from pagedkv.memory import KVCacheManager


@dataclass(frozen=True)
class EngineStats:
    """Queues, KV memory and throughput at one moment (counters since start-up)."""

    # Requests (a request's n samples or beams count once) in each queue, one unit for all
    # three so that their sum means something on a dashboard.
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
    prompt_tokens_total: int  # whole prompts, cached tokens included, counted once (vLLM)
    generation_tokens_total: int
    tokens_per_s: float  # generated tokens per second over the last few seconds
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_size: int
    step_seconds_total: float
    forward_seconds_total: float
    kv_cache_dtype: str  # what blocks store: float32, bfloat16, float16, fp8_e4m3, fp8_e5m2
    kv_bytes_per_block: int  # one block, every layer's K and V, in that dtype (on each rank)
    tensor_parallel_size: int  # ranks each block (and the model) is split across
    # CPU threads the model runs on now: fewer than at start while other processes want the
    # cores (worker/thread_governor.py).
    cpu_threads: int
    # Speculative decoding: drafts verified and kept (all zero while it is off).
    spec_decoding: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    # The prefix cache's host tier (0 blocks: off): blocks held now, lookups and hits.
    num_offload_blocks: int = 0
    offload_blocks: int = 0
    offload_queries_total: int = 0
    offload_hits_total: int = 0

    def to_dict(self) -> dict[str, float | int]:
        """JSON-ready fields."""
        return asdict(self)


def memory_fields(manager: KVCacheManager) -> dict[str, float | int]:
    """The `EngineStats` fields the memory manager alone answers."""
    memory, offload = manager.stats, manager.offload_stats
    return dict(
        kv_usage=manager.usage,
        kv_utilisation=kv_utilisation(manager),
        prefix_queried_tokens=memory.prefix_queried_tokens,
        prefix_hit_tokens=memory.prefix_hit_tokens,
        prefix_hit_rate=memory.prefix_hit_rate,
        num_swapped_blocks=manager.num_cpu_blocks - manager.num_free_cpu_blocks,
        num_gpu_blocks=manager.num_gpu_blocks,
        num_cpu_blocks=manager.num_cpu_blocks,
        block_size=manager.block_size,
        num_offload_blocks=manager.num_offload_blocks,
        offload_blocks=offload.num_blocks,
        offload_queries_total=offload.queries,
        offload_hits_total=offload.hits,
    )


@dataclass(frozen=True)
class BlockState:
    """One physical block: who holds it (request, sample index, block index), shared, cached."""

    block_id: int
    ref_count: int
    cached: bool
    holders: list[tuple[str, int, int]]
    hit: bool = False  # a host-tier block copied back to the GPU since the last snapshot
    # Slots holding speculative drafts reserved for the next step, not accepted yet.
    draft_slots: int = 0


@dataclass(frozen=True)
class KVSnapshot:
    """Every GPU and CPU block of the pool, and the prefix cache's host tier; a block with
    ref_count 0 is free (a host-tier block is never held: `cached` says it keeps KV)."""

    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    gpu: list[BlockState]
    cpu: list[BlockState]
    offload: list[BlockState] = field(default_factory=list)
    # Runs of GPU blocks holding a LoRA adapter's weights: (first block, blocks, its name).
    adapters: tuple[tuple[int, int, str], ...] = ()

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
            "offload": [_block_dict(block) for block in self.offload],
            "adapters": [list(run) for run in self.adapters],
        }


def _block_dict(block: BlockState) -> dict[str, object]:
    return {
        "block_id": block.block_id,
        "ref_count": block.ref_count,
        "cached": block.cached,
        "holders": [list(holder) for holder in block.holders],
        "hit": block.hit,
        "draft_slots": block.draft_slots,
    }


def kv_snapshot(
    manager: KVCacheManager,
    requests: Iterable[Request],
    adapters: Sequence[tuple[int, int, str]] = (),
) -> KVSnapshot:
    """Every GPU and CPU block of `manager`: ref count, prefix-cache state, holders, and the
    slots that hold speculative drafts (the slots a sequence holds past its tokens); and the
    runs of blocks LoRA adapters hold, `(first block, blocks, name)`."""
    gpu_holders: dict[int, list[tuple[str, int, int]]] = {}
    cpu_holders: dict[int, list[tuple[str, int, int]]] = {}
    draft_slots: dict[int, int] = {}
    block_size = manager.block_size
    for request in requests:
        for seq in request.sequences:
            if seq.seq_id not in manager:
                continue
            swapped = manager.is_swapped_out(seq.seq_id)
            holders = cpu_holders if swapped else gpu_holders
            table = manager.block_table(seq.seq_id)
            for position, block in enumerate(table):
                holders.setdefault(block, []).append((request.request_id, seq.index, position))
            for slot in range(len(seq.tokens), 0 if swapped else manager.num_tokens(seq.seq_id)):
                block = table[slot // block_size]
                draft_slots[block] = draft_slots.get(block, 0) + 1
    gpu = [
        BlockState(
            block_id=block,
            ref_count=manager.block_ref_count(block),
            cached=manager.is_cached(block),
            holders=gpu_holders.get(block, []),
            draft_slots=draft_slots.get(block, 0),
        )
        for block in range(manager.num_gpu_blocks)
    ]
    no_holders: list[tuple[str, int, int]] = []  # shared by every free CPU block
    cpu = []
    for block in range(manager.num_cpu_blocks):
        holders = cpu_holders.get(block, no_holders)
        cpu.append(BlockState(block, len(holders), False, holders))
    held, hits = manager.offload_view()
    offload = [
        BlockState(block, 0, block in held, no_holders, block in hits)
        for block in range(manager.num_offload_blocks)
    ]
    return KVSnapshot(
        block_size=manager.block_size,
        num_gpu_blocks=manager.num_gpu_blocks,
        num_cpu_blocks=manager.num_cpu_blocks,
        gpu=gpu,
        cpu=cpu,
        offload=offload,
        adapters=tuple(adapters),
    )


def kv_utilisation(manager: KVCacheManager) -> float:
    """Filled token slots over the slots of every held GPU block (a shared block once)."""
    block_size = manager.block_size
    filled: dict[int, int] = {}
    for seq_id in manager.seq_ids:
        if manager.is_swapped_out(seq_id):
            continue
        num_tokens = manager.num_tokens(seq_id)
        for position, block in enumerate(manager.block_table(seq_id)):
            fill = min(block_size, num_tokens - position * block_size)
            filled[block] = max(filled.get(block, 0), fill)
    return sum(filled.values()) / (len(filled) * block_size) if filled else 0.0


def startup_line(total: float, phases: dict[str, float]) -> str:
    """`loaded in 0.90 s: weights 0.40 s, KV pool 0.10 s`: where the engine's start went
    (the total also holds what no phase names: scheduler and sampler set-up)."""
    parts = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in phases.items())
    return f"loaded in {total:.2f} s: {parts}"
