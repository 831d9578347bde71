"""Where a GPU engine step's time goes: `LLM.generate` under cProfile on the GPU check's model.

Builds the seeded random ~1B Llama of `bench/gpu_check.py` (bf16), warms the engine up, then
profiles one `generate` over the check's workload and prints tokens/s, the runner's share of
the wall time and the functions that took the most time, by own time and by cumulative time.
``--device cpu`` runs the tiny model on the CPU (a dry run of the script).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import tempfile
import time
from pathlib import Path

import torch
from gpu_check import CPU, GPU, random_llama


def main() -> None:
    """Parse the command line, build the model, profile one generate."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    device = torch.device(args.device)
    setup = GPU if device.type == "cuda" else CPU
    from pagedkv import LLM, SamplingParams

    num_prompts, prompt_min, prompt_max, out_min, out_max = setup.workload
    rng = random.Random(0)
    vocab = setup.model["vocab_size"]
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(prompt_min, prompt_max))]
        for _ in range(num_prompts)
    ]
    params = [
        SamplingParams(max_tokens=rng.randint(out_min, out_max), ignore_eos=True, temperature=0)
        for _ in prompts
    ]
    with tempfile.TemporaryDirectory() as folder:
        random_llama(setup, device, Path(folder))
        dtype = str(setup.dtype).removeprefix("torch.")
        extra = {"gpu_memory_utilization": 0.5} if device.type == "cuda" else {}
        llm = LLM(model=folder, dtype=dtype, device=device.type, seed=0, **extra)
        engine = llm.engine
        steps = _time_steps(engine)
        for _ in range(2):  # warm-up: every kernel variant the workload launches compiles
            started = time.perf_counter()
            llm.generate([p[::-1] for p in prompts], params, use_tqdm=False)
            print(f"warm-up generate: {time.perf_counter() - started:.2f} s; " + _slowest(steps))
            steps.clear()
        forward_before, model_before = engine.runner.forward_seconds, engine.runner.model_seconds
        profile = cProfile.Profile()
        started = time.perf_counter()
        profile.enable()
        llm.generate(prompts, params, use_tqdm=False)
        profile.disable()
        seconds = time.perf_counter() - started
    forward = engine.runner.forward_seconds - forward_before
    model = engine.runner.model_seconds - model_before
    tokens = sum(p.max_tokens for p in params)
    print(
        f"{tokens} tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tokens/s (under cProfile); "
        f"plan + forward {forward:.2f} s ({forward / seconds:.0%}), model forward {model:.2f} s"
    )
    print(_slowest(steps))
    stats = pstats.Stats(profile)
    for order in ("tottime", "cumulative"):
        print(f"-- top {args.top} by {order}")
        stats.sort_stats(order).print_stats(args.top)


def _slowest(steps: list[tuple[float, int]]) -> str:
    """The steps' count, median and slowest eight (ms, batched tokens)."""
    slowest = sorted(steps, reverse=True)[:8]
    return (
        f"{len(steps)} steps, median {sorted(steps)[len(steps) // 2][0] * 1e3:.1f} ms; slowest "
        "(ms, tokens): " + ", ".join(f"{s * 1e3:.0f} ({n})" for s, n in slowest)
    )


def _time_steps(engine) -> list[tuple[float, int]]:
    """Record every engine step's seconds and batched tokens from now on (profile only)."""
    steps: list[tuple[float, int]] = []
    step = engine.step

    def timed_step():
        started = time.perf_counter()
        deltas = step()
        steps.append((time.perf_counter() - started, engine.last_step_num_tokens))
        return deltas

    engine.step = timed_step
    return steps


if __name__ == "__main__":
    main()
