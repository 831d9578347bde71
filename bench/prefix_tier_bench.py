"""The prefix cache's host tier on a multi-turn chat workload, tier off and on, in one run.

N conversations x T turns: each turn's prompt is the conversation so far (a system prompt,
then every user message and answer) plus a new user message; all conversations send turn t,
the engine answers them, then turn t + 1. The KV pool holds about a quarter of the
conversations' combined final history, so by the next turn most histories were evicted: with
the tier off they are recomputed, with it on they are copied back from host RAM.

Prints, per setting: prompt tokens computed (prompt tokens not served by either cache level),
mean and p90 time to first token, generated tokens per second over the whole run, and the
host tier's block hits. Token ids are seeded random, so the run is reproducible.

Run: .venv/bin/python bench/prefix_tier_bench.py [--model M] [--conversations 64] [--turns 6]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from dataclasses import dataclass

from pagedkv.engine import Engine, EngineArgs, SamplingParams
from pagedkv.hub import DEFAULT_MODEL


@dataclass(frozen=True)
class Result:
    computed_prompt_tokens: int
    ttfts: list[float]
    tokens_per_s: float
    tier_hits: int


def run(args: argparse.Namespace, offloading_gib: float, num_gpu_blocks: int) -> Result:
    engine = Engine(
        EngineArgs(
            model=args.model,
            num_gpu_blocks=num_gpu_blocks,
            kv_offloading_size=offloading_gib,
            swap_space_gb=0.5,
        )
    )
    rng = random.Random(args.seed)
    vocab = engine.config.vocab_size
    histories = [
        [rng.randrange(vocab) for _ in range(args.system_tokens)] for _ in range(args.conversations)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens, ignore_eos=True)
    ttfts: list[float] = []
    generated = 0
    started = time.perf_counter()
    for turn in range(args.turns):
        for chat, history in enumerate(histories):
            history.extend(rng.randrange(vocab) for _ in range(args.message_tokens))
            engine.add_request(f"{turn}-{chat}", list(history), params)
        answers: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for delta in engine.step():
                answers.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
                if delta.finished:
                    metrics = delta.metrics
                    ttfts.append(metrics.first_token_time - metrics.arrival_time)
        for chat, history in enumerate(histories):
            history.extend(answers[f"{turn}-{chat}"])
            generated += len(answers[f"{turn}-{chat}"])
    elapsed = time.perf_counter() - started
    stats = engine.stats
    return Result(
        stats.prefix_queried_tokens - stats.prefix_hit_tokens,
        ttfts,
        generated / elapsed,
        stats.offload_hits_total,
    )


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, folder or .gguf")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=96)
    parser.add_argument("--message-tokens", type=int, default=40)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--pool-share", type=float, default=0.25, help="of the combined history")
    parser.add_argument("--offloading-gib", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    final = args.system_tokens + args.turns * (args.message_tokens + args.answer_tokens)
    combined_blocks = args.conversations * -(-final // 16)
    num_gpu_blocks = max(-(-final // 16) + 1, int(combined_blocks * args.pool_share))
    print(
        f"{args.conversations} conversations x {args.turns} turns, final history {final} "
        f"tokens each ({combined_blocks} blocks in all); KV pool {num_gpu_blocks} blocks; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    results = {
        "tier off": run(args, 0.0, num_gpu_blocks),
        f"tier on ({args.offloading_gib:g} GiB)": run(args, args.offloading_gib, num_gpu_blocks),
    }
    print(
        f"{'':<18}{'prompt tokens computed':>24}{'mean TTFT':>12}{'p90 TTFT':>11}"
        f"{'tokens/s':>10}{'tier hits':>11}"
    )
    for name, result in results.items():
        print(
            f"{name:<18}{result.computed_prompt_tokens:>24,}{statistics.mean(result.ttfts):>11.2f}s"
            f"{p90(result.ttfts):>10.2f}s{result.tokens_per_s:>10.1f}{result.tier_hits:>11,}"
        )
    off, on = results.values()
    print(
        f"tier on / off: {on.computed_prompt_tokens / off.computed_prompt_tokens:.2f}x prompt "
        f"tokens computed, {statistics.mean(on.ttfts) / statistics.mean(off.ttfts):.2f}x mean "
        f"TTFT, {on.tokens_per_s / off.tokens_per_s:.2f}x tokens/s"
    )


if __name__ == "__main__":
    main()
