"""`/metrics` means what vLLM's metrics mean: each figure is checked against arithmetic on the
requests the test sent, read through prometheus_client's own parser."""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.commands import serve as serve_command
from pagedkv.server import ServerConfig
from tests.server.conftest import RunningServer, wait_until

IGNORE_EOS = {"ignore_eos": True}
PROMPT_LEN = 41
# Long enough that the old arrival stamp (taken once the engine thread picks the request up)
# misses it; the assertion itself is an inequality that holds for any hold time.
ENGINE_HOLD_S = 0.5


@pytest.fixture(scope="module")
def server(serve) -> RunningServer:
    return serve(num_gpu_blocks=256, seed=0)


def scrape(server: RunningServer) -> dict[tuple[str, frozenset], float]:
    """Every sample of `/metrics`, keyed by name and labels."""
    with server.http() as http:
        text = http.get("/metrics").text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape_around_completions(
    server: RunningServer, prompts: list[list[int]], max_tokens: int
) -> tuple[dict[tuple[str, frozenset], float], dict[tuple[str, frozenset], float]]:
    """`/metrics` before and after one completions request of `prompts`, each answered with
    exactly `max_tokens` tokens (EOS ignored)."""
    before = scrape(server)
    with server.client() as client:
        client.completions.create(
            model=client.models.list().data[0].id,
            prompt=prompts,
            max_tokens=max_tokens,
            extra_body=IGNORE_EOS,
        )
    return before, scrape(server)


