"""Engine throughput against transformers: one workload, one model, one KV budget, one process.

Three systems generate the same seeded workload greedily, with every request producing
exactly its requested number of tokens (ignore_eos), in alternating order over a few rounds:
- pagedkv: the `Engine`, paged KV blocks out of the budget, continuous batching;
- transformers `generate`: left-padded static batches in arrival order, as many requests per
  batch as the budget holds at the longest possible request (max prompt + max output): the
  contiguous-reservation baseline. A batch runs until its longest request is done; only each
  request's requested tokens count as useful output;
- transformers continuous batching (its paged cache and scheduler), sized to the same number
  of KV tokens and the same token budget per step.
Throughput is useful generated tokens per second of wall time, from the first request queued to
the last token out (model loading and warm-up excluded). pagedkv gets a fresh, warmed-up engine
per run, so no run finds an earlier round's prompts in its prefix cache; transformers' continuous
batching gets a fresh manager (and cache) per run as well. The figures that explain pagedkv's
side (peak concurrency, KV utilisation, preemptions, the share of step time spent outside the
model's forward pass) come from the engine's own counters and a timer around its model.

`pagedkv bench` and `bench/engine_bench.py` both call `main`/`run`; transformers is needed
only here (it is the baseline), never by the engine.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

# Built-in name of the seeded random Llama of about 20M parameters, made on first use.
RANDOM_MODEL = "random-llama-20m"
SYSTEMS = ("pagedkv", "hf-generate", "hf-cb")
SYSTEM_TITLES = {
    "pagedkv": "pagedkv",
    "hf-generate": "transformers generate (static)",
    "hf-cb": "transformers continuous batching",
}
# Goals of the issue: pagedkv / baseline throughput ratio per workload.
GOAL_RATIOS = {"mixed": 2.0, "uniform": 1.0}
GOAL_OUTSIDE_FORWARD = 0.10
GOAL_CONCURRENCY = 32


# -- workloads -------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadSpec:
    """How many prompts, and the ranges (inclusive) their lengths and outputs are drawn from."""

    num_prompts: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]


WORKLOADS: dict[str, WorkloadSpec] = {
    "uniform": WorkloadSpec(32, (32, 256), (128, 128)),
    "mixed": WorkloadSpec(48, (32, 256), (16, 512)),
}


@dataclass(frozen=True)
class Workload:
    """Seeded prompts (token ids) and each request's exact output length."""

    name: str
    spec: WorkloadSpec
    seed: int
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def requested_tokens(self) -> int:
        """Tokens the workload asks for: the useful output of every system."""
        return sum(self.output_lens)

    @property
    def max_request_tokens(self) -> int:
        """The longest a request could be: max prompt + max output of the spec."""
        return self.spec.prompt_len[1] + self.spec.output_len[1]

    def describe(self) -> str:
        """One line: counts and ranges."""
        spec = self.spec
        return (
            f"{self.name}: {spec.num_prompts} prompts of {_range(spec.prompt_len)} tokens, "
            f"outputs {_range(spec.output_len)} (ignore_eos, greedy), seed {self.seed}; "
            f"{sum(map(len, self.prompts))} prompt tokens, {self.requested_tokens} to generate"
        )


def make_workload(name: str, spec: WorkloadSpec, vocab_size: int, seed: int) -> Workload:
    """Random prompts over ids [3, vocab_size) (clear of the usual specials) and output lengths."""
    rng = random.Random(f"{name}:{seed}")
    low = min(3, vocab_size - 1)
    prompts, output_lens = [], []
    for _ in range(spec.num_prompts):
        length = rng.randint(*spec.prompt_len)
        prompts.append([rng.randrange(low, vocab_size) for _ in range(length)])
        output_lens.append(rng.randint(*spec.output_len))
    return Workload(name, spec, seed, prompts, output_lens)


# -- results ---------------------------------------------------------------------------------


