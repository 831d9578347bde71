"""Prometheus metrics under vLLM's names, with `pagedkv:` for `vllm:`: the server's
`GET /metrics` and `LLM.get_metrics()` read the same registry.

The prefix `vllm` names them exactly as vLLM does, so its dashboards (and vLLM code that reads
`LLM.get_metrics()`) work unchanged.

Gauges and counters are read from the engine's latest `EngineStats` when collected (a custom
collector), so the engine keeps one source of truth and nothing counts tokens twice. Latency
and size histograms are observed from each step's outputs (`observe_outputs`) for the requests
the caller said it tracks. Each owner gets its own registry, so several servers or `LLM`s can
live in one process (the tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedkv.engine.outputs import RequestOutputKind

if TYPE_CHECKING:
    from pagedkv.engine.engine import Engine
    from pagedkv.engine.outputs import RequestOutput
    from pagedkv.engine.params import SamplingParams
    from pagedkv.engine.stats import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_PREFIX = "pagedkv"
PREFIXES = (DEFAULT_PREFIX, "vllm")

# Every sample's labels, as vLLM's: the model's name and the engine's index, which is vLLM's
# first ("0") since one engine serves here (vLLM counts its data-parallel engines).
LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"

# vLLM's buckets, so dashboards built for it read ours unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# Tokens per engine step, as vLLM's iteration_tokens_total buckets.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Samples per request (request_params_n), as vLLM's buckets.
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)


def token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_model_len`: vLLM's buckets for token counts."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass
class _Tracked:
    """What a tracked request's histograms need beyond its outputs."""

    params: SamplingParams  # what request_params_n and request_params_max_tokens count
    num_tokens: dict[int, int] = field(default_factory=dict)  # per sample index
    last_token_time: float | None = None  # when the last output token came (inter-token time)


