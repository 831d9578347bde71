"""Paged decode attention against dense attention over a contiguous cache, on CPU.

Shapes follow Llama-3-8B: 32 query heads sharing 8 KV heads (GQA 4), head dim 128, float32,
a batch of 32 sequences decoding one token each. The paged cache holds every sequence's blocks
in a shuffled shared pool, as after a while of serving; the dense cache is one contiguous
``[batch, kv_heads, context, head_dim]`` tensor per K and V, the best case for attention.

Dense baselines:
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)``, the
  ratio the goal (paged / dense <= 1.2) is stated against;
- ``matmul``: the same grouped-query matmul -> softmax -> matmul that the paged kernel does,
  over the contiguous cache, i.e. the cost of paging itself with everything else equal.

The machine may be shared, so the three run interleaved, several times, and medians are
reported. Run: ``python bench/attention_bench.py [--reps N] [--block-size B]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedkv.model.attention import paged_attention

BATCH, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 32, 8, 128


def main() -> None:
    """Time each attention per context length and print medians and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15, help="timed calls per implementation")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    args = parser.parse_args()
    print(
        f"batch {BATCH}, {NUM_HEADS} query heads / {NUM_KV_HEADS} KV heads "
        f"(GQA {NUM_HEADS // NUM_KV_HEADS}), head dim {HEAD_DIM}, float32, "
        f"block size {args.block_size}, {torch.get_num_threads()} threads, "
        f"median of {args.reps}, load average {os.getloadavg()[0]:.1f} at start"
    )
    print(
        f"{'context':>8} {'paged ms':>9} {'sdpa ms':>9} {'matmul ms':>10} "
        f"{'paged/sdpa':>11} {'paged/matmul':>13}"
    )
    for context_len in args.contexts:
        calls = make_calls(context_len, args.block_size)
        times = time_interleaved(calls, args.reps)
        paged, sdpa, matmul = (statistics.median(times[name]) * 1e3 for name in calls)
        print(
            f"{context_len:>8} {paged:>9.1f} {sdpa:>9.1f} {matmul:>10.1f} "
            f"{paged / sdpa:>11.2f} {paged / matmul:>13.2f}"
        )
        del calls


def make_calls(context_len: int, block_size: int) -> dict[str, Callable[[], torch.Tensor]]:
    """Build both caches holding the same keys and values, check they agree, return the calls."""
    gen = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    blocks_per_seq = context_len // block_size
    num_blocks = BATCH * blocks_per_seq
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    block_tables = torch.randperm(num_blocks, generator=gen).view(BATCH, blocks_per_seq)
    context_lens = torch.full((BATCH,), context_len)
    query_lens = torch.ones(BATCH, dtype=torch.long)
    query = torch.randn(BATCH, NUM_HEADS, HEAD_DIM, generator=gen)

    # The contiguous cache the dense baselines read: [batch, kv_heads, context, head_dim].
    def contiguous(cache: torch.Tensor) -> torch.Tensor:
        per_seq = cache[block_tables].view(BATCH, context_len, NUM_KV_HEADS, HEAD_DIM)
        return per_seq.transpose(1, 2).contiguous()

    keys, values = contiguous(k_cache), contiguous(v_cache)
    group = NUM_HEADS // NUM_KV_HEADS

    def paged() -> torch.Tensor:
        return paged_attention(
            query, k_cache, v_cache, block_tables, context_lens, query_lens, scale
        )

    def sdpa() -> torch.Tensor:
        q = query.view(BATCH, NUM_HEADS, 1, HEAD_DIM)
        out = F.scaled_dot_product_attention(q, keys, values, scale=scale, enable_gqa=True)
        return out.view(BATCH, NUM_HEADS, HEAD_DIM)

    def matmul() -> torch.Tensor:
        q = query.view(BATCH, NUM_KV_HEADS, group, HEAD_DIM)
        probs = (q @ keys.transpose(2, 3)).mul_(scale).softmax(dim=-1)
        return (probs @ values).view(BATCH, NUM_HEADS, HEAD_DIM)

    calls = {"paged": paged, "sdpa": sdpa, "matmul": matmul}
    expected = sdpa()
    for name, call in calls.items():
        torch.testing.assert_close(call(), expected, rtol=1e-4, atol=1e-4, msg=name)
    return calls


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


if __name__ == "__main__":
    main()
