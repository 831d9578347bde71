"""Paged decode attention against per-sequence SDPA over contiguous K/V, on CPU.

Shapes follow Llama-3-8B: 32 query heads sharing 8 KV heads (GQA 4), head dim 128, float32,
one layer, every sequence decoding one token. The paged cache holds every sequence's blocks in
a shuffled shared pool, as after a while of serving. The baseline gives each sequence its own
contiguous ``[kv_heads, context, head_dim]`` K and V and calls
``torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)`` once per sequence:
the cost of attention when nothing is paged and nothing is padded. The goal is paged / that
sum <= 1.2 on every row, with paged attention's peak memory within 2x of the K/V it reads.

Rows: equal contexts (the easy case), one long context among many short ones (63 x 16 +
1 x 8,192: padding to the longest would read 64 x 8,192 keys) and 64 contexts drawn from the
ShareGPT-like workload of `pagedkv.sim.workloads` (each request caught at a random point of
its generation). The step's attention plan is built once per forward pass and shared by all
layers; its build time is printed apart (``plan ms``), the attention call alone is timed.

Peak memory is the growth of the process's resident set (Linux ``VmHWM``, reset before each
call), with glibc told to return large blocks to the system so freed memory is not reused
unseen. The machine may be shared, so the calls run interleaved, several times, and medians
are reported. Run: ``python bench/attention_bench.py [--reps N] [--block-size B]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.attention.torch_backend import key_bytes_per_block, paged_attention
from pagedkv.sim.workloads import generate_requests, workload

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
MMAP_THRESHOLD = "65536"  # glibc: blocks above 64 KiB are mmapped and unmapped when freed


@dataclass
class Case:
    """One row of the bench: a decode batch, paged and contiguous, ready to call."""

    paged: Callable[[], torch.Tensor]
    per_seq_sdpa: Callable[[], torch.Tensor]
    plan_seconds: float
    kv_bytes: int  # the K and V the batch reads


def main() -> None:
    """Time and measure every row, printing ratios measured side by side."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=11, help="timed calls per implementation")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: stable on a shared machine)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = {
        "32 x 1,024": [1024] * 32,
        "32 x 4,096": [4096] * 32,
        "63 x 16 + 1 x 8,192": [16] * 63 + [8192],
        "64 ShareGPT": sharegpt_contexts(64),
    }
    print(
        f"{NUM_HEADS} query heads / {NUM_KV_HEADS} KV heads (GQA {NUM_HEADS // NUM_KV_HEADS}), "
        f"head dim {HEAD_DIM}, float32, block size {args.block_size}, "
        f"{torch.get_num_threads()} threads, median of {args.reps}, "
        f"load average {os.getloadavg()[0]:.1f} at start"
    )
    print(
        f"{'batch':>20} {'keys':>7} {'paged ms':>9} {'sdpa ms':>8} {'paged/sdpa':>11} "
        f"{'plan ms':>8} {'K/V MB':>7} {'paged peak MB':>14} {'peak/KV':>8}"
    )
    for name, contexts in rows.items():
        case = make_case(contexts, args.block_size)
        times = time_interleaved({"paged": case.paged, "sdpa": case.per_seq_sdpa}, args.reps)
        paged, sdpa = (statistics.median(times[key]) * 1e3 for key in ("paged", "sdpa"))
        peak = peak_memory(case.paged)
        print(
            f"{name:>20} {sum(contexts):>7} {paged:>9.1f} {sdpa:>8.1f} {paged / sdpa:>11.2f} "
            f"{case.plan_seconds * 1e3:>8.2f} {case.kv_bytes / 1e6:>7.1f} {peak / 1e6:>14.1f} "
            f"{peak / case.kv_bytes:>8.2f}"
        )
        del case


def sharegpt_contexts(count: int) -> list[int]:
    """Context lengths of `count` ShareGPT-like requests, each at a random point of its output."""
    requests = generate_requests(workload("sharegpt"), count, seed=0)
    rng = np.random.default_rng(1)
    return [r.prompt_len + int(rng.integers(1, r.output_len + 1)) for r in requests]


def make_case(contexts: list[int], block_size: int) -> Case:
    """Build both layouts holding the same keys and values, check they agree, return the calls."""
    gen = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    num_seqs = len(contexts)
    blocks_per_seq = [-(-n // block_size) for n in contexts]
    num_blocks = sum(blocks_per_seq)
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    physical = torch.randperm(num_blocks, generator=gen).split(blocks_per_seq)
    block_tables = torch.zeros(num_seqs, max(blocks_per_seq), dtype=torch.int32)
    for row, table in zip(block_tables, physical, strict=True):
        row[: len(table)] = table
    query = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, generator=gen)

    def contiguous(cache: torch.Tensor, table: torch.Tensor, context: int) -> torch.Tensor:
        per_seq = cache[table].view(-1, NUM_KV_HEADS, HEAD_DIM)[:context]
        return per_seq.transpose(0, 1)[None].contiguous()  # [1, kv_heads, context, head_dim]

    keys = [contiguous(k_cache, t, n) for t, n in zip(physical, contexts, strict=True)]
    values = [contiguous(v_cache, t, n) for t, n in zip(physical, contexts, strict=True)]
    queries = [q.view(1, NUM_HEADS, 1, HEAD_DIM) for q in query]

    start = time.perf_counter()
    metadata = AttentionMetadata.build(
        block_tables,
        contexts,
        [1] * num_seqs,
        block_size,
        None,
        key_bytes_per_block(k_cache, k_cache.dtype),
    )
    plan_seconds = time.perf_counter() - start

    def paged() -> torch.Tensor:
        return paged_attention(query, k_cache, v_cache, metadata, scale)

    def per_seq_sdpa() -> torch.Tensor:
        outputs = [
            F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
            for q, k, v in zip(queries, keys, values, strict=True)
        ]
        return torch.cat(outputs).view(num_seqs, NUM_HEADS, HEAD_DIM)

    torch.testing.assert_close(paged(), per_seq_sdpa(), rtol=1e-4, atol=1e-4)
    kv_bytes = 2 * sum(contexts) * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
    return Case(paged, per_seq_sdpa, plan_seconds, kv_bytes)


def time_interleaved(
    calls: dict[str, Callable[[], torch.Tensor]], reps: int
) -> dict[str, list[float]]:
    """Seconds per call, alternating implementations so load changes hit them all alike."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(reps):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return times


def peak_memory(call: Callable[[], torch.Tensor]) -> int:
    """Bytes the resident set grew by at its peak while `call` ran (its result included)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # resets VmHWM to the current resident set
    before = _status_bytes("VmRSS")
    call()
    return _status_bytes("VmHWM") - before


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


if __name__ == "__main__":
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
        # Must be set before the process starts: glibc reads it once, at its first malloc.
        os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
        os.execv(sys.executable, [sys.executable, *sys.argv])
    main()
