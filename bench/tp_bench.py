"""Tensor parallelism on this machine: tokens/s and KV capacity at TP=1 and TP=2 (or `--sizes`).

Each rank gets the same KV budget (`--kv-budget-mib`, per rank, as a GPU's memory would be):
a rank's block holds only its KV heads, so the blocks that budget holds, hence the tokens the
pool holds, grow with the ranks (2x at TP=2 when the KV heads split; a model with fewer KV
heads than ranks replicates them and gains less). Throughput: `--num-prompts` random prompts
of `--prompt-tokens` tokens, `--max-tokens` tokens each with EOS ignored, after a warm-up; on a
CPU both ranks share this machine's cores (`--threads` per rank, default cores / ranks), so
TP shows its cost (two all-reduces per layer) there, and pays off where each rank has its own
device (`--device cuda`, one GPU per rank).

Full run (the lead's, on a quiet machine):
    .venv/bin/python bench/tp_bench.py
Smoke run:
    .venv/bin/python bench/tp_bench.py --num-prompts 2 --prompt-tokens 16 --max-tokens 4
"""

from __future__ import annotations

import argparse
import random
import time

from pagedkv import LLM, SamplingParams
from pagedkv.bench.random_model import RANDOM_MODEL, random_model_folder
from pagedkv.worker.threads import physical_cores

MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=RANDOM_MODEL, help="a model folder, .gguf or name")
    parser.add_argument("--sizes", default="1,2", help="tensor_parallel_size values, commas")
    parser.add_argument("--kv-budget-mib", type=int, default=256, help="KV pool per rank, MiB")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="per rank")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = str(random_model_folder()) if args.model == RANDOM_MODEL else args.model
    rows = [measure(args, model, int(size)) for size in args.sizes.split(",")]
    base = rows[0]
    print(f"model {args.model}; KV budget {args.kv_budget_mib} MiB per rank; {args.device}")
    print(
        f"{'TP':>3} {'B/block/rank':>13} {'blocks':>8} {'KV tokens':>10} {'x TP=1':>7} {'tok/s':>8}"
    )
    for row in rows:
        ratio = row["blocks"] / base["blocks"]
        print(
            f"{row['tp']:>3} {row['bytes_per_block']:>13,} {row['blocks']:>8,} "
            f"{row['blocks'] * args.block_size:>10,} {ratio:>7.2f} {row['tokens_per_s']:>8.1f}"
        )


def measure(args: argparse.Namespace, model: str, tp: int) -> dict[str, float]:
    """One engine at `tp` ranks: its pool for the per-rank budget, and its throughput."""
    llm = LLM(
        model,
        tensor_parallel_size=tp,
        kv_cache_memory=args.kv_budget_mib * MIB,
        block_size=args.block_size,
        device=args.device,
        threads=args.threads or max(1, physical_cores() // tp),
        swap_space_gb=0,
        seed=args.seed,
    )
    try:
        engine = llm.engine
        vocab = engine.config.vocab_size
        rng = random.Random(args.seed)
        prompts = [
            [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]
            for _ in range(args.num_prompts)
        ]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
        return {
            "tp": tp,
            "bytes_per_block": engine.kv_bytes_per_block,
            "blocks": engine.manager.num_gpu_blocks,
            "tokens_per_s": tokens / elapsed,
        }
    finally:
        llm.engine.shutdown()


if __name__ == "__main__":
    main()
