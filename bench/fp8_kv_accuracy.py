"""What an fp8 KV cache costs in accuracy, measured against `kv_cache_dtype="auto"` in one run.

Two figures for each KV dtype on the built-in model (or `--model`):

- perplexity on a text by llama.cpp's method (`pagedkv perplexity`, the same windows for every
  dtype), and its change against auto: the issue's target is within 2%;
- greedy agreement: `--num-prompts` prompts of `--prompt-tokens` tokens each (windows of the
  text at seeded random offsets), `--max-tokens` greedy tokens each with EOS ignored; for each
  prompt, the first generated token where the dtype's output differs from auto's ("=" when
  none does), then the mean first divergence (an identical output counting as `--max-tokens`).
  The same figure for auto with its prompts prefilled in pieces of 32 tokens is the floor:
  the KV dtype is auto's, only the arithmetic differs (sums in another order; with the
  built-in model's quantised weights, pieces of at most 32 rows also take the int8-activation
  matmul that decode steps use). Greedy continuations of legal prose hit near-ties early:
  auto's fused and op-by-op decode layers, which differ only in float32 rounding, already
  part at token 3 of some prompts (measured).

The default text is the GNU GPL version 3 (/usr/share/common-licenses/GPL-3), as in
bench/quant_accuracy.py: fixed prose any Debian machine has, so the figures can be reproduced.

Full run: .venv/bin/python bench/fp8_kv_accuracy.py
Quick check: .venv/bin/python bench/fp8_kv_accuracy.py --max-windows 1 --num-prompts 2
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path

import torch

from pagedkv import LLM, SamplingParams
from pagedkv.commands.perplexity import perplexity
from pagedkv.hub import DEFAULT_MODEL
from pagedkv.worker.threads import physical_cores

KV_CACHE_DTYPES = "auto,fp8"
# The floor's prefill pieces: auto's KV, other arithmetic (see the module docstring).
FLOOR_CHUNK_TOKENS = 32
FLOOR = f"auto, prompts in {FLOOR_CHUNK_TOKENS}-token pieces (the floor)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="built-in name or .gguf file")
    parser.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses/GPL-3"))
    parser.add_argument("--n-ctx", type=int, default=512, help="perplexity window, tokens")
    parser.add_argument("--max-windows", type=int, default=None, help="default: all")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128, help="greedy tokens per prompt")
    parser.add_argument("--seed", type=int, default=0, help="of the prompts' offsets")
    parser.add_argument("--kv-cache-dtypes", default=KV_CACHE_DTYPES, help="comma-separated")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=physical_cores())
    args = parser.parse_args()
    dtypes = args.kv_cache_dtypes.split(",")
    if dtypes[0] != "auto":
        dtypes.insert(0, "auto")  # the reference every other dtype is compared with
    text = args.text.read_text(encoding="utf-8")
    print(f"model {args.model}; text {args.text}; n_ctx {args.n_ctx}; {args.threads} threads")
    print(f"load average before: {os.getloadavg()[0]:.2f}")

    scores, outputs = {}, {}
    prompts: list[list[int]] = []
    for kv_cache_dtype in [*dtypes, FLOOR]:
        llm = _llm(args, kv_cache_dtype)
        engine = llm.engine
        if not prompts:
            prompts = _prompts(engine.tokenizer.encode(text, add_special_tokens=False), args)
        if kv_cache_dtype != FLOOR:
            scores[kv_cache_dtype] = perplexity(
                engine.runner.model,
                engine.tokenizer,
                text,
                n_ctx=args.n_ctx,
                max_windows=args.max_windows,
                kv_cache_dtype=kv_cache_dtype,
            )
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outputs[kv_cache_dtype] = [list(r.outputs[0].token_ids) for r in results]
        del llm, engine

    reference = scores["auto"]
    print()
    print(f"{'kv_cache_dtype':<15} {'perplexity':>11} {'vs auto':>8} {'scored':>7} {'tok/s':>7}")
    for kv_cache_dtype, result in scores.items():
        change = result.perplexity / reference.perplexity - 1
        print(
            f"{kv_cache_dtype:<15} {result.perplexity:>11.4f} {change:>+8.2%} "
            f"{result.scored:>7} {result.tokens_per_s:>7.1f}"
        )
    for kv_cache_dtype in [*dtypes[1:], FLOOR]:
        _print_agreement(kv_cache_dtype, outputs["auto"], outputs[kv_cache_dtype], args.max_tokens)
    print(f"load average after: {os.getloadavg()[0]:.2f}; torch {torch.__version__}")


def _llm(args: argparse.Namespace, kv_cache_dtype: str) -> LLM:
    """The model with its KV in `kv_cache_dtype`, or auto in prefill pieces for the floor."""
    settings = {"kv_cache_dtype": kv_cache_dtype, "max_num_seqs": args.num_prompts}
    if kv_cache_dtype == FLOOR:
        settings = {
            "max_num_batched_tokens": FLOOR_CHUNK_TOKENS,
            "max_num_seqs": min(args.num_prompts, FLOOR_CHUNK_TOKENS),
        }
    return LLM(
        args.model,
        device=args.device,
        threads=args.threads,
        num_gpu_blocks=_blocks_needed(args),
        **settings,
    )


def _prompts(tokens: list[int], args: argparse.Namespace) -> list[list[int]]:
    """`--num-prompts` windows of `--prompt-tokens` tokens of the text, at seeded offsets."""
    last_start = len(tokens) - args.prompt_tokens
    if last_start < 0:
        raise SystemExit(f"the text has {len(tokens)} tokens, fewer than --prompt-tokens")
    rng = random.Random(args.seed)
    return [
        tokens[start : start + args.prompt_tokens]
        for start in (rng.randrange(last_start + 1) for _ in range(args.num_prompts))
    ]


def _blocks_needed(args: argparse.Namespace, block_size: int = 16) -> int:
    """Blocks for every prompt at its full length at once, so no request is preempted."""
    per_request = -(-(args.prompt_tokens + args.max_tokens) // block_size)
    return args.num_prompts * per_request


def _print_agreement(
    kv_cache_dtype: str, reference: list[list[int]], ours: list[list[int]], max_tokens: int
) -> None:
    """Each prompt's first diverging token (or "="), the mean, and how many never diverge."""
    firsts = [_first_divergence(a, b) for a, b in zip(reference, ours, strict=True)]
    cells = ["=" if first is None else str(first) for first in firsts]
    counted = [max_tokens if first is None else first for first in firsts]
    identical = firsts.count(None)
    print()
    print(f"greedy {kv_cache_dtype} vs auto, first diverging token of {max_tokens} per prompt:")
    print("  " + " ".join(cells))
    print(
        f"  mean first divergence {sum(counted) / len(counted):.1f} of {max_tokens} "
        f"(identical counted as {max_tokens}); {identical} of {len(firsts)} identical"
    )


def _first_divergence(reference: list[int], ours: list[int]) -> int | None:
    """Index of the first token where the two outputs differ; None when they never do."""
    for index, (a, b) in enumerate(zip(reference, ours, strict=False)):
        if a != b:
            return index
    return None if len(reference) == len(ours) else min(len(reference), len(ours))


if __name__ == "__main__":
    main()
