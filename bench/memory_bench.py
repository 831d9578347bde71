"""Paged KV memory benchmark: block-op cost, prefix-hit cost, and KV utilisation.

Prints, in one run:
- ns per block for allocate + free cycles over 1M blocks (prefix caching off and on);
- ns per block of a prefix-cache lookup that hits;
- KV utilisation on the paged-attention tutorial's workload (outputs Normal(500, 200)
  clipped to [200, 2048], block 16) at batch sizes 10..200: paged blocks from
  KVCacheManager against slab reservations of 2048 tokens from SlabAllocator.

Run: .venv/bin/python bench/memory_bench.py
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedkv.memory import KVCacheManager
from pagedkv.memory.hashing import ROOT_HASH, chain_hashes
from pagedkv.memory.tokens import token_array
from pagedkv.sim.sweep import utilisation_by_batch_size
from pagedkv.sim.workloads import generate_requests, workload

BLOCK_SIZE = 16
TOTAL_BLOCKS = 1_000_000
BLOCKS_PER_SEQ = 1_000
REPEATS = 5


def time_alloc_free_cycle(enable_prefix_caching: bool) -> float:
    """Median ns per block to allocate then free 1M blocks, in sequences of 1,000 blocks.

    Prompts are distinct, so with prefix caching on every block is hashed, missed, cached
    on mark_computed and later evicted: the full lifecycle, not just the free queue.
    """
    tokens_per_seq = BLOCKS_PER_SEQ * BLOCK_SIZE
    num_seqs = TOTAL_BLOCKS // BLOCKS_PER_SEQ
    prompts = [list(range(i * tokens_per_seq, (i + 1) * tokens_per_seq)) for i in range(num_seqs)]
    manager = KVCacheManager(TOTAL_BLOCKS, BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching)
    samples = []
    for _ in range(REPEATS):
        start = time.perf_counter_ns()
        for seq_id, prompt in enumerate(prompts):
            manager.allocate(seq_id, prompt)
            manager.mark_computed(seq_id, tokens_per_seq)
        for seq_id in range(num_seqs):
            manager.free(seq_id)
        samples.append((time.perf_counter_ns() - start) / TOTAL_BLOCKS)
    return statistics.median(samples)


def time_hashing() -> float:
    """Median ns per block to check, encode and SHA-256 chain-hash 1,000-block prompts."""
    prompt = list(range(BLOCKS_PER_SEQ * BLOCK_SIZE))
    samples = []
    for _ in range(REPEATS * 4):
        start = time.perf_counter_ns()
        for _ in chain_hashes(ROOT_HASH, token_array("bench", prompt).tobytes(), BLOCK_SIZE):
            pass
        samples.append((time.perf_counter_ns() - start) / BLOCKS_PER_SEQ)
    return statistics.median(samples)


def time_prefix_hit() -> float:
    """Median ns per block for a prompt whose blocks are all prefix-cache hits (but the last)."""
    prompt = list(range(BLOCKS_PER_SEQ * BLOCK_SIZE))
    manager = KVCacheManager(2 * BLOCKS_PER_SEQ, BLOCK_SIZE)
    manager.allocate("warm", prompt)
    manager.mark_computed("warm", len(prompt))
    manager.free("warm")
    samples = []
    for repeat in range(50):
        start = time.perf_counter_ns()
        hit_tokens = manager.allocate(repeat, prompt)
        elapsed = time.perf_counter_ns() - start
        manager.free(repeat)
        samples.append(elapsed / (hit_tokens // BLOCK_SIZE))
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    print("Block operations (median of repeats)")
    no_cache = time_alloc_free_cycle(enable_prefix_caching=False)
    with_cache = time_alloc_free_cycle(enable_prefix_caching=True)
    hashing = time_hashing()
    for label, per_block, num_ops in (
        ("allocate+free, prefix caching off", no_cache, 2),
        ("allocate+mark_computed+free, caching on", with_cache, 3),
    ):
        per_op = per_block / num_ops
        verdict = "met" if per_op <= 1000 else "not met"
        print(
            f"  {label:<44} {per_block:5.0f} ns/block = {num_ops} ops x {per_op:4.0f} ns "
            f"(goal <= 1000 per op: {verdict})"
        )
    print(f"  {'  of which SHA-256 chain hashing of the tokens':<44} {hashing:5.0f} ns/block")
    print(f"  {'prefix-cache lookup that hits':<44} {time_prefix_hit():5.0f} ns/block")

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
