"""What quantised weights cost in accuracy and buy in memory and speed, measured in one run.

For each `--quantization` (none: the GGUF file dequantised to float32, the reference; auto:
the file's own blocks kept; int8 and int4: re-quantised on load) it prints the resident
weight memory, the perplexity on a text by llama.cpp's method (`pagedkv perplexity`) and its
ratio to the float32 reference, prompt tokens/s while scoring, and the greedy continuation
of the README's prompts.

The default text is the GNU GPL version 3 (/usr/share/common-licenses/GPL-3, on every Debian
machine): 35 KB of fixed English prose, long enough for 15 windows of 512 tokens, that any
machine can read without a download, so the figure can be reproduced exactly.

Run: .venv/bin/python bench/quant_accuracy.py [--model M] [--text FILE] [--n-ctx 512]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from pagedkv import LLM, SamplingParams
from pagedkv.commands.perplexity import perplexity
from pagedkv.hub import DEFAULT_MODEL
from pagedkv.model.footprint import weight_footprint
from pagedkv.worker.threads import physical_cores

README_PROMPTS = ("The capital of France is", "Paged attention")
README_CHAT = "Name the capital of France."
SCHEMES = ("none", "auto", "int8", "int4")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="built-in name or .gguf file")
    parser.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses/GPL-3"))
    parser.add_argument("--n-ctx", type=int, default=512)
    parser.add_argument("--max-windows", type=int, default=None)
    parser.add_argument("--threads", type=int, default=physical_cores())
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--quantization", default=",".join(SCHEMES), help="comma-separated")
    args = parser.parse_args()
    text = args.text.read_text(encoding="utf-8")
    print(f"model {args.model}; text {args.text}; n_ctx {args.n_ctx}; {args.threads} threads")
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    rows, greedy = [], {}
    for scheme in args.quantization.split(","):
        llm = LLM(args.model, quantization=scheme, threads=args.threads, num_gpu_blocks=512)
        engine = llm.engine
        model = engine.runner.model
        footprint = weight_footprint(model)
        result = perplexity(
            model, engine.tokenizer, text, n_ctx=args.n_ctx, max_windows=args.max_windows
        )
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        outputs = llm.generate(list(README_PROMPTS), params, use_tqdm=False)
        chat = llm.chat([{"role": "user", "content": README_CHAT}], params, use_tqdm=False)
        greedy[scheme] = [o.outputs[0].text for o in (*outputs, *chat)]
        rows.append((scheme, footprint, result))
        del llm, engine, model
    reference = next((r for s, _, r in rows if s == "none"), rows[0][2])
    print()
    print(
        f"{'quantization':<13} {'weights MiB':>11} {'x fp32':>7} {'perplexity':>11} "
        f"{'vs none':>8} {'scored':>7} {'tok/s':>7}"
    )
    for scheme, footprint, result in rows:
        change = result.perplexity / reference.perplexity - 1
        print(
            f"{scheme:<13} {footprint.resident_bytes / (1 << 20):>11.1f} {footprint.ratio:>7.2f} "
            f"{result.perplexity:>11.4f} {change:>+8.2%} {result.scored:>7} "
            f"{result.tokens_per_s:>7.1f}"
        )
    print()
    for index, prompt in enumerate((*README_PROMPTS, f"[chat] {README_CHAT}")):
        print(f"prompt: {prompt!r}")
        for scheme, texts in greedy.items():
            print(f"  {scheme:<5} {texts[index]!r}")
    print(f"load average after: {os.getloadavg()[0]:.2f}; torch {torch.__version__}")


if __name__ == "__main__":
    main()
