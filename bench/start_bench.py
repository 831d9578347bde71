"""How fast pagedkv starts: the first token of `pagedkv generate --chat`, and `LLM()`.

Each measurement runs in a fresh process, `--runs` times, and prints min and median:
- `generate --chat`: seconds from starting the command to the first byte of the answer on
  stdout (the first token shown), and to the end of the command;
- `LLM(model)`: seconds the constructor takes in a fresh Python process (after `import
  pagedkv`, which is reported on its own: importing torch is most of it).

Run it once before measuring so the file cache is warm (the first run is reported too, apart).
The engine's start-up line of the last generate run is printed, to show where the time went.

Run: .venv/bin/python bench/start_bench.py [--model M] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pagedkv.hub import DEFAULT_MODEL

PAGEDKV = Path(sys.executable).with_name("pagedkv")
QUESTION = "In one sentence, what is a KV cache?"
LLM_SCRIPT = """
import json, sys, time
started = time.perf_counter()
from pagedkv import LLM
imported = time.perf_counter()
LLM(sys.argv[1])
print(json.dumps({"import": imported - started, "llm": time.perf_counter() - imported}))
"""


def generate_once(model: str, max_tokens: int) -> tuple[float, float, str]:
    """(seconds to the first stdout byte, seconds to exit, stderr) of one generate command."""
    command = [str(PAGEDKV), "generate", "--model", model, "--chat", QUESTION]
    command += ["--max-tokens", str(max_tokens)]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None
    process.stdout.read(1)
    first = time.perf_counter() - started
    process.stdout.read()
    _, stderr = process.communicate()
    if process.returncode != 0:
        raise SystemExit(f"generate failed:\n{stderr.decode()}")
    return first, time.perf_counter() - started, stderr.decode()


def llm_once(model: str) -> dict[str, float]:
    """Seconds of `import pagedkv` and of `LLM(model)` in a fresh process."""
    result = subprocess.run(
        [sys.executable, "-c", LLM_SCRIPT, model], capture_output=True, text=True, check=True
    )
    return json.loads(result.stdout.splitlines()[-1])


def summary(name: str, values: list[float]) -> str:
    return f"{name:<28} min {min(values):5.2f} s   median {statistics.median(values):5.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, folder or .gguf")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    print(f"model {args.model}; {args.runs} runs each; load average {os.getloadavg()[0]:.2f}")
    first_run = generate_once(args.model, args.max_tokens)
    print(f"warm-up run: first token {first_run[0]:.2f} s, done {first_run[1]:.2f} s")
    firsts, totals = [], []
    stderr = ""
    for _ in range(args.runs):
        first, total, stderr = generate_once(args.model, args.max_tokens)
        firsts.append(first)
        totals.append(total)
    imports, llms = [], []
    for _ in range(args.runs):
        timing = llm_once(args.model)
        imports.append(timing["import"])
        llms.append(timing["llm"])
    print(summary("generate --chat: 1st token", firsts))
    print(summary("generate --chat: done", totals))
    print(summary("import pagedkv", imports))
    print(summary("LLM(model)", llms))
    startup = [line for line in stderr.splitlines() if line.startswith("loaded in")]
    print("last generate's start-up line:", startup[-1] if startup else "(none)")


if __name__ == "__main__":
    main()
