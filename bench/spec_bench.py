"""Speculative decoding on the built-in model, off and on in one run, and llama.cpp's own.

Two workloads of 32 chat prompts each, on the built-in model's GGUF file:
- (a) input-grounded: quote, correct or rewrite a passage of 200-400 tokens. The passages are
  module docstrings of Python's standard library (`PASSAGE_MODULES`): documentation prose that
  ships with every CPython, so every machine has the same text for one Python version, with no
  download; the kind of text users paste to have it quoted, fixed or reworded. "Correct" gets
  the passage with typos made deterministically (`with_typos`).
- (b) free chat: 32 open questions whose answers repeat little of the prompt.

For each, pagedkv without and with n-gram speculation (`--speculative-config`), rounds
alternating which goes first, the same prompts, greedy (so both give the same tokens):
- batch 1, one request at a time: decode tokens/s = tokens after each request's first, over the
  time from its first token to its last;
- 32 sequences at once: generated tokens over the wall time of the whole run (prefill
  included, which speculation does not change);
- with speculation: the acceptance rate and the mean accepted length (tokens a verification
  step produced: the kept drafts plus one).
- what workload (a)'s own greedy outputs allow at the engine's fitted step cost (`replay_bound`):
  the speed-up of verifying every draft, and of verifying exactly the drafts that will be kept
  (an oracle: a ceiling no rule reaches, since none knows in advance).
llama.cpp runs the same prompts (token ids) on the same file at batch 1 through llama-cpp-python's
own prompt-lookup decoding (`LlamaPromptLookupDecoding`, the same n-gram size and drafts) and
without it, same threads, greedy (`bench/llama_cpp_worker.py`, in its own environment: see
bench/peers.py). Every figure is printed with the goal it is held to, and the load average
before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peers import LLAMA_VENV, LlamaCppPeer, PeerUnavailable

from pagedkv import LLM, SamplingParams
from pagedkv.engine.spec.ngram import propose_ngram
from pagedkv.hub import DEFAULT_MODEL, pull
from pagedkv.worker.threads import physical_cores

# Standard-library modules whose docstrings are the passages (present from Python 3.10 on).
PASSAGE_MODULES = (
    "argparse", "cmd", "copy", "csv", "hashlib", "heapq", "inspect", "io", "json", "plistlib",
    "pyclbr", "sched", "shelve", "socket", "struct", "timeit", "unittest", "uuid",
)  # fmt: skip
PASSAGE_TOKENS = (200, 400)
# The passage first, the request after it: how text is often pasted, and a phrasing the
# built-in model follows (asked first, it tends to summarise what it was asked to quote).
TASKS = (
    "{passage}\n\nRepeat the text above word for word.",
    "{passage}\n\nThe text above has typing mistakes. Write it out again with the mistakes "
    "corrected, changing nothing else.",
    "{passage}\n\nRewrite the text above in plain English, keeping its technical terms.",
)
QUESTIONS = (
    "Why is the sky blue?", "Write a short poem about the sea.", "What makes a good teacher?",
    "Give me three ideas for a rainy weekend.", "Explain how a bicycle stays upright.",
    "Describe your ideal breakfast.", "What are the benefits of learning a second language?",
    "Tell me a story about a lost key.", "How do bees make honey?",
    "What should I pack for a hiking trip?", "Explain what inflation is to a child.",
    "Write a letter thanking a friend for a gift.", "Why do cats purr?",
    "What is the difference between weather and climate?", "Suggest a name for a bakery.",
    "How does a refrigerator keep food cold?", "Describe a city you would like to visit.",
    "What are good habits for sleeping well?", "Write a limerick about a programmer.",
    "Why do leaves change colour in autumn?", "How can I start running as a beginner?",
    "What is photosynthesis?", "Describe the taste of a lemon to someone who never had one.",
    "Give advice to a student starting university.", "What makes music sound happy or sad?",
    "Plan a simple dinner party menu.", "How do airplanes fly?",
    "Write a short dialogue between a robot and a cat.", "Why is exercise good for the brain?",
    "What would you do with a free afternoon?", "How are rainbows formed?",
    "Explain why the moon has phases.",
)  # fmt: skip
GOALS = {"a_batch1": 2.0, "a_vs_llama": 1.5, "b_batch1": 0.95, "batch32": 0.95}


def passages(tokenizer: Any) -> list[str]:
    """Each module's docstring, cut at a line end to at most 400 tokens; those of 200 or more."""
    import importlib

    kept = []
    for name in PASSAGE_MODULES:
        lines, text = (importlib.import_module(name).__doc__ or "").strip().splitlines(), ""
        for line in lines:
            longer = f"{text}\n{line}" if text else line
            if len(tokenizer.encode(longer, add_special_tokens=False)) > PASSAGE_TOKENS[1]:
                break
            text = longer
        if len(tokenizer.encode(text, add_special_tokens=False)) >= PASSAGE_TOKENS[0]:
            kept.append(text)
    return kept


