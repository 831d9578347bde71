"""The benchmark's printed report: the header, one table per workload, pagedkv's figures, goals.

Ratios are pagedkv's throughput over a baseline's within each round (the runs of a round are
neighbours in time, so a change in the machine's load between rounds cancels out), and the
table shows their geometric mean. The JSON figures are returned alongside what is printed.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from pagedkv.bench.results import GOAL_CONCURRENCY, RunResult
from pagedkv.bench.systems import SYSTEM_TITLES, BenchConfig
from pagedkv.bench.workloads import WORKLOADS, Workload

# Goals of the issue: pagedkv / baseline throughput ratio per workload.
GOAL_RATIOS = {"mixed": 2.0, "uniform": 1.0}
GOAL_OUTSIDE_FORWARD = 0.10


def header(config: BenchConfig, num_parameters: int) -> str:
    """The lines before any run: model, budgets, and every workload."""
    args = config.engine_args
    lines = [
        f"pagedkv bench: {config.model_label} ({num_parameters / 1e6:.1f}M parameters), "
        f"{args.resolved_dtype}, {args.device}, torch threads {torch.get_num_threads()}",
        f"KV budget: {config.kv_tokens} tokens for every system (pagedkv: "
        f"{config.kv_tokens // args.block_size} blocks x {args.block_size}; transformers CB: "
        f"{config.kv_tokens // config.cb_page_size} pages x {config.cb_page_size}); "
        f"token budget per step {args.max_num_batched_tokens}; rounds {config.rounds}, "
        "order alternating",
    ]
    lines += [f"workload {w.describe()}" for w in config.workloads]
    return "\n".join(lines)


def report_workload(
    workload: Workload, results: list[RunResult], out: Callable[[str], None]
) -> dict[str, Any]:
    """Print the workload's table, pagedkv's figures and the goals; return them as JSON data."""
    by_system: dict[str, list[RunResult]] = {}
    for result in results:
        by_system.setdefault(result.system, []).append(result)
    totals = {
        system: (sum(r.useful_tokens for r in runs), sum(r.seconds for r in runs))
        for system, runs in by_system.items()
    }
    tok_s = {system: useful / seconds for system, (useful, seconds) in totals.items()}
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
        spec = [f.spec for f in figures if f.spec is not None]
        spec_total = sum(spec[1:], spec[0]) if spec else None  # every round's, as the line says
        if spec_total is not None:
            out(f"pagedkv {spec_total.describe()}")
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
            **{k: v for k, v in asdict(last).items() if k != "spec"},
            "outside_forward_share": outside,
            "outside_forward_share_busy": busy_share,
            "engine_clock_outside_share": engine_outside,
        }
        if spec_total is not None:
            report["engine"]["speculative_decoding"] = spec_total.as_dict()
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
        return "goals (set for the named workload, not these overridden lengths): " + "; ".join(
            verdicts
        )
    return "goals: " + "; ".join(verdicts)


def _geometric_mean(values: list[float]) -> float:
    positive = [v for v in values if v > 0]
    if not positive:
        return 0.0
    return math.exp(sum(math.log(v) for v in positive) / len(positive))
