"""The OpenAI API as the official `openai` client sees it, against one tiny-model server."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.engine import LLM, SamplingParams
from tests.model.tiny_models import random_prompt
from tests.server.conftest import RunningServer, all_blocks_free, wait_until

NUM_GPU_BLOCKS = 512
PROMPT = "Paged attention stores keys and values in fixed-size blocks."
LONG_PROMPT = " ".join(
    [
        "A block table maps each sequence's logical blocks to physical ones.",
        "Copy on write lets forked sequences share a prompt until they diverge.",
        "Swapping moves blocks to host memory when the device runs out.",
    ]
)
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(serve) -> RunningServer:
    return serve(num_gpu_blocks=NUM_GPU_BLOCKS, seed=0)


def test_models_lists_the_served_model(client, tiny_model: Path) -> None:
    models = client.models.list().data
    assert [model.id for model in models] == [str(tiny_model)]


def test_health(server: RunningServer) -> None:
    with server.http() as http:
        assert http.get("/health").status_code == 200


def test_completion_returns_the_requested_tokens_and_usage(client, model_name: str) -> None:
    completion = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=7, extra_body=IGNORE_EOS
    )
    assert completion.object == "text_completion"
    assert completion.id.startswith("cmpl-")
    [choice] = completion.choices
    assert choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 7
    assert completion.usage.prompt_tokens > 0
    total = completion.usage.prompt_tokens + completion.usage.completion_tokens
    assert completion.usage.total_tokens == total


def test_greedy_completion_equals_llm_generate(client, model_name: str, tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), num_gpu_blocks=64)
    token_prompt = random_prompt(20, seed=3)
    expected = llm.generate(
        [PROMPT, token_prompt], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False
    )
    for prompt, reference in zip([PROMPT, token_prompt], expected, strict=True):
        completion = client.completions.create(
            model=model_name, prompt=prompt, max_tokens=24, temperature=0.0
        )
        assert completion.choices[0].text == reference.outputs[0].text
        assert completion.usage.completion_tokens == len(reference.outputs[0].token_ids)


def test_chat_completion_uses_the_chat_template(client, model_name: str, tiny_model: Path) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello world!"},
    ]
    chat = client.chat.completions.create(
        model=model_name, messages=messages, max_completion_tokens=12, temperature=0.0
    )
    assert chat.object == "chat.completion"
    [choice] = chat.choices
    assert choice.message.role == "assistant"
    reference = LLM(str(tiny_model), num_gpu_blocks=64).chat(
        messages, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False
    )[0]
    assert choice.message.content == reference.outputs[0].text
    assert chat.usage.prompt_tokens == len(reference.prompt_token_ids)


def test_streamed_completion_matches_the_whole_one(client, model_name: str) -> None:
    whole = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=20, temperature=0.0, extra_body=IGNORE_EOS
    )
    stream = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=20,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=IGNORE_EOS,
    )
    chunks = list(stream)
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == whole.choices[0].text
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]
    assert chunks[-1].choices == []  # the usage chunk comes last
    assert chunks[-1].usage.completion_tokens == 20


def test_streamed_chat_starts_with_the_role_and_ends_with_usage(client, model_name: str) -> None:
    stream = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=IGNORE_EOS,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 10
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)


def test_n_2_gives_two_choices_whole_and_streamed(client, model_name: str) -> None:
    completion = client.completions.create(
        model=model_name, prompt=PROMPT, n=2, max_tokens=12, seed=5, extra_body=IGNORE_EOS
    )
    assert sorted(choice.index for choice in completion.choices) == [0, 1]
    assert completion.choices[0].text != completion.choices[1].text
    assert completion.usage.completion_tokens == 24
    stream = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Hi"}],
        n=2,
        max_tokens=6,
        stream=True,
        extra_body=IGNORE_EOS,
    )
    finished = {c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_batched_prompts_give_a_choice_per_prompt(client, model_name: str) -> None:
    completion = client.completions.create(
        model=model_name, prompt=[PROMPT, "Hello world!"], max_tokens=3, extra_body=IGNORE_EOS
    )
    assert sorted(choice.index for choice in completion.choices) == [0, 1]
    assert completion.usage.completion_tokens == 6


def test_stop_string_ends_the_text_before_it(client, model_name: str) -> None:
    free = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=30, temperature=0.0, extra_body=IGNORE_EOS
    ).choices[0]
    middle = len(free.text) // 2
    stop = free.text[middle : middle + 2]
    stopped = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=30, temperature=0.0, stop=[stop],
        extra_body=IGNORE_EOS,
    ).choices[0]  # fmt: skip
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(stop)]


def test_seed_makes_sampling_repeatable(client, model_name: str) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(
            model=model_name, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed,
            extra_body=IGNORE_EOS,
        ).choices[0].text  # fmt: skip

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_repeated_prompt_reports_cached_prompt_tokens(client, model_name: str) -> None:
    prompt = random_prompt(70, seed=11)  # four full 16-token blocks
    first = client.completions.create(model=model_name, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=model_name, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 64
    assert second.usage.prompt_tokens == 70


def test_cache_salt_shares_prompt_blocks_only_under_the_same_salt(client, model_name) -> None:
    """vLLM's `cache_salt`, on both endpoints; an empty one is a 400."""
    prompt = random_prompt(70, seed=17)

    def cached(salt: str) -> int:
        completion = client.completions.create(
            model=model_name, prompt=prompt, max_tokens=2, extra_body={"cache_salt": salt}
        )
        return completion.usage.prompt_tokens_details.cached_tokens

    assert [cached("a"), cached("b"), cached("a")] == [0, 0, 64]
    messages = [{"role": "user", "content": "A question worth caching, " * 12}]
    chats = [
        client.chat.completions.create(
            model=model_name, messages=messages, max_tokens=2, extra_body={"cache_salt": salt}
        ).usage.prompt_tokens_details.cached_tokens
        for salt in ("c", "d", "c")
    ]
    assert chats[0] == chats[1] == 0 and chats[2] > 0
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.completions.create(
            model=model_name, prompt="hi", max_tokens=2, extra_body={"cache_salt": ""}
        )


