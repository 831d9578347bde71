"""Paged KV memory benchmark: block-op cost, prefix-hit cost, and KV utilisation.

Prints, in one run:
- ns per block for allocate + free cycles over 1M blocks (prefix caching off and on);
- ns per block of a prefix-cache lookup that hits;
- KV utilisation on the paged-attention tutorial's workload (outputs Normal(500, 200)
  clipped to [200, 2048], block 16) at batch sizes 10..200: paged blocks from
  KVCacheManager against slab reservations of 2048 tokens from SlabAllocator.

Costs are this thread's CPU time: on a shared machine wall time also counts the time other
processes hold the CPU, so it is printed beside it, with the load average during the run.

Run: .venv/bin/python bench/memory_bench.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

from pagedkv.memory import KVCacheManager
from pagedkv.memory.hashing import ROOT_HASH, chain_hashes
from pagedkv.memory.tokens import token_array
from pagedkv.sim.sweep import utilisation_by_batch_size
from pagedkv.sim.workloads import generate_requests, workload

BLOCK_SIZE = 16
TOTAL_BLOCKS = 1_000_000
BLOCKS_PER_SEQ = 1_000
REPEATS = 5
GOAL_NS_PER_OP = 1000


def measure(run: Callable[[], int], repeats: int) -> tuple[float, float]:
    """Median (CPU, wall) ns per block of `run`, which returns how many blocks it handled."""
    cpu, wall = [], []
    for _ in range(repeats):
        cpu_start, wall_start = time.thread_time_ns(), time.perf_counter_ns()
        num_blocks = run()
        cpu.append((time.thread_time_ns() - cpu_start) / num_blocks)
        wall.append((time.perf_counter_ns() - wall_start) / num_blocks)
    return statistics.median(cpu), statistics.median(wall)


def time_alloc_free_cycle(enable_prefix_caching: bool) -> tuple[float, float]:
    """ns per block to allocate then free 1M blocks, in sequences of 1,000 blocks.

    Every sequence of every repeat has a cache salt of its own, so with prefix caching on no
    prompt ever hits: each block is hashed, missed, cached on mark_computed and evicted when
    a later repeat reuses it, the full lifecycle (and one prompt list serves them all).
    """
    tokens_per_seq = BLOCKS_PER_SEQ * BLOCK_SIZE
    num_seqs = TOTAL_BLOCKS // BLOCKS_PER_SEQ
    prompt = list(range(tokens_per_seq))
    manager = KVCacheManager(TOTAL_BLOCKS, BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching)
    repeats = iter(range(REPEATS))

    def cycle() -> int:
        repeat = next(repeats)
        for seq_id in range(num_seqs):
            manager.allocate(seq_id, prompt, cache_salt=f"{repeat}/{seq_id}")
            manager.mark_computed(seq_id, tokens_per_seq)
        for seq_id in range(num_seqs):
            manager.free(seq_id)
        return TOTAL_BLOCKS

    return measure(cycle, REPEATS)


def time_hashing() -> tuple[float, float]:
    """ns per block to check, encode and SHA-256 chain-hash 1,000-block prompts."""
    prompt = list(range(BLOCKS_PER_SEQ * BLOCK_SIZE))

    def hash_prompt() -> int:
        for _ in chain_hashes(ROOT_HASH, token_array("bench", prompt).tobytes(), BLOCK_SIZE):
            pass
        return BLOCKS_PER_SEQ

    return measure(hash_prompt, REPEATS * 4)


def time_prefix_hit() -> tuple[float, float]:
    """ns per block for a prompt whose blocks are all prefix-cache hits (but the last)."""
    prompt = list(range(BLOCKS_PER_SEQ * BLOCK_SIZE))
    manager = KVCacheManager(2 * BLOCKS_PER_SEQ, BLOCK_SIZE)
    manager.allocate("warm", prompt)
    manager.mark_computed("warm", len(prompt))
    manager.free("warm")

    def hit() -> int:
        hit_tokens = manager.allocate("hit", prompt)
        manager.free("hit")
        return hit_tokens // BLOCK_SIZE

    return measure(hit, 50)


def load_average() -> str:
    """The 1-minute load average against the CPU count: how shared the machine is now."""
    return f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    print(f"Block operations (median of repeats; CPU time, wall in brackets; {load_average()})")
    no_cache = time_alloc_free_cycle(enable_prefix_caching=False)
    with_cache = time_alloc_free_cycle(enable_prefix_caching=True)
    for label, (cpu, wall), num_ops in (
        ("allocate+free, prefix caching off", no_cache, 2),
        ("allocate+mark_computed+free, caching on", with_cache, 3),
    ):
        per_op = cpu / num_ops
        verdict = "met" if per_op <= GOAL_NS_PER_OP else "not met"
        print(
            f"  {label:<42} {cpu:5.0f} ns/block [{wall:5.0f}] = {num_ops} ops x {per_op:4.0f} ns "
            f"(goal <= {GOAL_NS_PER_OP} per op: {verdict})"
        )
    for label, (cpu, wall) in (
        ("  of which checking + SHA-256 chain hashing", time_hashing()),
        ("prefix-cache lookup that hits", time_prefix_hit()),
    ):
        print(f"  {label:<42} {cpu:5.0f} ns/block [{wall:5.0f}]")
    print(f"  (after the block operations: {load_average()})")

    print("\nKV utilisation, tutorial workload (outputs Normal(500, 200) in [200, 2048], block 16)")
    print("  batch   slab@2048   paged")
    batch_sizes = [10, 25, 50, 100, 200]
    requests = generate_requests(workload("tutorial"), max(batch_sizes), seed=args.seed)
    points = utilisation_by_batch_size(
        requests, batch_sizes, block_size=BLOCK_SIZE, max_model_len=2048
    )
    by_batch: dict[int, dict[str, float]] = {}
    for point in points:
        by_batch.setdefault(point.batch_size, {})[point.scheme] = point.utilisation_at_completion
    for batch_size, schemes in by_batch.items():
        print(f"  {batch_size:5d}   {schemes['slab-max']:8.1%}   {schemes['paged']:6.1%}")
    print("  (at completion: each request at its largest, token state / KV memory it holds then;")
    print("   goal paged >= 98%, slab ~24%)")


if __name__ == "__main__":
    main()