@dataclass
class RunResult:
    """One system's run of the workload."""

    system: str
    round: int
    seconds: float
    useful_tokens: int  # requested output tokens produced (what counts)
    generated_tokens: int  # every token the system produced, padding batches included
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        """Useful tokens per second."""
        return self.useful_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class EngineFigures:
    """What the pagedkv engine did during one run (from its counters and a model timer)."""

    steps: int = 0
    peak_running: int = 0
    mean_running: float = 0.0
    peak_kv_usage: float = 0.0
    mean_kv_utilisation: float = 0.0  # token state / held block capacity, over the steps
    swap_preemptions: int = 0
    recompute_preemptions: int = 0
    prefix_hit_tokens: int = 0
    step_seconds: float = 0.0
    model_forward_seconds: float = 0.0  # inside LlamaModel.forward only
    engine_forward_seconds: float = 0.0  # the engine's own clock: plan + batch + forward
    busy_steps: int = 0  # steps with at least GOAL_CONCURRENCY sequences in the forward
    busy_step_seconds: float = 0.0
    busy_forward_seconds: float = 0.0

    @property
    def outside_forward_share(self) -> float:
        """Share of step time outside the model's forward (scheduling, batch, sampling)."""
        return 1.0 - self.model_forward_seconds / self.step_seconds if self.step_seconds else 0.0

    @property
    def engine_outside_share(self) -> float:
        """The same share by the engine's own forward clock (which counts batch building in)."""
        if not self.step_seconds:
            return 0.0
        return 1.0 - self.engine_forward_seconds / self.step_seconds

    @property
    def busy_outside_share(self) -> float | None:
        """Outside-forward share over the steps running at least GOAL_CONCURRENCY sequences."""
        if not self.busy_steps:
            return None
        return 1.0 - self.busy_forward_seconds / self.busy_step_seconds


# -- the benchmark ---------------------------------------------------------------------------


@dataclass
class BenchConfig:
    """Everything one invocation runs."""

    engine_args: Any  # pagedkv.engine.EngineArgs; its model is a folder by now
    model_label: str
    workloads: list[Workload]
    kv_tokens: int
    rounds: int
    systems: list[str]
    cb_page_size: int
    seed: int