class EngineMetrics:
    """The registry of one engine's owner: engine-stats collector plus per-request
    histograms."""

    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats],
        max_model_len: int,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        self.model_name = model_name
        self.label_values = (model_name, ENGINE_INDEX)
        self._tracked: dict[str, _Tracked] = {}
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(self.label_values, stats, prefix))
        labels = list(LABELS)

        def histogram(name: str, documentation: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(
                f"{prefix}:{name}", documentation, labels, buckets=buckets, registry=self.registry
            )

        def latency(name: str, documentation: str) -> Histogram:
            return histogram(name, documentation, E2E_BUCKETS)

        def tokens(name: str, documentation: str) -> Histogram:
            return histogram(name, documentation, token_buckets(max_model_len))

        self.request_prompt_tokens = tokens(
            "request_prompt_tokens", "Prompt tokens of each finished request."
        )
        self.request_generation_tokens = tokens(
            "request_generation_tokens", "Generated tokens of each finished request."
        )
        self.request_max_num_generation_tokens = tokens(
            "request_max_num_generation_tokens",
            "Generated tokens of each finished request's longest sample.",
        )
        self.request_queue_time = latency(
            "request_queue_time_seconds", "Time from arrival to the first scheduled step."
        )
        self.request_prefill_time = latency(
            "request_prefill_time_seconds", "Time from the first scheduled step to the first token."
        )
        self.request_decode_time = latency(
            "request_decode_time_seconds", "Time from the first token to the last."
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            TTFT_BUCKETS,
        )
        # vLLM V1's older name for inter_token_latency_seconds (deprecated in 0.11, later
        # removed): the same per-token observations, for dashboards that still read it.
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds",
            "Time between a request's consecutive output tokens (inter_token_latency_seconds).",
            TPOT_BUCKETS,
        )
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Each finished request's mean time per output token after the first (0: one token).",
            TPOT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Time between a request's consecutive output tokens.",
            TPOT_BUCKETS,
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total",
            "Tokens of each engine step: prompt tokens computed plus tokens sampled.",
            ITERATION_TOKEN_BUCKETS,
        )
        self.e2e_request_latency = latency(
            "e2e_request_latency_seconds", "Time from arrival to the last token."
        )
        self.request_inference_time = latency(
            "request_inference_time_seconds",
            "Time a request spent running: from its first scheduled step to its last token.",
        )
        self.request_params_n = histogram(
            "request_params_n", "The n (samples) of each finished request.", PARAMS_N_BUCKETS
        )
        self.request_params_max_tokens = tokens(
            "request_params_max_tokens", "The max_tokens of each finished request."
        )
        self.request_success = Counter(
            f"{prefix}:request_success",
            "Finished requests by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )

    def track(self, request_id: str, params: SamplingParams) -> None:
        """Observe this request's outputs from now on (it was just added to the engine)."""
        self._tracked[request_id] = _Tracked(params)

    def observe_outputs(self, outputs: Iterable[RequestOutput], iteration_tokens: int) -> None:
        """Record one engine step (engine thread): its iteration tokens, the time since each
        tracked request's previous output token, and the requests that finished."""
        now = time.monotonic()
        if iteration_tokens:
            self.iteration_tokens.labels(*self.label_values).observe(iteration_tokens)
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            # A delta holds the new tokens; a cumulative or final output all of them so far.
            whole = tracked.params.output_kind not in (None, RequestOutputKind.DELTA)
            new_tokens = 0
            for completion in output.outputs:
                before = tracked.num_tokens.get(completion.index, 0)
                after = len(completion.token_ids) + (0 if whole else before)
                tracked.num_tokens[completion.index] = after
                new_tokens += after - before
            if new_tokens:
                if tracked.last_token_time is not None:
                    self._observe_inter_token(now - tracked.last_token_time)
                tracked.last_token_time = now
            if output.finished:
                del self._tracked[output.request_id]
                counts = tracked.num_tokens.values()
                self._observe_finished(output, sum(counts), max(counts, default=0), tracked.params)

    def count_abort(self, request_id: str) -> None:
        """A tracked request its owner ended itself (a failed step, a shutdown) and will not
        see finish: vLLM's "abort"."""
        if self._tracked.pop(request_id, None) is not None:
            self.request_success.labels(*self.label_values, "abort").inc()

    def _observe_inter_token(self, seconds: float) -> None:
        self.inter_token_latency.labels(*self.label_values).observe(seconds)
        self.time_per_output_token.labels(*self.label_values).observe(seconds)

    def _observe_finished(
        self,
        output: RequestOutput,
        generation_tokens: int,
        num_output_tokens: int,
        params: SamplingParams,
    ) -> None:
        """Record a finished request's latencies and parameters (prometheus-client is
        thread-safe).

        `generation_tokens` counts every sample's tokens (vLLM's request_generation_tokens);
        `num_output_tokens` is the longest sample's, whose decode time the per-token time
        divides.
        """
        metrics = output.metrics
        self.request_params_n.labels(*self.label_values).observe(params.n)
        if params.max_tokens is not None:
            self.request_params_max_tokens.labels(*self.label_values).observe(params.max_tokens)
        reason = next((c.finish_reason for c in output.outputs if c.finish_reason), "abort")
        self.request_success.labels(*self.label_values, reason).inc()
        self.request_prompt_tokens.labels(*self.label_values).observe(len(output.prompt_token_ids))
        self.request_generation_tokens.labels(*self.label_values).observe(generation_tokens)
        self.request_max_num_generation_tokens.labels(*self.label_values).observe(num_output_tokens)
        scheduled = metrics.first_scheduled_time
        if scheduled is None or metrics.first_token_time is None or metrics.finished_time is None:
            return  # aborted before its first token: no latency to speak of
        first_token = metrics.first_token_time - metrics.arrival_time
        self.time_to_first_token.labels(*self.label_values).observe(first_token)
        self.e2e_request_latency.labels(*self.label_values).observe(
            metrics.finished_time - metrics.arrival_time
        )
        self.request_queue_time.labels(*self.label_values).observe(scheduled - metrics.arrival_time)
        self.request_prefill_time.labels(*self.label_values).observe(
            metrics.first_token_time - scheduled
        )
        decode_time = metrics.finished_time - metrics.first_token_time
        self.request_decode_time.labels(*self.label_values).observe(decode_time)
        self.request_inference_time.labels(*self.label_values).observe(
            metrics.finished_time - scheduled
        )
        self.request_time_per_output_token.labels(*self.label_values).observe(
            decode_time / (num_output_tokens - 1) if num_output_tokens > 1 else 0.0
        )

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


def vllm_metrics(engine: Engine) -> EngineMetrics:
    """The metrics vLLM's offline APIs (`LLM`, `LLMEngine`) read over `engine`, under vLLM's
    names."""
    return EngineMetrics(
        engine.model_name, lambda: engine.stats, engine.max_model_len, prefix="vllm"
    )


class EngineStatsCollector(Collector):
    """Gauges and counters straight from the latest EngineStats, read at scrape time."""

    def __init__(
        self, label_values: tuple[str, str], stats: Callable[[], EngineStats], prefix: str
    ) -> None:
        self.label_values = label_values  # LABELS' values
        self.stats = stats
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        """One metric family per engine figure."""
        stats = self.stats()
        model = list(self.label_values)

        def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"{self.prefix}:{name}", documentation, labels=LABELS)
            family.add_metric(model, value)
            return family

        def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"{self.prefix}:{name}", documentation, labels=LABELS)
            family.add_metric(model, value)
            return family

        cache_config = GaugeMetricFamily(
            f"{self.prefix}:cache_config_info",
            "The KV cache's configuration, in the labels (vLLM's names).",
            labels=["block_size", "num_gpu_blocks", "num_cpu_blocks", "cache_dtype", "engine"],
        )
        sizes = [stats.block_size, stats.num_gpu_blocks, stats.num_cpu_blocks]
        values = [*(str(size) for size in sizes), stats.kv_cache_dtype, ENGINE_INDEX]
        cache_config.add_metric(values, 1)
        yield cache_config
        yield gauge(
            "kv_cache_bytes_per_block",
            "Bytes one KV block takes, all layers, K and V (the KV dtype's size decides it).",
            stats.kv_bytes_per_block,
        )
        yield gauge(
            "cpu_threads",
            "CPU threads the model runs on now (fewer while other processes want the cores).",
            stats.cpu_threads,
        )
        yield gauge("num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield gauge("num_requests_swapped", "Requests swapped out to CPU.", stats.num_swapped)
        yield gauge(
            "kv_cache_usage_perc", "Fraction of GPU KV blocks held (1 = full).", stats.kv_usage
        )
        yield gauge(
            "kv_cache_utilisation_perc",
            "Fraction of held KV block capacity filled with token state.",
            stats.kv_utilisation,
        )
        cpu_usage = stats.num_swapped_blocks / stats.num_cpu_blocks if stats.num_cpu_blocks else 0
        yield gauge("cpu_cache_usage_perc", "Fraction of CPU swap blocks held.", cpu_usage)
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_queried_tokens,
        )
        yield counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_hit_tokens
        )
        yield gauge(
            "offload_blocks",
            f"KV blocks held by the prefix cache's host tier (of {stats.num_offload_blocks}).",
            stats.offload_blocks,
        )
        yield counter(
            "offload_queries", "Blocks looked up in the host tier.", stats.offload_queries_total
        )
        yield counter(
            "offload_hits",
            "Blocks found in the host tier and copied back.",
            stats.offload_hits_total,
        )
        preemptions = CounterMetricFamily(
            f"{self.prefix}:num_preemptions",
            "Preemptions by kind: swap (blocks moved to CPU) or recompute (blocks dropped).",
            labels=[*LABELS, "kind"],
        )
        preemptions.add_metric([*model, "swap"], stats.num_swap_preemptions)
        preemptions.add_metric([*model, "recompute"], stats.num_recompute_preemptions)
        yield preemptions
        spec = stats.spec_decoding
        if spec.enabled:  # as vLLM's, only from an engine that speculates
            yield counter(
                "spec_decode_num_drafts",
                "Speculative steps of a sequence that verified drafts.",
                spec.num_drafts,
            )
            yield counter(
                "spec_decode_num_draft_tokens", "Drafted tokens verified.", spec.num_draft_tokens
            )
            yield counter(
                "spec_decode_num_accepted_tokens", "Drafted tokens kept.", spec.num_accepted_tokens
            )
            per_position = CounterMetricFamily(
                f"{self.prefix}:spec_decode_num_accepted_tokens_per_pos",
                "Drafted tokens kept, by position after the sequence's last token (0 first; "
                "every position up to num_speculative_tokens, from the start).",
                labels=[*LABELS, "position"],
            )
            for position, count in enumerate(spec.accepted_per_position):
                per_position.add_metric([*model, str(position)], count)
            yield per_position
        yield counter("prompt_tokens", "Prompt tokens processed.", stats.prompt_tokens_total)
        yield counter("generation_tokens", "Tokens generated.", stats.generation_tokens_total)
