"""The quantised matmul alone, on a model's own weights: the panel layout against kernel order,
at the row counts a step multiplies them by.

Why: a decode step's time is mostly its weights streaming through the matmul kernel, and how
the kernel reads them (one panel at a time or four, kernel order's 8 columns at once) decides
how near it gets to the memory's bandwidth. Called as the model calls them, every weight once
per pass in the model's order, the weights stream from wherever they live between steps (a 1B
model's from memory, far past the caches), so a pass is a step's matmuls without the rest.
Both layouts hold the same weights, so every pass also checks that they give the same bits.

Each round times a pass of each layout in turn (the first alternating), for every row count;
the figures are medians over rounds, per weight shape (all the weights of that shape) and for
the whole pass, with the bytes read per microsecond (values, scales and mins).

Run: `python bench/matmul_bench.py --model 1b` (the 1B shape), `--rows 1,6,16`; the built-in
model by default. Only machines whose kernels read the panel layout (AVX-512 VNNI) have both.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import add_model_arguments, model_file  # noqa: E402

from pagedkv.bench.main import positive_int  # noqa: E402
from pagedkv.kernels import native  # noqa: E402
from pagedkv.quant.formats import QuantizedTensor  # noqa: E402
from pagedkv.quant.matmul import qmatmul_into  # noqa: E402
from pagedkv.worker.threads import physical_cores  # noqa: E402

LAYOUTS = ("panels", "kernel")


def model_weights(model: torch.nn.Module) -> list[QuantizedTensor]:
    """The model's quantised weights in the panel layout, in the order its modules list them."""
    found = (getattr(module, "qweight", None) for module in model.modules())
    return [weight for weight in found if weight is not None and weight.layout == "panels"]


def kernel_order(weight: QuantizedTensor) -> QuantizedTensor:
    """The same weight in kernel order."""
    return QuantizedTensor(
        weight.kernel_values(), weight.scales, weight.mins, weight.bits, weight.group_size
    )


def timed_pass(
    weights: list[QuantizedTensor], inputs: dict[int, torch.Tensor], outputs: list[torch.Tensor]
) -> dict[tuple[int, int], float]:
    """Seconds per weight shape for one call of each weight, straight into the kernels (as
    the fused decode step calls them: no Python between), products into `outputs`."""
    kernels = native.kernels()
    seconds: dict[tuple[int, int], float] = defaultdict(float)
    for weight, y in zip(weights, outputs, strict=True):
        x = inputs[weight.shape[1]]
        start = time.perf_counter()
        qmatmul_into(kernels, x, weight, None, y)
        seconds[weight.shape] += time.perf_counter() - start
    return seconds


def measure(
    model: torch.nn.Module, rows: Sequence[int], rounds: int, out: Callable[[str], None] = print
) -> dict[tuple[int, str], float]:
    """Print the table; returns the whole pass's median microseconds by (rows, layout)."""
    panels = model_weights(model)
    if not panels:
        out("no weight is in the panel layout here (the kernels read it on AVX-512 VNNI only)")
        return {}
    both = {"panels": panels, "kernel": [kernel_order(weight) for weight in panels]}
    shapes = sorted({weight.shape for weight in panels})
    count = {shape: sum(weight.shape == shape for weight in panels) for shape in shapes}
    size = {shape: sum(w.nbytes for w in panels if w.shape == shape) for shape in shapes}
    generator = torch.Generator().manual_seed(0)
    totals: dict[tuple[int, str], float] = {}
    out(f"{'rows':>4} {'weight (count)':>20} {'panels us':>10} {'kernel us':>10} {'ratio':>6}")
    for m in rows:
        inputs = {k: torch.randn(m, k, generator=generator) for k in {s[1] for s in shapes}}
        times: dict[tuple[str, tuple[int, int] | str], list[float]] = defaultdict(list)
        for r in range(rounds + 1):  # round 0 warms the caches and the kernels
            order = LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]
            outputs = {
                layout: [torch.full((m, w.shape[0]), float("nan")) for w in panels]
                for layout in LAYOUTS
            }
            results = {
                layout: timed_pass(both[layout], inputs, outputs[layout]) for layout in order
            }
            if any(
                not torch.equal(a, b)
                for a, b in zip(outputs["panels"], outputs["kernel"], strict=True)
            ):
                raise SystemExit(f"matmul_bench: the layouts' products differ (rows={m})")
            if r == 0:
                continue
            for layout, seconds in results.items():
                for shape, value in seconds.items():
                    times[layout, shape].append(value)
                times[layout, "all"].append(sum(seconds.values()))
        for shape in (*shapes, "all"):
            us = {layout: statistics.median(times[layout, shape]) * 1e6 for layout in LAYOUTS}
            name = "whole pass" if shape == "all" else f"{shape[0]} x {shape[1]} ({count[shape]})"
            nbytes = sum(size.values()) if shape == "all" else size[shape]
            out(
                f"{m:>4} {name:>20} {us['panels']:>10.1f} {us['kernel']:>10.1f} "
                f"{us['kernel'] / us['panels']:>5.2f}x  panels {nbytes / us['panels'] / 1e3:.1f} "
                f"GB/s, kernel order {nbytes / us['kernel'] / 1e3:.1f} GB/s"
            )
        totals.update(
            {(m, layout): statistics.median(times[layout, "all"]) * 1e6 for layout in LAYOUTS}
        )
    return totals


def row_counts(text: str) -> list[int]:
    """`--rows`: positive integers, comma-separated."""
    return [positive_int(part) for part in text.split(",")]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="matmul_bench", description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument(
        "--rows", default="1,6", type=row_counts, help="comma-separated row counts (default: 1,6)"
    )
    parser.add_argument("--rounds", type=positive_int, default=5, help="timed passes per layout")
    parser.add_argument(
        "--threads", type=positive_int, default=physical_cores(), help="CPU threads"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from pagedkv import LLM

    args = parse_args(argv)
    gguf = model_file(args.model, args.qtype, "matmul_bench")
    llm = LLM(model=str(gguf), threads=args.threads, num_gpu_blocks=16, swap_space_gb=0)
    print(f"{gguf.name}: {args.rounds} rounds, {args.threads} threads")
    measure(llm.engine.runner.model, args.rows, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
