"""What penalties cost the sampler: one step of 64 rows of 4k-token prompts, side by side.

Times `Sampler` on float32 logits of the built-in model's vocabulary (49152) for greedy rows
and for rows with a repetition penalty (and with all three penalties), each row's counts
kept as `TokenCounts` the way the engine keeps them; prints the median of each and the ratio
to greedy.

Run: .venv/bin/python bench/sampler_bench.py [--rows 64] [--prompt-len 4096]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedkv.engine.params import SamplingParams
from pagedkv.engine.penalties import TokenCounts
from pagedkv.engine.sampler import Sampler, SamplingRow

VOCAB = 49152
CASES = {
    "greedy": dict(),
    "repetition_penalty=1.1": dict(repetition_penalty=1.1),
    "all three penalties": dict(
        repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5
    ),
}


def rows_for(params: SamplingParams, num_rows: int, prompt_len: int, output_len: int):
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(num_rows):
        prompt = torch.randint(0, VOCAB, (prompt_len,), generator=generator).tolist()
        counts = TokenCounts.for_prompt(prompt, VOCAB, "cpu")
        output = torch.randint(0, VOCAB, (output_len,), generator=generator).tolist()
        for token_id in output:
            counts.add(token_id)
        rows.append(SamplingRow(params, output_len, [2], None, counts))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    logits = torch.randn(args.rows, VOCAB)
    sampler = Sampler()
    medians = {}
    for name, settings in CASES.items():
        params = SamplingParams(temperature=0.0, **settings)
        rows = rows_for(params, args.rows, args.prompt_len, args.output_len)
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            sampler(logits, rows)
            times.append(time.perf_counter() - started)
        medians[name] = statistics.median(times)
    print(f"{args.rows} rows, {args.prompt_len}-token prompts, {args.output_len} output tokens")
    for name, seconds in medians.items():
        ratio = seconds / medians["greedy"]
        print(f"{name:<24} {seconds * 1e3:7.1f} ms per step  {ratio:5.2f}x greedy")


if __name__ == "__main__":
    main()
