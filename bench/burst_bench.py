"""A burst of requests with one system prompt, prefix caching off and on, in one run.

N requests arrive at once, each the same system prompt plus a question of its own (the shape
of an application's traffic after a deploy, or a batch job). With prefix caching on, the
prompts admitted in the burst's first step share the system prompt's full blocks with the
first one, which computes them in that very step (`KVCacheManager.mark_scheduled`); with it
off, every request computes the whole system prompt.

Prints, per setting (rounds alternating, so a drift in the machine's load touches both):
prompt tokens computed (not served by the prefix cache), the most KV blocks held at once,
mean and p90 time to first token and the seconds the whole burst took; then on / off ratios.
Token ids are seeded random, so the run is reproducible. Run it under an earlier tree
(`PYTHONPATH=<tree>/src`) to see that tree's figures on the same settings.

Run: .venv/bin/python bench/burst_bench.py [--model M] [--requests 16] [--system-tokens 512]
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
    peak_blocks: int
    ttfts: list[float]
    seconds: float


def run(engine: Engine, args: argparse.Namespace, round_index: int) -> Result:
    """One burst on a warm engine whose prefix cache is empty."""
    assert engine.manager.reset_prefix_cache(), "the engine still holds requests"
    rng = random.Random(args.seed + round_index)
    vocab = engine.config.vocab_size
    system = [rng.randrange(vocab) for _ in range(args.system_tokens)]
    params = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens, ignore_eos=True)
    before = engine.stats
    started = time.perf_counter()
    for index in range(args.requests):
        question = [rng.randrange(vocab) for _ in range(args.question_tokens)]
        engine.add_request(f"{round_index}-{index}", system + question, params)
    ttfts: list[float] = []
    peak_blocks = 0
    while engine.has_unfinished():
        deltas = engine.step()
        held = engine.manager.num_gpu_blocks - engine.manager.num_free_blocks
        peak_blocks = max(peak_blocks, held)
        for delta in deltas:
            if delta.finished:
                ttfts.append(delta.metrics.first_token_time - delta.metrics.arrival_time)
    seconds = time.perf_counter() - started
    hits = engine.stats.prefix_hit_tokens - before.prefix_hit_tokens
    computed = args.requests * (args.system_tokens + args.question_tokens) - hits
    return Result(computed, peak_blocks, ttfts, seconds)


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, folder or .gguf")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    prompt = args.system_tokens + args.question_tokens
    print(
        f"{args.requests} requests at once, a {args.system_tokens}-token system prompt + "
        f"{args.question_tokens} tokens each, {args.answer_tokens} new tokens; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    engines = {
        name: Engine(
            EngineArgs(
                model=args.model,
                enable_prefix_caching=caching,
                num_gpu_blocks=args.requests * (-(-(prompt + args.answer_tokens) // 16) + 1),
            )
        )
        for name, caching in (("prefix caching off", False), ("prefix caching on", True))
    }
    for engine in engines.values():  # warm-up: kernels, threads, first allocations
        engine.add_request("warm-up", list(range(1, 40)), SamplingParams(max_tokens=4))
        while engine.has_unfinished():
            engine.step()
    results: dict[str, list[Result]] = {name: [] for name in engines}
    for round_index in range(args.rounds):
        order = list(engines) if round_index % 2 == 0 else list(reversed(engines))
        for name in order:
            result = run(engines[name], args, round_index)
            results[name].append(result)
            print(
                f"  round {round_index + 1} {name}: {result.seconds:.2f} s, mean TTFT "
                f"{statistics.mean(result.ttfts):.2f} s"
            )
    print(
        f"{'':<20}{'prompt tokens computed':>24}{'peak blocks':>13}{'mean TTFT':>11}"
        f"{'p90 TTFT':>10}{'burst s':>9}"
    )
    summary = {}
    for name, runs in results.items():
        ttfts = [ttft for result in runs for ttft in result.ttfts]
        summary[name] = (
            runs[0].computed_prompt_tokens,
            runs[0].peak_blocks,
            statistics.mean(ttfts),
            p90(ttfts),
            statistics.mean(result.seconds for result in runs),
        )
        computed, blocks, mean_ttft, p90_ttft, seconds = summary[name]
        print(
            f"{name:<20}{computed:>24,}{blocks:>13,}{mean_ttft:>10.2f}s{p90_ttft:>9.2f}s"
            f"{seconds:>8.2f}s"
        )
    off, on = summary.values()
    print(
        f"on / off: {on[0] / off[0]:.2f}x prompt tokens computed, {on[1] / off[1]:.2f}x peak "
        f"blocks, {on[2] / off[2]:.2f}x mean TTFT, {on[4] / off[4]:.2f}x burst time; "
        f"load average {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