def run_benchmark(config: BenchConfig, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every workload; print the tables; return the figures (JSON-ready)."""
    systems = _Systems(config)
    out(_header(config, systems))
    report: dict[str, Any] = {
        "model": config.model_label,
        "kv_tokens": config.kv_tokens,
        "block_size": config.engine_args.block_size,
        "rounds": config.rounds,
        "workloads": {},
    }
    systems.warm_up()
    for workload in config.workloads:
        results: list[RunResult] = []
        for round_index in range(config.rounds):
            order = config.systems if round_index % 2 == 0 else config.systems[::-1]
            for system in order:
                result = systems.run(system, workload, round_index)
                results.append(result)
                out(
                    f"  round {round_index + 1}  {SYSTEM_TITLES[system]:<34} "
                    f"{result.seconds:8.2f} s  {result.tokens_per_s:9.1f} tok/s"
                )
        report["workloads"][workload.name] = _report_workload(config, workload, results, out)
    return report


class _Systems:
    """The loaded systems, each able to run a workload once."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.engine = None
        self.hf_model = None
        if "pagedkv" in config.systems:
            self.engine = _load_engine(config.engine_args)
        if {"hf-generate", "hf-cb"} & set(config.systems):
            self.hf_model = _load_hf_model(config.engine_args.model)

    @property
    def static_batch_size(self) -> int:
        """Requests per static batch: the budget over the longest request."""
        longest = max(w.max_request_tokens for w in self.config.workloads)
        return max(1, self.config.kv_tokens // longest)

    def warm_up(self) -> None:
        """One short run per system (lazy initialisation, caches), outside any timing."""
        vocab = self._vocab_size()
        spec = WorkloadSpec(2, (8, 8), (4, 4))
        warm = make_workload("warm-up", spec, vocab, self.config.seed)
        for system in self.config.systems:
            self.run(system, warm, -1)

    def run(self, system: str, workload: Workload, round_index: int) -> RunResult:
        if system == "pagedkv":
            if round_index >= 0:
                self._fresh_engine()
            return run_pagedkv(self.engine, workload, round_index)
        if system == "hf-generate":
            batch_size = max(1, self.config.kv_tokens // workload.max_request_tokens)
            return run_hf_generate(self.hf_model, workload, round_index, batch_size)
        return run_hf_continuous_batching(
            self.hf_model,
            workload,
            round_index,
            kv_tokens=self.config.kv_tokens,
            page_size=self.config.cb_page_size,
            max_batch_tokens=self.config.engine_args.max_num_batched_tokens,
            max_requests=self.config.engine_args.max_num_seqs,
        )

    def _fresh_engine(self) -> None:
        """A new engine, warmed up: its prefix cache holds nothing of an earlier round.

        (The scheduler does not pass `cache_salt` to the memory manager yet, so a salt per
        round would not keep a second round from hitting the first round's blocks.)
        """
        self.engine = None
        gc.collect()
        self.engine = _load_engine(self.config.engine_args)
        spec = WorkloadSpec(2, (8, 8), (4, 4))
        warm = make_workload("warm-up", spec, self._vocab_size(), self.config.seed)
        run_pagedkv(self.engine, warm, -1)

    def _vocab_size(self) -> int:
        if self.engine is not None:
            return self.engine.config.vocab_size
        return self.hf_model.config.vocab_size


# -- pagedkv ---------------------------------------------------------------------------------


class _ModelTimer:
    """Stands in for the engine's model: times each forward and notes its batch size."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.seconds = 0.0
        self.last_num_seqs = 0

    def __call__(self, batch: Any, kv_cache: Any) -> torch.Tensor:
        started = time.perf_counter()
        logits = self.model(batch, kv_cache)
        self.seconds += time.perf_counter() - started
        self.last_num_seqs = batch.num_seqs
        return logits

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def _load_engine(engine_args: Any) -> Any:
    from pagedkv.engine import Engine

    engine = Engine(engine_args)
    engine.runner.model = _ModelTimer(engine.runner.model)
    return engine


def run_pagedkv(engine: Any, workload: Workload, round_index: int) -> RunResult:
    """Queue every request, step the engine until all finish; figures from its counters."""
    from pagedkv.engine import SamplingParams

    timer: _ModelTimer = engine.runner.model
    before = engine.stats
    prefix = f"round-{round_index}"
    figures = EngineFigures()
    running_sum = kv_utilisation_sum = 0.0
    produced: dict[str, int] = {}
    started = time.perf_counter()
    for index, (prompt, output_len) in enumerate(
        zip(workload.prompts, workload.output_lens, strict=True)
    ):
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        engine.add_request(f"{prefix}-{index}", prompt, params)
    seconds = time.perf_counter() - started
    while engine.has_unfinished():
        step_started = time.perf_counter()
        forward_before = timer.seconds
        engine_forward_before = engine.runner.forward_seconds
        deltas = engine.step()
        step_seconds = time.perf_counter() - step_started
        seconds += step_seconds
        # Bookkeeping below is outside the throughput clock.
        for delta in deltas:
            for piece in delta.outputs:
                produced[delta.request_id] = produced.get(delta.request_id, 0) + len(
                    piece.token_ids
                )
        forward = timer.seconds - forward_before
        num_seqs = timer.last_num_seqs if forward else 0
        stats = engine.stats
        figures.steps += 1
        figures.step_seconds += step_seconds
        figures.model_forward_seconds += forward
        figures.engine_forward_seconds += engine.runner.forward_seconds - engine_forward_before
        figures.peak_running = max(figures.peak_running, num_seqs)
        figures.peak_kv_usage = max(figures.peak_kv_usage, stats.kv_usage)
        running_sum += num_seqs
        kv_utilisation_sum += stats.kv_utilisation
        if num_seqs >= GOAL_CONCURRENCY:
            figures.busy_steps += 1
            figures.busy_step_seconds += step_seconds
            figures.busy_forward_seconds += forward
    after = engine.stats
    if figures.steps:
        figures.mean_running = running_sum / figures.steps
        figures.mean_kv_utilisation = kv_utilisation_sum / figures.steps
    figures.swap_preemptions = after.num_swap_preemptions - before.num_swap_preemptions
    figures.recompute_preemptions = (
        after.num_recompute_preemptions - before.num_recompute_preemptions
    )
    figures.prefix_hit_tokens = after.prefix_hit_tokens - before.prefix_hit_tokens
    useful = sum(
        min(produced.get(f"{prefix}-{index}", 0), output_len)
        for index, output_len in enumerate(workload.output_lens)
    )
    return RunResult(
        "pagedkv",
        round_index,
        seconds,
        useful,
        sum(produced.values()),
        {"engine": figures},
    )


# -- transformers generate: static batches ---------------------------------------------------


def _load_hf_model(folder: str) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


def run_hf_generate(model: Any, workload: Workload, round_index: int, batch_size: int) -> RunResult:
    """Left-padded static batches in arrival order; each runs until its longest request ends."""
    pad_id = _pad_token_id(model)
    useful = generated = 0
    started = time.perf_counter()
    for first in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[first : first + batch_size]
        output_lens = workload.output_lens[first : first + batch_size]
        width = max(map(len, prompts))
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        num_new = max(output_lens)
        with torch.inference_mode():
            output = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=num_new,
                min_new_tokens=num_new,  # ignore_eos: every row runs to the batch's end
                do_sample=False,
                pad_token_id=pad_id,
            )
        new_tokens = output.shape[1] - width
        generated += new_tokens * len(prompts)
        useful += sum(min(n, new_tokens) for n in output_lens)
    seconds = time.perf_counter() - started
    return RunResult(
        "hf-generate",
        round_index,
        seconds,
        useful,
        generated,
        {"batch_size": batch_size},
    )


def _pad_token_id(model: Any) -> int:
    config = model.generation_config
    for candidate in (config.pad_token_id, config.eos_token_id, model.config.eos_token_id, 0):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


# -- transformers continuous batching --------------------------------------------------------


def run_hf_continuous_batching(
    model: Any,
    workload: Workload,
    round_index: int,
    *,
    kv_tokens: int,
    page_size: int,
    max_batch_tokens: int,
    max_requests: int,
) -> RunResult:
    """transformers' paged cache and scheduler with the same KV tokens and token budget.

    `generate_batch` takes one max_new_tokens for all prompts, so this drives its manager the
    way `generate_batch` does, giving each request its own length and no EOS (-1).
    """
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    generation_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(workload.output_lens),
        eos_token_id=-1,
        pad_token_id=_pad_token_id(model),
    )
    cb_config = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=max(1, kv_tokens // page_size),
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests,
    )
    request_ids = [f"round-{round_index}-{i}" for i in range(len(workload.prompts))]
    produced: dict[str, int] = {}
    with model.continuous_batching_context_manager(
        generation_config=generation_config,
        continuous_batching_config=cb_config,
        block=True,
        timeout=30,
    ) as manager:
        started = time.perf_counter()
        for request_id, prompt, output_len in zip(
            request_ids, workload.prompts, workload.output_lens, strict=True
        ):
            manager.add_request(
                prompt, request_id=request_id, max_new_tokens=output_len, eos_token_id=-1
            )
        while len(produced) < len(request_ids):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers continuous batching stopped unexpectedly")
                continue
            if result.is_finished():
                produced[result.request_id] = len(result.generated_tokens)
        seconds = time.perf_counter() - started
        cache_tokens = manager.cache.num_blocks * page_size if hasattr(manager, "cache") else None
    useful = sum(
        min(produced.get(request_id, 0), output_len)
        for request_id, output_len in zip(request_ids, workload.output_lens, strict=True)
    )
    return RunResult(
        "hf-cb",
        round_index,
        seconds,
        useful,
        sum(produced.values()),
        {"cache_tokens": cache_tokens},
    )


# -- printing --------------------------------------------------------------------------------


def _header(config: BenchConfig, systems: _Systems) -> str:
    args = config.engine_args
    model = systems.hf_model if systems.hf_model is not None else None
    engine = systems.engine
    if engine is not None:
        num_params = sum(p.numel() for p in engine.runner.model.model.parameters())
    elif model is not None:
        num_params = sum(p.numel() for p in model.parameters())
    else:
        num_params = 0
    lines = [
        f"pagedkv bench: {config.model_label} ({num_params / 1e6:.1f}M parameters), "
        f"{args.dtype}, {args.device}, torch threads {torch.get_num_threads()}",
        f"KV budget: {config.kv_tokens} tokens for every system (pagedkv: "
        f"{config.kv_tokens // args.block_size} blocks x {args.block_size}; transformers CB: "
        f"{config.kv_tokens // config.cb_page_size} pages x {config.cb_page_size}); "
        f"token budget per step {args.max_num_batched_tokens}; rounds {config.rounds}, "
        "order alternating",
    ]
    lines += [f"workload {w.describe()}" for w in config.workloads]
    return "\n".join(lines)


def _report_workload(
    config: BenchConfig,
    workload: Workload,
    results: list[RunResult],
    out: Callable[[str], None],
) -> dict[str, Any]:
    by_system: dict[str, list[RunResult]] = {}
    for result in results:
        by_system.setdefault(result.system, []).append(result)
    totals = {
        system: (sum(r.useful_tokens for r in runs), sum(r.seconds for r in runs))
        for system, runs in by_system.items()
    }
    tok_s = {system: useful / seconds for system, (useful, seconds) in totals.items()}
    # pagedkv / system in each round (the runs of a round are neighbours in time, so a change
    # in the machine's load between rounds cancels out), and their geometric mean.
    round_ratios = {
        system: [
            p.tokens_per_s / o.tokens_per_s
            for p, o in zip(by_system["pagedkv"], runs, strict=True)
            if o.tokens_per_s
        ]
        for system, runs in by_system.items()
        if "pagedkv" in by_system
    }
    ratio_of = {system: _geometric_mean(ratios) for system, ratios in round_ratios.items()}
    out("")
    out(f"== {workload.describe()} ==")
    out(
        f"{'system':<34} {'requested':>9} {'useful':>8} {'generated':>9} "
        f"{'s/round':>8} {'tok/s':>8} {'pagedkv/this':>12}"
    )
    for system, runs in by_system.items():
        useful = runs[-1].useful_tokens
        generated = runs[-1].generated_tokens
        seconds = statistics.mean(r.seconds for r in runs)
        ratio = f"{ratio_of[system]:11.2f}x" if system in ratio_of else f"{'-':>12}"
        note = ""
        if system == "hf-generate":
            note = f"  (batches of {runs[-1].details['batch_size']})"
        out(
            f"{SYSTEM_TITLES[system]:<34} {workload.requested_tokens:9d} {useful:8d} "
            f"{generated:9d} {seconds:8.2f} {tok_s[system]:8.1f} {ratio}{note}"
        )
    report: dict[str, Any] = {
        "requested_tokens": workload.requested_tokens,
        "systems": {
            system: {
                "useful_tokens": [r.useful_tokens for r in runs],
                "generated_tokens": [r.generated_tokens for r in runs],
                "seconds": [r.seconds for r in runs],
                "tokens_per_s": tok_s[system],
            }
            for system, runs in by_system.items()
        },
    }
    if "pagedkv" in by_system:
        rounds = by_system["pagedkv"]
        per_round = []
        for system, ratios in round_ratios.items():
            if system == "pagedkv":
                continue
            per_round.append(
                f"{SYSTEM_TITLES[system]} " + " / ".join(f"{ratio:.2f}x" for ratio in ratios)
            )
            report["systems"][system]["ratio"] = ratio_of[system]
            report["systems"][system]["ratio_per_round"] = ratios
            report["systems"][system]["ratio_of_totals"] = tok_s["pagedkv"] / tok_s[system]
        if per_round:
            out(
                "pagedkv/this per round (the table shows their geometric mean): "
                + "; ".join(per_round)
            )
        figures = [r.details["engine"] for r in rounds]
        last = figures[-1]
        busy = [f for f in figures if f.busy_steps]
        busy_share = (
            1.0 - sum(f.busy_forward_seconds for f in busy) / sum(f.busy_step_seconds for f in busy)
            if busy
            else None
        )
        step_total = sum(f.step_seconds for f in figures)
        outside = 1.0 - sum(f.model_forward_seconds for f in figures) / step_total
        engine_outside = 1.0 - sum(f.engine_forward_seconds for f in figures) / step_total
        out(
            f"pagedkv engine: peak concurrency {last.peak_running} sequences "
            f"(mean {last.mean_running:.1f} over {last.steps} steps); KV usage peak "
            f"{last.peak_kv_usage:.0%}; KV utilisation (token state / held blocks) mean "
            f"{last.mean_kv_utilisation:.1%}; preemptions swap {last.swap_preemptions}, "
            f"recompute {last.recompute_preemptions}; prefix-cache hits "
            f"{last.prefix_hit_tokens} tokens"
        )
        busy_text = (
            f"{busy_share:.1%} over the {sum(f.busy_steps for f in busy)} steps with "
            f">= {GOAL_CONCURRENCY} sequences"
            if busy_share is not None
            else f"no step reached {GOAL_CONCURRENCY} sequences"
        )
        out(
            f"pagedkv step time outside the model forward (scheduling, batch building, "
            f"sampling, stops, detokenising): {outside:.1%} of all steps; {busy_text} "
            f"(engine's own forward clock, which counts batch building and plans as forward: "
            f"{engine_outside:.1%})"
        )
        report["engine"] = {
            **{k: v for k, v in asdict(last).items()},
            "outside_forward_share": outside,
            "outside_forward_share_busy": busy_share,
            "engine_clock_outside_share": engine_outside,
        }
        out(_goals(workload, report, busy_share, outside))
    return report


def _goals(
    workload: Workload, report: dict[str, Any], busy_share: float | None, outside: float
) -> str:
    goal = GOAL_RATIOS.get(workload.name)
    verdicts = []
    if goal is not None:
        for system in ("hf-generate", "hf-cb"):
            ratio = report["systems"].get(system, {}).get("ratio")
            if ratio is not None:
                verdict = "met" if ratio >= goal else "MISSED"
                verdicts.append(f"{SYSTEM_TITLES[system]} >= {goal:g}x: {verdict} ({ratio:.2f}x)")
    share = busy_share if busy_share is not None else outside
    where = f"at >= {GOAL_CONCURRENCY} running" if busy_share is not None else "overall"
    verdict = "met" if share <= GOAL_OUTSIDE_FORWARD else "MISSED"
    verdicts.append(
        f"outside-forward share {where} <= {GOAL_OUTSIDE_FORWARD:.0%}: {verdict} ({share:.1%})"
    )
    if workload.spec != WORKLOADS.get(workload.name):
        return "goals (set for the issue's workload, not this overridden one): " + "; ".join(
            verdicts
        )
    return "goals: " + "; ".join(verdicts)


def _geometric_mean(values: list[float]) -> float:
    positive = [v for v in values if v > 0]
    if not positive:
        return 0.0
    return math.exp(sum(math.log(v) for v in positive) / len(positive))


def _range(bounds: tuple[int, int]) -> str:
    low, high = bounds
    return str(low) if low == high else f"{low}-{high}"


# -- the random model ------------------------------------------------------------------------


def random_model_folder(seed: int = 0, root: Path | None = None) -> Path:
    """The seeded random Llama of about 20M parameters as a Hugging Face folder (made once).

    8 layers of width 384 (6 heads, 2 KV heads of 64), MLP 1152, and a byte-level BPE tokenizer
    of 8192 ids trained on seeded pseudo-words, so every id the model can emit decodes.
    """
    from pagedkv.hub import cache_dir

    root = root if root is not None else cache_dir() / "bench"
    folder = root / f"{RANDOM_MODEL}-seed{seed}"
    if (folder / "config.json").is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".{folder.name}.partial-{time.time_ns()}"
    _write_random_model(staging, seed)
    try:
        staging.rename(folder)
    except OSError:  # another process finished first: keep theirs
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _write_random_model(folder: Path, seed: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _train_tokenizer(seed, vocab_size=8192)
    folder.mkdir(parents=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=384,
        intermediate_size=1152,
        num_hidden_layers=8,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": (
            "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
            "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
        ),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def _train_tokenizer(seed: int, vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    syllables = sorted({rng.choice(letters) + rng.choice("aeiouy") for _ in range(400)})
    words = [
        "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(60_000)
    ]
    corpus = [" ".join(words[i : i + 20]) for i in range(0, len(words), 20)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


# -- command line ----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench's flags, then the engine's (`EngineArgs.add_cli_args`)."""
    from pagedkv.engine import EngineArgs

    parser.add_argument(
        "--workload",
        choices=[*WORKLOADS, "all"],
        default="all",
        help="uniform: 32 prompts of 32-256 tokens, 128 new; mixed: 48 prompts of 32-256, "
        "outputs 16-512 (default: all, one after the other)",
    )
    parser.add_argument("--rounds", type=_positive, default=2, help="rounds (default: 2)")
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all)",
    )
    parser.add_argument(
        "--kv-tokens",
        type=_positive,
        default=8192,
        help="KV budget in tokens for every system (default: 8192; --num-gpu-blocks wins "
        "for pagedkv)",
    )
    parser.add_argument("--num-prompts", type=_positive, help="override the workload's count")
    parser.add_argument(
        "--prompt-len", type=_positive, nargs=2, metavar=("MIN", "MAX"), help="override"
    )
    parser.add_argument(
        "--output-len", type=_positive, nargs=2, metavar=("MIN", "MAX"), help="override"
    )
    parser.add_argument(
        "--workload-seed", type=int, default=0, help="seed of prompts and lengths (default: 0)"
    )
    parser.add_argument(
        "--cb-page-size",
        type=_positive,
        default=None,
        help="transformers CB page size in tokens (default: the engine's --block-size)",
    )
    parser.add_argument("--threads", type=_positive, help="torch threads (default: torch's)")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model=RANDOM_MODEL, swap_space_gb=1.0)
    for action in parser._actions:
        if action.dest == "model":
            action.help = (
                f"{RANDOM_MODEL} (seeded random Llama, made on first use; the default), a "
                "Hugging Face folder, or a built-in name such as smollm2-135m-instruct"
            )