def with_typos(text: str, seed: int) -> str:
    """`text` with about one word in twelve misspelt (two letters swapped), deterministically."""
    rng = random.Random(seed)
    words = text.split(" ")
    for index, word in enumerate(words):
        if len(word) > 4 and word.isalpha() and rng.random() < 1 / 12:
            at = rng.randrange(1, len(word) - 2)
            words[index] = word[:at] + word[at + 1] + word[at] + word[at + 2 :]
    return " ".join(words)


def workloads(tokenizer: Any, count: int) -> dict[str, list[list[int]]]:
    """The prompts of both workloads, as chat token ids."""
    texts = passages(tokenizer)

    def chat(content: str) -> list[int]:
        return tokenizer.encode_chat([{"role": "user", "content": content}])

    grounded = []
    for index in range(count):
        task = index % len(TASKS)
        passage = texts[index % len(texts)]
        if task == 1:
            passage = with_typos(passage, index)
        grounded.append(chat(TASKS[task].format(passage=passage)))
    free = [chat(QUESTIONS[index % len(QUESTIONS)]) for index in range(count)]
    return {"a": grounded, "b": free}


class Pagedkv:
    """The built-in model in pagedkv, with speculation on or off."""

    def __init__(self, speculative_config: dict[str, Any] | None, threads: int) -> None:
        self.llm = LLM(
            DEFAULT_MODEL,
            threads=threads,
            enable_prefix_caching=False,  # rounds repeat prompts: no round may skip prefill
            num_gpu_blocks=4096,
            speculative_config=speculative_config,
        )

    def batch1(self, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
        """Each prompt alone: decode tokens/s over the requests, and each one's tokens."""
        tokens, seconds, outputs = 0, 0.0, []
        for prompt in prompts:
            [output] = self.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            metrics = output.metrics
            outputs.append(list(output.outputs[0].token_ids))
            tokens += len(outputs[-1]) - 1
            seconds += metrics.finished_time - metrics.first_token_time
        return {"decode_tok_s": tokens / seconds, "tokens": tokens, "outputs": outputs}

    def batch(self, prompts: list[list[int]], params: SamplingParams) -> dict[str, float]:
        """Every prompt at once: generated tokens over the wall time."""
        started = time.perf_counter()
        outputs = self.llm.generate(
            [{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False
        )
        seconds = time.perf_counter() - started
        tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
        return {"tok_s": tokens / seconds, "tokens": tokens}

    def spec_figures(self) -> dict[str, float]:
        stats = self.llm.engine.stats.spec_decoding
        return {"acceptance": stats.acceptance_rate, "mean_length": stats.mean_accepted_length}

    def step_cost(self) -> tuple[float, float]:
        """The engine's current fit of a step's seconds: (fixed, per row)."""
        return self.llm.engine.scheduler.drafts.step_cost.fit()


@dataclass(frozen=True)
class Bound:
    """Workload (a) replayed at a step cost: speed-ups over plain decoding."""

    fixed: float  # seconds of a step, whatever its rows
    per_row: float  # seconds per row
    every_draft: float  # verifying every draft proposed
    oracle: float  # verifying exactly the drafts the model keeps
    free_rows: float  # either, were a step's extra rows free: decode tokens per step


def replay_bound(
    prompts: list[list[int]],
    outputs: list[list[int]],
    spec: dict[str, Any],
    cost: tuple[float, float],
) -> Bound:
    """What n-gram drafts can give on these greedy outputs at step cost `fixed + per_row x rows`.

    Each output is replayed a step at a time: the drafts the lookup proposes after the tokens so
    far (`propose_ngram`, the engine's own), the prefix of them the output continues with (what
    verification keeps), and the step's rows. Verifying every draft costs all of them; an oracle
    verifies only the ones kept. Both keep the same tokens, so the oracle is the most any
    adaptive rule could get from this drafter, model and machine; with rows free (a machine
    whose step costs the same for a few more rows) both come to tokens per step."""
    fixed, per_row = cost
    lookup = spec["prompt_lookup_min"], spec["prompt_lookup_max"], spec["num_speculative_tokens"]
    plain = every = oracle = 0.0
    tokens = steps = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        at = 1  # the first token comes from the prompt's step
        plain += (len(output) - 1) * (fixed + per_row)
        tokens += len(output) - 1
        while at < len(output):
            so_far = array("q", prompt + output[:at])
            drafts = propose_ngram(so_far, *lookup)[: len(output) - at - 1]
            kept = 0
            while kept < len(drafts) and drafts[kept] == output[at + kept]:
                kept += 1
            every += fixed + per_row * (1 + len(drafts))
            oracle += fixed + per_row * (1 + kept)
            steps += 1
            at += kept + 1
    return Bound(fixed, per_row, plain / every, plain / oracle, tokens / steps)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    threads = args.threads or physical_cores()
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_max": args.prompt_lookup_max,
        "prompt_lookup_min": args.prompt_lookup_min,
    }
    print(f"spec_bench: {machine()}, {threads} threads; load average before {load()}")
    print(f"speculative_config {json.dumps(spec)}; max_tokens {args.max_tokens}, greedy")
    gguf = pull(DEFAULT_MODEL, progress=lambda line: print(line, file=sys.stderr))
    systems = {"off": Pagedkv(None, threads), "on": Pagedkv(spec, threads)}
    tokenizer = systems["off"].llm.get_tokenizer()
    prompts = workloads(tokenizer, args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for name, workload in prompts.items():
        lengths = [len(p) for p in workload]
        print(f"workload ({name}): {len(workload)} prompts of {min(lengths)}-{max(lengths)} tokens")
    runs: dict[tuple[str, str, str], list[float]] = {}
    bounds = []
    for round_index in range(args.rounds):
        order = ("off", "on") if round_index % 2 == 0 else ("on", "off")
        for name, workload in prompts.items():
            for mode in order:
                single = systems[mode].batch1(workload, params)
                one = single["decode_tok_s"]
                if name == "a" and mode == "on":  # the fit of its batch-1 steps
                    cost = systems["on"].step_cost()
                    bounds.append(replay_bound(workload, single["outputs"], spec, cost))
                many = systems[mode].batch(workload, params)["tok_s"]
                runs.setdefault((name, mode, "batch1"), []).append(one)
                runs.setdefault((name, mode, "batch32"), []).append(many)
                print(f"  round {round_index + 1} ({name}) {mode}: batch 1 decode {one:.1f} tok/s, "
                      f"{len(workload)} sequences {many:.1f} tok/s", flush=True)  # fmt: skip
    spec_figures = systems["on"].spec_figures()
    llama = llama_figures(args, gguf, prompts, tokenizer, threads)
    report(runs, spec_figures, llama, len(prompts["a"]), bounds)
    print(f"load average after {load()}")
    return 0


def llama_figures(
    args: argparse.Namespace,
    gguf: Path,
    prompts: dict[str, list[list[int]]],
    tokenizer: Any,
    threads: int,
) -> dict[str, dict[str, Any]] | None:
    """llama.cpp's batch-1 decode on workload (a), with and without prompt lookup."""
    python = args.llama_python or Path(os.environ.get("PAGEDKV_LLAMA_PYTHON", ""))
    if not python.is_file():
        python = LLAMA_VENV / "bin" / "python"
    if not python.is_file():
        print("llama.cpp: skipped (no llama-cpp-python environment; see bench/peers.py)")
        return None
    llama = LlamaCppPeer(python, gguf, threads, kv_unified=True)
    workload = prompts["a"]
    job = {
        "mode": "prompt_lookup",
        "model": str(gguf),
        "threads": threads,
        "prompts": workload,
        "max_tokens": args.max_tokens,
        "stop_ids": sorted(tokenizer.eos_token_ids),
        "n_ctx": 2 * (max(map(len, workload)) + args.max_tokens + 64),
        "max_ngram_size": args.prompt_lookup_max,
    }
    try:
        figures: dict[str, dict[str, Any]] = {}
        for round_index in range(args.rounds):
            for name, drafts in (("lookup", args.num_speculative_tokens), ("plain", 0)):
                reply = llama.ask({**job, "num_pred_tokens": drafts})
                results = reply["results"]
                tokens = sum(len(result["tokens"]) - 1 for result in results)
                decode = tokens / sum(result["decode_seconds"] for result in results)
                figures.setdefault(name, {"runs": []})["runs"].append(decode)
                figures[name]["version"] = reply["version"]
                print(f"  round {round_index + 1} (a) llama.cpp {name}: batch 1 decode "
                      f"{decode:.1f} tok/s", flush=True)  # fmt: skip
        return figures
    except PeerUnavailable as reason:  # ours are measured by now: report them regardless
        print(f"llama.cpp: failed ({reason}; see bench/peers.py)")
        return None
    finally:
        llama.close()


def report(
    runs: dict[tuple[str, str, str], list[float]],
    spec_figures: dict[str, float],
    llama: dict[str, dict[str, Any]] | None,
    count: int,
    bounds: list[Bound],
) -> None:
    def median(key: tuple[str, str, str]) -> float:
        return statistics.median(runs[key])

    def goal(ratio: float, target: float) -> str:
        return f"goal >= {target}x: {'met' if ratio >= target else 'missed'}"

    print("\nworkload  measure                     off      on   on/off")
    for name in ("a", "b"):
        for measure, label in (
            ("batch1", "batch-1 decode tok/s"),
            ("batch32", f"{count} seqs tok/s"),
        ):
            off, on = median((name, "off", measure)), median((name, "on", measure))
            target = GOALS["batch32"] if measure == "batch32" else GOALS[f"{name}_batch1"]
            ratio = on / off
            print(f"({name})       {label:<22} {off:7.1f} {on:7.1f}   {ratio:5.2f}x  "
                  f"({goal(ratio, target)})")  # fmt: skip
    print(
        f"with speculation (all runs): acceptance rate {spec_figures['acceptance']:.1%}, "
        f"mean accepted length {spec_figures['mean_length']:.2f}"
    )
    for bound in bounds:
        every, oracle, free = bound.every_draft, bound.oracle, bound.free_rows
        print(f"(a) replayed at the engine's batch-1 step cost ({1e3 * bound.fixed:.2f} ms + "
              f"{1e3 * bound.per_row:.2f} ms a row): every draft verified {every:.2f}x, "
              f"only the drafts kept (oracle) {oracle:.2f}x; rows free {free:.2f}x")  # fmt: skip
    if llama is not None:
        on = median(("a", "on", "batch1"))
        lookup = statistics.median(llama["lookup"]["runs"])
        plain = statistics.median(llama["plain"]["runs"])
        version = llama["lookup"]["version"]
        print(f"llama.cpp (llama-cpp-python {version}), workload (a), batch-1 decode: prompt "
              f"lookup {lookup:.1f} tok/s, without {plain:.1f} tok/s")  # fmt: skip
        print(f"pagedkv with speculation / llama.cpp with prompt lookup: {on / lookup:.2f}x "
              f"({goal(on / lookup, GOALS['a_vs_llama'])})")  # fmt: skip


def machine() -> str:
    """The CPU's model name and the vector extensions that decide the kernels' path."""
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown CPU":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = sorted(f for f in flags if f == "avx2" or f.startswith("avx512") or "vnni" in f)
    return f"{model} ({' '.join(wanted) or 'no AVX2'})"


def load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds, alternating (default: 2)")
    parser.add_argument("--num-prompts", type=int, default=32, help="prompts per workload")
    parser.add_argument("--max-tokens", type=int, default=160, help="(default: 160)")
    parser.add_argument("--num-speculative-tokens", type=int, default=5, help="(default: 5)")
    parser.add_argument("--prompt-lookup-max", type=int, default=4, help="(default: 4)")
    parser.add_argument("--prompt-lookup-min", type=int, default=2, help="(default: 2)")
    parser.add_argument("--threads", type=int, default=None, help="(default: physical cores)")
    parser.add_argument("--llama-python", type=Path, default=None, help="llama-cpp-python's python")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
