"""One sequence's decode alone and beside a busy process, with the thread governor and without.

Why: the kernels' threads meet at the end of every parallel region, so a core shared with
another busy process stalls every region until the thread on it gets its turn
(worker/thread_governor.py). This decodes the built-in model, one request at a time, on this
machine's physical cores, in four settings, rounds alternating: alone and beside one busy
loop (a `python -c "while True: pass"` process), each with the governor (the engine's default)
and with the thread count fixed (a governor without the kernel's figures). Each
figure is decode tokens/s over the requests; "threads" is the count the governor ended on.

Run: .venv/bin/python bench/busy_neighbour_bench.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from pagedkv import LLM, SamplingParams
from pagedkv.hub import DEFAULT_MODEL
from pagedkv.worker.thread_governor import ThreadGovernor

PROMPTS = [
    "Explain in a few sentences why paged KV memory lets a server hold more requests.",
    "Write a short note to a colleague about the results of today's benchmark.",
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@contextmanager
def busy_neighbour(on: bool) -> Iterator[None]:
    """A process spinning on one core for the duration (nothing when not `on`)."""
    process = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if on else None
    try:
        yield
    finally:
        if process is not None:
            process.kill()
            process.wait()


def decode_tok_s(llm: LLM) -> float:
    tokens, seconds = 0, 0.0
    for prompt in PROMPTS:
        [output] = llm.generate([prompt], PARAMS, use_tqdm=False)
        tokens += len(output.outputs[0].token_ids) - 1
        seconds += output.metrics.finished_time - output.metrics.first_token_time
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the four settings")
    args = parser.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    llm = LLM(DEFAULT_MODEL, enable_prefix_caching=False, num_gpu_blocks=256)
    most = llm.engine.thread_governor.most
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm
    figures: dict[tuple[str, str], list[float]] = {}
    ended: dict[tuple[str, str], int] = {}
    for round_index in range(args.rounds):
        for neighbour in ("alone", "beside a busy loop"):
            modes = ("governed", "fixed") if round_index % 2 == 0 else ("fixed", "governed")
            for mode in modes:
                llm.engine.thread_governor = (
                    ThreadGovernor(most) if mode == "governed" else ThreadGovernor(most, None)
                )
                with busy_neighbour(neighbour != "alone"):
                    tok_s = decode_tok_s(llm)
                figures.setdefault((neighbour, mode), []).append(tok_s)
                ended[(neighbour, mode)] = llm.engine.thread_governor.threads
                print(
                    f"  round {round_index + 1} {neighbour}, {mode}: {tok_s:.1f} tok/s", flush=True
                )
    print(f"\n{DEFAULT_MODEL}, batch-1 decode, {most} threads at most (medians)")
    print(f"{'':22s} {'governed':>10s} {'fixed':>10s} {'governed/fixed':>15s}")
    for neighbour in ("alone", "beside a busy loop"):
        governed = statistics.median(figures[(neighbour, "governed")])
        fixed = statistics.median(figures[(neighbour, "fixed")])
        print(
            f"{neighbour:22s} {governed:10.1f} {fixed:10.1f} {governed / fixed:14.2f}x"
            f"   (threads at the end: {ended[(neighbour, 'governed')]})"
        )
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
