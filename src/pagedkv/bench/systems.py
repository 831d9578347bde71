"""The systems under test, loaded once, each able to run a workload; pagedkv's run itself.

pagedkv gets a fresh, warmed-up engine per timed run, so no run finds an earlier round's
prompts in its prefix cache. Its figures come from the engine's own counters and its runner's
clocks: `model_seconds` (inside the model's forward alone) and `forward_seconds` (plan, batch
building and forward), read before and after each step; nothing of the engine is replaced.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

from pagedkv.bench.results import GOAL_CONCURRENCY, EngineFigures, RunResult
from pagedkv.bench.transformers_baselines import (
    load_hf_model,
    run_hf_continuous_batching,
    run_hf_generate,
)
from pagedkv.bench.workloads import Workload, WorkloadSpec, make_workload
from pagedkv.engine import Engine, EngineArgs, SamplingParams

SYSTEMS = ("pagedkv", "hf-generate", "hf-cb")
SYSTEM_TITLES = {
    "pagedkv": "pagedkv",
    "hf-generate": "transformers generate (static)",
    "hf-cb": "transformers continuous batching",
}
# The warm-up run: two short requests, enough for lazy initialisation and caches.
_WARM_UP = WorkloadSpec(2, (8, 8), (4, 4))


@dataclass
class BenchConfig:
    """Everything one invocation runs."""

    engine_args: EngineArgs  # its model: a folder, or a built-in name (its own GGUF file)
    hf_folder: str | None  # the same weights in float, as a folder transformers loads
    model_label: str
    workloads: list[Workload]
    kv_tokens: int
    rounds: int
    systems: list[str]
    cb_page_size: int
    seed: int


class Systems:
    """The loaded systems, each able to run a workload once."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.engine = None
        self.hf_model = None
        if "pagedkv" in config.systems:
            self.engine = Engine(config.engine_args)
        if {"hf-generate", "hf-cb"} & set(config.systems):
            self.hf_model = load_hf_model(config.hf_folder)

    @property
    def num_parameters(self) -> int:
        """Parameters of the model under test (0 when no system is loaded)."""
        if self.engine is not None:
            return sum(p.numel() for p in self.engine.runner.model.parameters())
        if self.hf_model is not None:
            return sum(p.numel() for p in self.hf_model.parameters())
        return 0

    def warm_up(self) -> None:
        """One short run per system (lazy initialisation, caches), outside any timing."""
        warm = make_workload("warm-up", _WARM_UP, self._vocab_size(), self.config.seed)
        for system in self.config.systems:
            self.run(system, warm, -1)

    def run(self, system: str, workload: Workload, round_index: int) -> RunResult:
        """Run `workload` once on `system`; a timed round (index >= 0) of pagedkv starts fresh."""
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
        """A new engine, warmed up: its prefix cache holds nothing of an earlier round."""
        if self.engine is not None:
            self.engine.shutdown()  # its tensor-parallel workers, if any, before new ones start
        self.engine = None
        gc.collect()
        self.engine = Engine(self.config.engine_args)
        warm = make_workload("warm-up", _WARM_UP, self._vocab_size(), self.config.seed)
        run_pagedkv(self.engine, warm, -1)

    def _vocab_size(self) -> int:
        if self.engine is not None:
            return self.engine.config.vocab_size
        return self.hf_model.config.vocab_size


def run_pagedkv(engine: Engine, workload: Workload, round_index: int) -> RunResult:
    """Queue every request, step the engine until all finish; figures from its counters."""
    runner = engine.runner
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
        model_before = runner.model_seconds
        engine_forward_before = runner.forward_seconds
        deltas = engine.step()
        step_seconds = time.perf_counter() - step_started
        seconds += step_seconds
        # Bookkeeping below is outside the throughput clock.
        for delta in deltas:
            for piece in delta.outputs:
                produced[delta.request_id] = produced.get(delta.request_id, 0) + len(
                    piece.token_ids
                )
        forward = runner.model_seconds - model_before
        # A step with nothing to run may skip the runner, leaving last_num_seqs of an earlier
        # step: only a step whose model clock moved ran a forward.
        num_seqs = runner.last_num_seqs if forward else 0
        stats = engine.stats
        figures.steps += 1
        figures.step_seconds += step_seconds
        figures.model_forward_seconds += forward
        figures.engine_forward_seconds += runner.forward_seconds - engine_forward_before
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
    if after.spec_decoding.enabled:
        figures.spec = after.spec_decoding.since(before.spec_decoding)
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
