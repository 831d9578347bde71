"""`LLM.get_metrics()` and `LLMEngine.get_metrics()`: vLLM's metric types and names.

Oracles: the outputs the caller received (prompt and generated token counts, requests and
their finish reasons, deltas per request), vLLM's definitions (iteration tokens are prompt
tokens computed plus tokens generated; a counter's name has no `_total`), and speculative
decoding's arithmetic when the model drafts for itself: every greedy draft is kept, so the
accepted tokens equal the drafted ones and position 0 of the per-position vector counts every
draft. The reader alone is checked on a registry filled by hand.
"""

from __future__ import annotations

from collections import Counter as Tally

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge as PromGauge

from pagedkv import LLMEngine
from pagedkv.engine import EngineArgs, RequestOutputKind, SamplingParams
from pagedkv.engine.errors import StepFailed
from pagedkv.engine.metrics_reader import Counter, Gauge, Vector, read_metrics
from pagedkv.engine.metrics_reader import Histogram as HistogramMetric
from tests.engine.conftest import make_llm
from tests.model.tiny_models import random_prompt

K = 3
PROMPTS = [random_prompt(length, seed=70 + length) for length in (9, 23, 40)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)


def by_name(metrics) -> dict[str, list]:
    found: dict[str, list] = {}
    for metric in metrics:
        found.setdefault(metric.name, []).append(metric)
    return found


def one(metrics: dict[str, list], name: str, kind: type):
    [metric] = metrics[name]
    assert isinstance(metric, kind), (name, type(metric))
    return metric


def test_get_metrics_counts_what_generate_returned(engine_zoo):
    folder = str(engine_zoo.folder("llama"))
    llm = make_llm(
        engine_zoo, "llama", speculative_config={"model": folder, "num_speculative_tokens": K}
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    num_prompt = sum(map(len, PROMPTS))
    num_generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    listed = llm.get_metrics()
    metrics = by_name(listed)

    assert all(metric.name.startswith("vllm:") for metric in listed)
    assert not [m.name for m in listed if isinstance(m, Counter) and m.name.endswith("_total")]
    assert one(metrics, "vllm:prompt_tokens", Counter).value == num_prompt
    assert one(metrics, "vllm:generation_tokens", Counter).value == num_generated
    [success] = metrics["vllm:request_success"]
    assert (success.labels["finished_reason"], success.value) == ("length", len(PROMPTS))
    assert one(metrics, "vllm:num_requests_running", Gauge).value == 0
    info = one(metrics, "vllm:cache_config_info", Gauge)
    assert info.labels["num_gpu_blocks"] == str(llm.engine.manager.num_gpu_blocks)

    prompt_sizes = one(metrics, "vllm:request_prompt_tokens", HistogramMetric)
    assert (prompt_sizes.count, prompt_sizes.sum) == (len(PROMPTS), num_prompt)
    assert prompt_sizes.buckets["+Inf"] == len(PROMPTS)
    assert prompt_sizes.buckets["10.0"] == sum(len(p) <= 10 for p in PROMPTS)
    generated = one(metrics, "vllm:request_generation_tokens", HistogramMetric)
    assert (generated.count, generated.sum) == (len(PROMPTS), num_generated)
    iterations = one(metrics, "vllm:iteration_tokens_total", HistogramMetric)
    assert iterations.sum == num_prompt + num_generated  # no prefix shared: all computed
    assert one(metrics, "vllm:time_to_first_token_seconds", HistogramMetric).count == len(PROMPTS)

    drafts = one(metrics, "vllm:spec_decode_num_drafts", Counter).value
    drafted = one(metrics, "vllm:spec_decode_num_draft_tokens", Counter).value
    accepted = one(metrics, "vllm:spec_decode_num_accepted_tokens", Counter).value
    per_position = one(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos", Vector)
    assert drafts > 0 and accepted == drafted  # the model agrees with itself
    assert len(per_position.values) == K and per_position.values[0] == drafts
    assert sum(per_position.values) == accepted
    assert accepted < num_generated  # each step samples one token beyond its drafts


def test_prefix_cache_figures_count_each_prompt_once_however_often_it_is_preempted(engine_zoo):
    """vLLM counts a recompute-preempted request's lookups apart from the prefix-cache queries
    and hits: distinct prompts that preempt each other (a pool too small for them all at once)
    query their prompts' tokens once and hit nothing, though each came back to its own blocks."""
    prompts = [random_prompt(40, seed=90 + index) for index in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    llm = make_llm(
        engine_zoo,
        "llama",
        num_gpu_blocks=12,
        block_size=16,
        enable_prefix_caching=True,
        preemption_mode="recompute",
    )
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_recompute_preemptions > 0
    metrics = by_name(llm.get_metrics())
    assert one(metrics, "vllm:prefix_cache_queries", Counter).value == sum(map(len, prompts))
    assert one(metrics, "vllm:prefix_cache_hits", Counter).value == 0


def test_aborted_generate_counts_its_requests_aborted(engine_zoo, monkeypatch):
    llm = make_llm(engine_zoo, "llama")
    real_execute = llm.engine.runner.execute
    monkeypatch.setattr(llm.engine.runner, "execute", lambda output: 1 / 0)
    with pytest.raises(StepFailed):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], PARAMS, use_tqdm=False)
    monkeypatch.setattr(llm.engine.runner, "execute", real_execute)
    llm.generate([{"prompt_token_ids": PROMPTS[2]}], PARAMS, use_tqdm=False)
    success = {
        m.labels["finished_reason"]: m.value
        for m in by_name(llm.get_metrics())["vllm:request_success"]
    }
    assert success == {"abort": 2, "length": 1}
    assert "vllm:spec_decode_num_drafts" not in by_name(llm.get_metrics())  # vLLM's: only when on


@pytest.mark.parametrize(
    "output_kind",
    [None, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY],
    ids=["default (cumulative)", "delta", "final only"],
)
def test_llm_engine_get_metrics_observes_its_loop(engine_zoo, output_kind):
    """vLLM's LLMEngine loop, whatever its outputs hold (new tokens or all so far): tokens
    per request as the caller counts them, and one inter-token observation per step that
    brought a request new tokens after its first."""
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(engine_zoo.folder("llama")), num_gpu_blocks=64, max_model_len=256)
    )
    lengths = [6 + index for index in range(len(PROMPTS))]
    for index, (prompt, length) in enumerate(zip(PROMPTS, lengths, strict=True)):
        params = SamplingParams(
            n=2, temperature=0.0, max_tokens=length, ignore_eos=True, output_kind=output_kind
        )
        engine.add_request(str(index), prompt, params)
    totals: dict[tuple[str, int], int] = {}
    growing_steps: Tally[str] = Tally()
    while engine.has_unfinished_requests():
        for output in engine.step():
            grew = False
            for sample in output.outputs:
                key = (output.request_id, sample.index)
                before = totals.get(key, 0)
                if output_kind is RequestOutputKind.DELTA:
                    totals[key] = before + len(sample.token_ids)
                else:
                    totals[key] = len(sample.token_ids)
                grew |= totals[key] > before
            growing_steps[output.request_id] += grew
    assert sorted(totals.values()) == sorted(2 * lengths)
    metrics = by_name(engine.get_metrics())
    inter_token = metrics.get("vllm:inter_token_latency_seconds", [])  # none: never observed
    assert sum(h.count for h in inter_token) == sum(growing_steps.values()) - len(PROMPTS)
    n = one(metrics, "vllm:request_params_n", HistogramMetric)
    assert (n.count, n.sum) == (len(PROMPTS), 2 * len(PROMPTS))
    longest = one(metrics, "vllm:request_max_num_generation_tokens", HistogramMetric)
    assert longest.sum == sum(lengths)
    generated = one(metrics, "vllm:request_generation_tokens", HistogramMetric)
    assert generated.sum == sum(totals.values())