def value(samples: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(
        v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()
    )


def test_prompt_tokens_count_cached_prompt_tokens(client, model_name: str, server) -> None:
    prompt = [(7 * i) % 200 + 3 for i in range(PROMPT_LEN)]
    before = scrape(server)
    for _ in range(2):
        client.completions.create(model=model_name, prompt=prompt, max_tokens=1)
    after = scrape(server)

    def delta(name: str) -> float:
        return value(after, name) - value(before, name)

    assert delta("pagedkv:prefix_cache_hits_total") > 0, "the second prompt hit the cache"
    assert delta("pagedkv:prompt_tokens_total") == 2 * PROMPT_LEN


def test_prompt_tokens_skip_tokens_recomputed_after_preemption(serve) -> None:
    small = serve(num_gpu_blocks=8, preemption_mode="recompute", swap_space_gb=0)
    prompts = [[(5 * i + 11 * j) % 200 + 3 for i in range(10 + j)] for j in range(4)]
    with small.client() as client:
        client.completions.create(
            model=client.models.list().data[0].id,
            prompt=prompts,
            max_tokens=40,
            extra_body=IGNORE_EOS,
        )
    samples = scrape(small)
    assert value(samples, "pagedkv:num_preemptions_total", kind="recompute") > 0
    assert value(samples, "pagedkv:prompt_tokens_total") == sum(len(p) for p in prompts)


def test_aborted_requests_count_as_finished_with_reason_abort(
    client, model_name: str, server
) -> None:
    before = value(scrape(server), "pagedkv:request_success_total", finished_reason="abort")
    stream = client.completions.create(
        model=model_name, prompt="Hello", max_tokens=900, stream=True, extra_body=IGNORE_EOS
    )
    next(iter(stream))
    stream.close()
    wait_until(
        lambda: (
            value(scrape(server), "pagedkv:request_success_total", finished_reason="abort")
            == before + 1
        )
    )


def test_latencies_start_when_the_http_request_arrives(client, model_name: str, server) -> None:
    # Hold the engine thread as it picks the request up: the request arrived no later than
    # `picked`, so its TTFT and end-to-end latency are at least `released - picked`.
    engine = server.app.state.engine_loop.engine
    add_request = engine.add_request
    held: list[float] = []

    def held_add_request(*args: Any, **kwargs: Any) -> None:
        picked = time.monotonic()
        threading.Event().wait(ENGINE_HOLD_S)
        held.append(time.monotonic() - picked)
        add_request(*args, **kwargs)

    before = scrape(server)
    engine.add_request = held_add_request
    try:
        client.completions.create(model=model_name, prompt="Hi", max_tokens=2)
    finally:
        del engine.add_request
    after = scrape(server)
    for name in ["time_to_first_token_seconds", "e2e_request_latency_seconds"]:
        count = f"pagedkv:{name}_count"
        assert value(after, count) - value(before, count) == 1
        total = f"pagedkv:{name}_sum"
        assert value(after, total) - value(before, total) >= held[0], name


def test_metrics_prefix_vllm_names_every_metric_as_vllm_does(serve) -> None:
    vllm = serve(ServerConfig(metrics_prefix="vllm"), num_gpu_blocks=64)
    with vllm.client() as client:
        client.completions.create(model=client.models.list().data[0].id, prompt="Hi", max_tokens=2)
    names = {name for name, _ in scrape(vllm)}
    assert "vllm:prompt_tokens_total" in names
    assert "vllm:e2e_request_latency_seconds_count" in names
    assert all(name.startswith("vllm:") for name in names if ":" in name)
    # As vLLM's, the spec_decode_* counters exist only where the engine speculates.
    assert not any(name.startswith("vllm:spec_decode") for name in names)


def test_speculative_decoding_is_counted_under_vllms_names(serve) -> None:
    """vLLM's spec_decode_* counters through a server started with --speculative-config: drafts
    are counted, the kept ones among them, and the per-position counts add up to the kept. As
    vLLM's, the per-position counter has a series at 0 for each of the k positions before any
    draft."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    vllm = serve(ServerConfig(metrics_prefix="vllm"), num_gpu_blocks=64, speculative_config=spec)
    per_position = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    at_start = {
        dict(labels)["position"]: v for (n, labels), v in scrape(vllm).items() if n == per_position
    }
    assert at_start == {"0": 0, "1": 0, "2": 0}
    prompt = [(5 * i) % 40 + 3 for i in range(24)] * 2
    with vllm.client() as client:
        model = client.models.list().data[0].id
        reply = client.completions.create(
            model=model, prompt=prompt, max_tokens=48, extra_body=IGNORE_EOS
        )
    samples = scrape(vllm)
    drafts = value(samples, "vllm:spec_decode_num_drafts_total")
    draft_tokens = value(samples, "vllm:spec_decode_num_draft_tokens_total")
    accepted = value(samples, "vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < drafts <= draft_tokens and accepted <= draft_tokens
    assert value(samples, per_position) == accepted
    assert value(samples, "vllm:generation_tokens_total") == reply.usage.completion_tokens == 48


def test_serve_parses_metrics_prefix() -> None:
    parser = argparse.ArgumentParser()
    serve_command.add_arguments(parser)
    assert parser.parse_args(["--model", "m"]).metrics_prefix == "pagedkv"
    assert parser.parse_args(["--model", "m", "--metrics-prefix", "vllm"]).metrics_prefix == "vllm"


def test_per_request_histograms_add_up_to_the_requests_sent(
    client, model_name: str, server
) -> None:
    prompt = [(3 * i) % 200 + 5 for i in range(PROMPT_LEN)]
    before = scrape(server)
    client.completions.create(model=model_name, prompt=prompt, max_tokens=3, extra_body=IGNORE_EOS)
    after = scrape(server)

    def delta(name: str) -> float:
        return value(after, f"pagedkv:{name}") - value(before, f"pagedkv:{name}")

    assert delta("request_prompt_tokens_count") == 1
    assert delta("request_prompt_tokens_sum") == PROMPT_LEN
    assert delta("request_generation_tokens_sum") == 3
    # n samples: every sample's tokens count, as vLLM counts them.
    client.completions.create(
        model=model_name, prompt=prompt, max_tokens=4, n=3, extra_body=IGNORE_EOS
    )
    n_after = scrape(server)
    generated = value(n_after, "pagedkv:request_generation_tokens_sum")
    assert generated - value(after, "pagedkv:request_generation_tokens_sum") == 12
    # vLLM's request_max_num_generation_tokens: the longest sample's, 3 then 4.
    longest = "pagedkv:request_max_num_generation_tokens_sum"
    assert value(after, longest) - value(before, longest) == 3
    assert value(n_after, longest) - value(after, longest) == 4
    phases = ["request_queue_time_seconds", "request_prefill_time_seconds"]
    phases.append("request_decode_time_seconds")
    assert all(delta(f"{phase}_count") == 1 for phase in phases)
    # Queueing, prefill and decode split the end-to-end latency exactly.
    assert sum(delta(f"{phase}_sum") for phase in phases) == pytest.approx(
        delta("e2e_request_latency_seconds_sum")
    )


def test_cache_config_info_names_the_pool(server) -> None:
    info = [labels for name, labels in scrape(server) if name == "pagedkv:cache_config_info"]
    assert len(info) == 1
    labels = dict(info[0])
    assert (labels["block_size"], labels["num_gpu_blocks"]) == ("16", "256")
    assert int(labels["num_cpu_blocks"]) > 0
    assert labels["cache_dtype"] == "float32"
    assert labels["engine"] == "0"


def test_every_sample_names_its_model_and_engine_as_vllms_do(server, model_name: str) -> None:
    """vLLM labels each sample of its engines' metrics `model_name` and `engine` (the engine's
    index; one engine is "0"), and dashboards select by both: every sample of ours, requests
    finished and all."""
    scrape_around_completions(server, [[5, 6, 7]], max_tokens=2)
    samples = [dict(labels) for name, labels in scrape(server) if name.startswith("pagedkv:")]
    assert len(samples) > 100  # the histograms' buckets too
    for labels in samples:
        if "model_name" in labels:  # all but cache_config_info, as vLLM's
            assert labels["model_name"] == model_name, labels
        assert labels["engine"] == "0", labels


def test_an_fp8_cache_names_its_dtype_and_halves_its_block_bytes_twice(serve) -> None:
    """The tiny model's float32 block against its fp8 one: a quarter of the bytes."""
    sizes = {}
    for kv_cache_dtype in ("auto", "fp8"):
        server = serve(num_gpu_blocks=32, kv_cache_dtype=kv_cache_dtype)
        samples = scrape(server)
        [labels] = [dict(ls) for n, ls in samples if n == "pagedkv:cache_config_info"]
        sizes[labels["cache_dtype"]] = value(samples, "pagedkv:kv_cache_bytes_per_block")
    assert set(sizes) == {"float32", "fp8_e4m3"}
    assert sizes["fp8_e4m3"] * 4 == sizes["float32"] > 0


