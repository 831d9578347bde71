"""Two engines on the same cores: what OpenMP's idle spinning costs, measured in one run.

Every thread of libgomp (the OpenMP runtime torch and the C kernels share) spins a while for
its next task before it sleeps. Alone on the machine that saves a wake-up per parallel region;
beside another busy process, the spinning threads take the cores that process needs, and its
threads spin in turn. This runs the built-in model's engine (16 prompts x 32 greedy tokens,
again and again for `--seconds`) one at a time and two at once, for each way of waiting:
libgomp's own (nothing set, torch imported before pagedkv, so pagedkv's default does not
count), pagedkv's (`pagedkv.SPIN_COUNT` spins, set when pagedkv is imported first) and
OMP_WAIT_POLICY=passive (no spinning). Each figure is generated tokens/s of one engine; with
two, of each.

Run: .venv/bin/python bench/omp_contention.py [--seconds 20]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pagedkv

# name: (environment, import torch before pagedkv)
SETTINGS = {
    "libgomp's own": ({}, True),
    f"pagedkv's ({pagedkv.SPIN_COUNT} spins)": ({}, False),
    "passive (no spinning)": ({"OMP_WAIT_POLICY": "passive"}, True),
}
WORKER = """
import sys, time
if sys.argv[2] == "torch-first":
    import torch
from pagedkv import LLM, SamplingParams
llm = LLM(enable_prefix_caching=False)
prompts = [f"Prompt number {i} about paged memory and caches" for i in range(16)]
params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0)
llm.generate(prompts, params, use_tqdm=False)
print("ready", flush=True)
sys.stdin.readline()
started, tokens = time.perf_counter(), 0
while time.perf_counter() - started < float(sys.argv[1]):
    llm.generate(prompts, params, use_tqdm=False)
    tokens += 16 * 32
print(tokens / (time.perf_counter() - started), flush=True)
"""


def run(setting: tuple[dict[str, str], bool], engines: int, seconds: float) -> list[float]:
    """Tokens/s of each of `engines` engines running at once under `setting`."""
    variables, torch_first = setting
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(variables)
    order = "torch-first" if torch_first else "pagedkv-first"
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(seconds), order],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for _ in range(engines)
    ]
    for worker in workers:  # loaded and warm, then all start together
        assert worker.stdout.readline().strip() == "ready"
    for worker in workers:
        worker.stdin.write("go\n")
        worker.stdin.flush()
    return [float(worker.communicate()[0]) for worker in workers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="generation time per run")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print(f"{'setting':28s} {'alone':>8s} {'two at once (each)':>22s}")
    for name, setting in SETTINGS.items():
        alone = run(setting, 1, args.seconds)[0]
        pair = run(setting, 2, args.seconds)
        print(f"{name:28s} {alone:8.1f} {pair[0]:10.1f} {pair[1]:10.1f}", flush=True)
        time.sleep(2)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
