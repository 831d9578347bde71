"""The engine's speed against an earlier tree of this repository, side by side in one run.

Why: a change that must cost nothing (the batch-invariant kernels of "One request, one
answer") is judged against the code before it, on the same machine at the same time. Each
round runs, for the earlier tree and this one in turn (the order alternating per round, so a
drift in the machine's load touches both alike), in fresh processes with that tree's `src`
first on the path:

- `pagedkv bench --workload all --systems pagedkv` (tokens/s per workload);
- `bench/peers.py --systems pagedkv` (batch tokens/s, batch-1 decode tokens/s);
- prefill: prompts of `--prefill-len` tokens, one new token each, no prefix cache, one at a
  time (prompt tokens / seconds);
- sampling: 32 prompts at once, 96 new tokens each, greedy, at temperature 0.8, and at 0.8
  with top_p 0.95 (generated tokens / seconds): what the sampler adds to a batch's step.

Run: `git worktree add /tmp/before <commit>` then
`python bench/before_after.py --before /tmp/before` (the built-in model, 2 rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
PREFILL = """
import sys, time
from pagedkv import LLM, SamplingParams
from pagedkv.hub import DEFAULT_MODEL
length, count = int(sys.argv[1]), int(sys.argv[2])
llm = LLM(DEFAULT_MODEL, enable_prefix_caching=False, num_gpu_blocks=4 * length // 16 + 8)
prompts = [[(17 * i + 31 * j) % 40000 + 100 for j in range(length)] for i in range(count + 1)]
params = SamplingParams(max_tokens=1, temperature=0.0)
llm.generate([prompts[0]], params, use_tqdm=False)  # warm-up
started = time.perf_counter()
for prompt in prompts[1:]:
    llm.generate([prompt], params, use_tqdm=False)
print(length * count / (time.perf_counter() - started))
"""

SAMPLING = """
import sys, time
from pagedkv import LLM, SamplingParams
llm = LLM(sys.argv[1], enable_prefix_caching=False, num_gpu_blocks=2048)
prompts = [f"Write a short story about robot number {i}, who learns to paint." for i in range(32)]
for temperature, top_p in ((0.0, 1.0), (0.8, 1.0), (0.8, 0.95)):
    params = SamplingParams(max_tokens=96, ignore_eos=True, temperature=temperature, top_p=top_p)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    print(sum(len(output.outputs[0].token_ids) for output in outputs) / seconds)
"""
SAMPLED = ("greedy", "temperature 0.8", "temperature 0.8 top_p 0.95")


def run(tree: Path, command: list[str]) -> str:
    """`command` under `tree`'s sources (its `src` first on the path, run from the tree)."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} in {tree} failed:\n{result.stderr[-3000:]}")
    return result.stdout


def figures(tree: Path, model: str, prefill_len: int) -> dict[str, float]:
    """One round's figures for `tree`."""
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as scratch:
        engine_json = Path(scratch) / "engine.json"
        pagedkv = [sys.executable, "-c", "from pagedkv.cli import main; main()"]
        run(
            tree,
            [
                *pagedkv,
                "bench",
                "--model",
                model,
                "--workload",
                "all",
                "--systems",
                "pagedkv",
                "--rounds",
                "1",
                "--json",
                str(engine_json),
            ],
        )
        for name, workload in json.loads(engine_json.read_text())["workloads"].items():
            out[f"bench {name} tok/s"] = workload["systems"]["pagedkv"]["tokens_per_s"]
        peers_json = Path(scratch) / "peers.json"
        run(
            tree,
            [
                sys.executable,
                "bench/peers.py",
                "--model",
                model,
                "--systems",
                "pagedkv",
                "--rounds",
                "1",
                "--json",
                str(peers_json),
            ],
        )
        peers = json.loads(peers_json.read_text())["systems"]["pagedkv"]
        out["peers batch tok/s"] = peers["batch_tokens_per_s"]["median"]
        out["peers batch-1 decode tok/s"] = peers["batch1_decode_tokens_per_s"]["median"]
        out["peers batch-1 request tok/s"] = peers["batch1_request_tokens_per_s"]["median"]
    prefill = run(tree, [sys.executable, "-c", PREFILL, str(prefill_len), "4"])
    out[f"prefill {prefill_len} tok/s"] = float(prefill.strip().splitlines()[-1])
    sampled = run(tree, [sys.executable, "-c", SAMPLING, model]).strip().splitlines()[-3:]
    for name, figure in zip(SAMPLED, sampled, strict=True):
        out[f"32 seqs {name} tok/s"] = float(figure)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="before_after", description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the earlier tree")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="(default: built-in)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds (default: 2)")
    parser.add_argument("--prefill-len", type=int, default=512, help="(default: 512)")
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": HERE}
    print(f"load average (1 min) before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    results: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for round_index in range(args.rounds):
        order = ["before", "after"] if round_index % 2 == 0 else ["after", "before"]
        for label in order:
            results[label].append(figures(trees[label], args.model, args.prefill_len))
            print(f"  round {round_index + 1} {label}: {results[label][-1]}", flush=True)
    print(f"\n{'figure':42} {'before':>10} {'after':>10} {'after/before':>13}")
    for name in results["after"][0]:
        before = statistics.median(r[name] for r in results["before"])
        after = statistics.median(r[name] for r in results["after"])
        print(f"{name:42} {before:10.1f} {after:10.1f} {after / before:12.2f}x")
    print(f"load average (1 min) after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