def run(args: argparse.Namespace) -> int:
    """Parse the flags into a `BenchConfig`, run it, print; 1 if a token count is wrong."""
    from pagedkv.engine import EngineArgs

    if args.threads:
        torch.set_num_threads(args.threads)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        print(f"pagedkv bench: --systems takes {','.join(SYSTEMS)}, got {args.systems!r}")
        return 2
    folder, label = _model_folder(args.model, args.seed)
    vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
    workloads = []
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    for name in names:
        spec = WORKLOADS[name]
        if args.num_prompts:
            spec = replace(spec, num_prompts=args.num_prompts)
        if args.prompt_len:
            spec = replace(spec, prompt_len=tuple(sorted(args.prompt_len)))
        if args.output_len:
            spec = replace(spec, output_len=tuple(sorted(args.output_len)))
        workloads.append(make_workload(name, spec, vocab_size, args.workload_seed))
    args.model = str(folder)
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.num_gpu_blocks is None and engine_args.kv_cache_memory is None:
        engine_args.num_gpu_blocks = max(1, args.kv_tokens // engine_args.block_size)
    kv_tokens = engine_args.num_gpu_blocks * engine_args.block_size
    config = BenchConfig(
        engine_args=engine_args,
        model_label=label,
        workloads=workloads,
        kv_tokens=kv_tokens if engine_args.num_gpu_blocks else args.kv_tokens,
        rounds=args.rounds,
        systems=systems,
        cb_page_size=args.cb_page_size or engine_args.block_size,
        seed=args.seed,
    )
    report = run_benchmark(config)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=_json_default))
    wrong = [
        f"{name}/{system}: {useful} useful tokens, {figures['requested_tokens']} requested"
        for name, figures in report["workloads"].items()
        for system, per_system in figures["systems"].items()
        for useful in per_system["useful_tokens"]
        if useful != figures["requested_tokens"]
    ]
    for line in wrong:
        print(f"pagedkv bench: token count mismatch: {line}")
    return 1 if wrong else 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python bench/engine_bench.py [flags]`: the same as `pagedkv bench [flags]`."""
    parser = argparse.ArgumentParser(prog="engine_bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def _model_folder(model: str, seed: int) -> tuple[Path, str]:
    """A Hugging Face folder both pagedkv and transformers can load, and a label for it."""
    if model == RANDOM_MODEL:
        return random_model_folder(seed), f"{RANDOM_MODEL} (seed {seed})"
    path = Path(model)
    if path.is_dir():
        return path, path.name
    from pagedkv.weights.load import converted_folder

    if path.suffix == ".gguf":
        raise SystemExit(
            "pagedkv bench: give a built-in name or a folder (`pagedkv convert` a .gguf first), "
            "so transformers loads the same weights"
        )
    return converted_folder(model), model


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _json_default(value: Any) -> Any:
    if isinstance(value, EngineFigures):
        return asdict(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


if __name__ == "__main__":
    sys.exit(main())