def test_iteration_tokens_add_up_to_prompt_and_sampled_tokens(serve) -> None:
    """Fresh prompts, no cache hits, no preemption: vLLM's iteration tokens are each step's
    prompt tokens plus the tokens it sampled, so every prompt token and every output token
    (the one sampled at the prefill step included) count once."""
    fresh = serve(num_gpu_blocks=128, enable_prefix_caching=False)
    prompts = [[(3 * i + 17 * j) % 200 + 3 for i in range(9 + 5 * j)] for j in range(3)]
    max_tokens = 7
    before, after = scrape_around_completions(fresh, prompts, max_tokens)
    name = "pagedkv:iteration_tokens_total"
    computed = value(after, f"{name}_sum") - value(before, f"{name}_sum")
    assert computed == sum(len(p) for p in prompts) + len(prompts) * max_tokens
    # One inter-token time per output token after a request's first.
    itl = "pagedkv:inter_token_latency_seconds_count"
    assert value(after, itl) - value(before, itl) == len(prompts) * (max_tokens - 1)


def test_time_per_output_token_is_per_token_and_its_request_mean_per_request(server) -> None:
    """vLLM V1 observes every inter-token latency into both inter_token_latency_seconds and
    (its older name) time_per_output_token_seconds; a request's mean time per output token
    goes once per finished request into request_time_per_output_token_seconds."""
    prompts = [[(11 * i + 5 * j) % 200 + 3 for i in range(6 + j)] for j in range(3)]
    max_tokens = 6
    before, after = scrape_around_completions(server, prompts, max_tokens)

    def delta(name: str) -> float:
        return value(after, name) - value(before, name)

    itl, tpot = "pagedkv:inter_token_latency_seconds", "pagedkv:time_per_output_token_seconds"
    assert delta(f"{itl}_count") == len(prompts) * (max_tokens - 1)
    assert delta(f"{tpot}_count") == delta(f"{itl}_count")
    assert delta(f"{tpot}_sum") == pytest.approx(delta(f"{itl}_sum"))
    assert delta("pagedkv:request_time_per_output_token_seconds_count") == len(prompts)


def test_offload_metrics_count_host_tier_blocks_queries_and_hits(serve) -> None:
    """Three prompts through a pool of 6 blocks: the later ones evict the first's blocks to
    the host tier, and repeating the first serves them back."""
    server = serve(num_gpu_blocks=6, kv_offloading_size=0.01, seed=0)
    with server.client() as client:
        name = client.models.list().data[0].id
        first = [5 + i % 50 for i in range(60)]
        others = [[7 + (i * k) % 40 for i in range(60)] for k in (1, 3)]
        for prompt in (first, *others, first):
            client.completions.create(model=name, prompt=prompt, max_tokens=1)
    samples = scrape(server)
    assert value(samples, "pagedkv:offload_blocks") >= 3
    hits = value(samples, "pagedkv:offload_hits_total")
    queries = value(samples, "pagedkv:offload_queries_total")
    assert 3 <= hits <= queries
    # The hits served the third prompt: it computed only what the tier did not hold.
    assert value(samples, "pagedkv:prefix_cache_hits_total") >= hits * 16


def test_stats_are_published_before_a_step_hands_its_outputs_over(server, monkeypatch) -> None:
    """A client that scrapes /metrics once its response came must see the step that finished
    it: when the engine thread hands a finished request over, the stats /metrics reads
    already equal the engine's own, with the request counted out."""
    from pagedkv.server import engine_loop as engine_loop_module

    loop = server.app.state.engine_loop
    handed_over: list[tuple[int, int, int]] = []
    call_soon = engine_loop_module._call_soon

    def recording(target: Any, callback: Any, *args: Any) -> None:
        finished = callback is engine_loop_module._deliver and any(
            getattr(output, "finished", False) for _, output in args[0]
        )
        if finished:
            published, own = loop.stats, loop.engine.stats
            handed_over.append(
                (
                    published.num_running,
                    published.generation_tokens_total,
                    own.generation_tokens_total,
                )
            )
        call_soon(target, callback, *args)

    monkeypatch.setattr(engine_loop_module, "_call_soon", recording)
    with server.client() as client:
        client.completions.create(
            model=client.models.list().data[0].id,
            prompt="Hello",
            max_tokens=3,
            extra_body=IGNORE_EOS,
        )
    [(running, published_tokens, engine_tokens)] = handed_over
    assert running == 0 and published_tokens == engine_tokens
    assert value(scrape(server), "pagedkv:num_requests_running") == 0