def test_the_reader_gives_vllm_types_of_a_registry_filled_by_hand():
    registry = CollectorRegistry()
    gauge = PromGauge("vllm:queue", "", ["model_name"], registry=registry)
    gauge.labels("m").set(2.5)
    counter = PromCounter("vllm:done", "", ["model_name", "reason"], registry=registry)
    counter.labels("m", "stop").inc(3)
    counter.labels("m", "length").inc()
    per_position = PromCounter(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "",
        ["model_name", "position"],
        registry=registry,
    )
    per_position.labels("m", "0").inc(7)
    per_position.labels("m", "2").inc(1)  # position 1 never counted: 0
    histogram = Histogram("vllm:size", "", ["model_name"], buckets=(1, 10), registry=registry)
    for value in (0.5, 4, 4, 30):
        histogram.labels("m").observe(value)
    metrics = read_metrics(registry)
    assert Gauge("vllm:queue", {"model_name": "m"}, 2.5) in metrics
    assert Counter("vllm:done", {"model_name": "m", "reason": "stop"}, 3) in metrics
    assert Counter("vllm:done", {"model_name": "m", "reason": "length"}, 1) in metrics
    assert (
        Vector("vllm:spec_decode_num_accepted_tokens_per_pos", {"model_name": "m"}, [7, 0, 1])
        in metrics
    )
    expected = HistogramMetric(
        "vllm:size", {"model_name": "m"}, 4, 38.5, {"1.0": 1, "10.0": 3, "+Inf": 4}
    )
    assert expected in metrics
    assert len(metrics) == 5