def test_completion_logprobs(client, model_name: str) -> None:
    completion = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=5, temperature=0.0, logprobs=3,
        extra_body=IGNORE_EOS,
    )  # fmt: skip
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert all(isinstance(token, str) for token in logprobs.tokens)
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3  # keyed by text: tokens that decode alike collapse
        assert chosen <= 0.0
        assert chosen == pytest.approx(max(top.values()))  # greedy takes the top token
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_chat_logprobs(client, model_name: str) -> None:
    chat = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        extra_body=IGNORE_EOS,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    # The token's own bytes: a token holding part of a character shows as U+FFFD.
    assert all(
        entry.logprob <= 0.0 and bytes(entry.bytes).decode(errors="replace") == entry.token
        for entry in content
    )


def generated_tokens(server: RunningServer) -> float:
    """The server's count of every token it has generated (its Prometheus counter)."""
    with server.http() as http:
        text = http.get("/metrics").text
    return next(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "pagedkv:generation_tokens_total"
    )


def test_aborted_stream_frees_its_blocks_without_finishing(
    client, model_name: str, server: RunningServer
) -> None:
    before = generated_tokens(server)
    stream = client.completions.create(
        model=model_name, prompt=LONG_PROMPT, max_tokens=900, stream=True, extra_body=IGNORE_EOS
    )
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    assert not all_blocks_free(server)
    stream.close()
    wait_until(lambda: all_blocks_free(server))
    generated = generated_tokens(server) - before
    assert generated < 900, "the stream ran to its end instead of being aborted"


def test_abandoned_request_is_aborted_when_its_client_hangs_up(
    model_name: str, server: RunningServer
) -> None:
    body = json.dumps(
        {"model": model_name, "prompt": LONG_PROMPT, "max_tokens": 900, "ignore_eos": True}
    ).encode()
    url = urlsplit(server.url)
    before = generated_tokens(server)
    with socket.create_connection((url.hostname, url.port)) as connection:  # not streamed
        connection.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (url.netloc.encode(), len(body), body)
        )
        wait_until(lambda: not all_blocks_free(server))  # it runs
    # The connection closed above while the request ran: the server must notice and abort.
    wait_until(lambda: all_blocks_free(server))
    generated = generated_tokens(server) - before
    assert generated < 900, "the request ran to its end after its client hung up"


def test_metrics_report_engine_figures_and_latencies(client, server: RunningServer) -> None:
    client.completions.create(
        model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=3, extra_body=IGNORE_EOS
    )
    with server.http() as http:
        response = http.get("/metrics")
    assert response.status_code == 200
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }
    names = {name for name, _ in samples}
    for expected in [
        "pagedkv:num_requests_running",
        "pagedkv:num_requests_waiting",
        "pagedkv:num_requests_swapped",
        "pagedkv:kv_cache_usage_perc",
        "pagedkv:kv_cache_utilisation_perc",
        "pagedkv:prefix_cache_queries_total",
        "pagedkv:prefix_cache_hits_total",
        "pagedkv:num_preemptions_total",
        "pagedkv:time_to_first_token_seconds_bucket",
        "pagedkv:time_per_output_token_seconds_bucket",
        "pagedkv:e2e_request_latency_seconds_bucket",
    ]:
        assert expected in names, expected

    def value(name: str, **labels: str) -> float:
        return sum(
            v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()
        )

    assert value("pagedkv:prompt_tokens_total") > 0
    assert value("pagedkv:generation_tokens_total") >= 3
    assert value("pagedkv:e2e_request_latency_seconds_count") >= 1
    assert value("pagedkv:request_success_total", finished_reason="length") >= 1
    assert {dict(ls).get("kind") for n, ls in samples if n == "pagedkv:num_preemptions_total"} == {
        "swap",
        "recompute",
    }


def test_kv_snapshot_lists_every_block(server: RunningServer) -> None:
    with server.http() as http:
        snapshot = http.get("/v1/kv").json()
    assert snapshot["num_gpu_blocks"] == len(snapshot["gpu"]) == NUM_GPU_BLOCKS
    assert snapshot["stats"]["num_gpu_blocks"] == NUM_GPU_BLOCKS
    assert {"block_id", "ref_count", "cached", "holders"} <= set(snapshot["gpu"][0])
