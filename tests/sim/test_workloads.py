"""Workloads: the stated length statistics, sharing options, arrivals and traces."""

import json
import re

import numpy as np
import pytest

from pagedkv.sim.workloads import (
    WORKLOADS,
    WorkloadError,
    generate_requests,
    load_trace,
    workload,
)


def _means(name, count=20_000):
    requests = generate_requests(WORKLOADS[name], count, seed=1)
    prompts = np.array([request.prompt_len for request in requests])
    outputs = np.array([request.output_len for request in requests])
    return prompts.mean(), outputs.mean()


def test_tutorial_outputs_are_normal_500_200_clipped_to_200_2048():
    requests = generate_requests(WORKLOADS["tutorial"], 20_000, seed=1)
    outputs = np.array([request.output_len for request in requests])
    assert outputs.min() == 200
    assert outputs.max() <= 2047  # a 1-token prompt leaves 2,047 of the 2,048 context
    # Clipping 6.7% of draws up to 200 lifts the mean by ~6 tokens; the spread stays ~190.
    assert 500 < outputs.mean() < 512
    assert 180 < outputs.std() < 200
    assert all(request.prompt_len == 1 and request.max_tokens == 2047 for request in requests)


@pytest.mark.parametrize(
    ("name", "prompt", "output"),
    [("sharegpt", 161, 338), ("alpaca", 19, 58), ("docs", 12_500, 500), ("chat", 1000, 500)],
)
def test_workload_means_match_their_description(name, prompt, output):
    prompt_mean, output_mean = _means(name)
    assert prompt_mean == pytest.approx(prompt, rel=0.03)
    assert output_mean == pytest.approx(output, rel=0.03)


def test_chat_is_about_1500_tokens_and_docs_about_13000():
    assert sum(_means("chat")) == pytest.approx(1500, rel=0.03)
    assert sum(_means("docs")) == pytest.approx(13_000, rel=0.03)


def test_sharegpt_is_long_tailed():
    requests = generate_requests(WORKLOADS["sharegpt"], 20_000, seed=1)
    outputs = np.array([request.output_len for request in requests])
    assert np.median(outputs) < 0.8 * outputs.mean()
    assert np.percentile(outputs, 99) > 4 * np.median(outputs)


def test_every_request_fits_its_context_and_max_tokens():
    for mix in WORKLOADS.values():
        for request in generate_requests(mix, 2000, seed=3):
            assert request.total_len <= mix.max_model_len
            assert request.output_len <= request.max_tokens
            assert request.prompt_len + request.max_tokens <= mix.max_model_len


def test_system_prompt_is_prepended_to_the_shared_fraction():
    requests = generate_requests(
        WORKLOADS["alpaca"], 4000, seed=2, system_prompt=200, shared_fraction=0.25
    )
    shared = [request for request in requests if request.prefix_id is not None]
    assert len(shared) / len(requests) == pytest.approx(0.25, abs=0.03)
    assert all(request.prefix_len == 200 and request.prompt_len > 200 for request in shared)
    plain = generate_requests(WORKLOADS["alpaca"], 4000, seed=2)
    assert all(request.prefix_id is None for request in plain)


def test_parallel_sampling_sets_n():
    assert {r.n for r in generate_requests(WORKLOADS["alpaca"], 10, n=4)} == {4}


def test_arrivals_are_all_at_once_or_poisson_at_the_rate():
    assert {r.arrival_step for r in generate_requests(WORKLOADS["alpaca"], 50)} == {0}
    requests = generate_requests(WORKLOADS["alpaca"], 5000, seed=4, rate=2.0)
    arrivals = [request.arrival_step for request in requests]
    assert arrivals == sorted(arrivals)
    assert len(requests) / (arrivals[-1] + 1) == pytest.approx(2.0, rel=0.05)


def test_same_seed_same_requests():
    mix = WORKLOADS["sharegpt"]
    assert generate_requests(mix, 100, seed=7) == generate_requests(mix, 100, seed=7)
    assert generate_requests(mix, 100, seed=7) != generate_requests(mix, 100, seed=8)


def test_bad_workload_options_are_errors():
    with pytest.raises(WorkloadError, match="unknown workload 'nope'"):
        workload("nope")
    with pytest.raises(WorkloadError, match="shared fraction"):
        generate_requests(WORKLOADS["chat"], 10, system_prompt=10, shared_fraction=2)
    with pytest.raises(WorkloadError, match="no room for output"):
        generate_requests(WORKLOADS["tutorial"], 10, system_prompt=2047)
    with pytest.raises(WorkloadError, match="arrival rate"):
        generate_requests(WORKLOADS["chat"], 10, rate=-1)


def test_trace_lines_become_requests(tmp_path):
    path = tmp_path / "trace.jsonl"
    lines = [
        {"prompt_len": 100, "output_len": 50},
        {"prompt_len": 300, "output_len": 20, "prefix_id": "sys", "prefix_len": 200, "n": 3},
        {"prompt_len": 10, "output_len": 5, "max_tokens": 64},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    requests = load_trace(path, max_model_len=1024)
    assert [request.req_id for request in requests] == [0, 1, 2]
    assert requests[0].max_tokens == 924  # all the context leaves
    assert (requests[1].prefix_id, requests[1].prefix_len, requests[1].n) == ("sys", 200, 3)
    assert requests[2].max_tokens == 64


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 2: not valid JSON"),
        ('{"prompt_len": 5}', "line 2: missing output_len"),
        ('{"prompt_len": -5, "output_len": 3}', "line 2: prompt_len must be an integer >= 1"),
        ('{"prompt_len": 900, "output_len": 300}', "line 2: prompt_len + output_len = 1200"),
        ('{"prompt_len": 5, "output_len": 3, "prefix_id": "a"}', "line 2: missing prefix_len"),
        ('{"prompt_len": 5, "output_len": 3, "prefix_id": 1, "prefix_len": 9}', "exceeds"),
        ('{"prompt_len": 5, "output_len": 3, "max_tokens": 2}', "max_tokens must be"),
    ],
)
def test_bad_trace_lines_are_named(tmp_path, line, message):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"prompt_len": 1, "output_len": 1}\n' + line + "\n")
    with pytest.raises(WorkloadError, match=re.escape(message)):
        load_trace(path, max_model_len=1024)


def test_missing_or_empty_trace_is_an_error(tmp_path):
    with pytest.raises(WorkloadError, match="cannot read trace"):
        load_trace(tmp_path / "absent.jsonl", 1024)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(WorkloadError, match="no requests"):
        load_trace(tmp_path / "empty.jsonl", 1024)
