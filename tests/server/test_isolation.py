"""Two clients in one engine step: neither one's parameters nor its failure reach the other.

The engine thread is held back until both requests are queued, so they are admitted together
and share every step; the oracle is the first client's answer when it runs alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from tests.server.conftest import RunningServer, all_blocks_free, wait_until

NORMAL = {"prompt": "Hello", "max_tokens": 8, "ignore_eos": True, "top_k": 40, "seed": 3}
MAX_MODEL_LEN = 256
REQUEST_ID = re.compile(r"cmpl-[0-9a-f]{32}")


@pytest.fixture(scope="module")
def server(serve) -> RunningServer:
    return serve(num_gpu_blocks=128, max_model_len=MAX_MODEL_LEN)


@contextmanager
def in_one_step(server: RunningServer, num_requests: int) -> Iterator[None]:
    """Hold the engine thread until `num_requests` requests wait, so one step admits them all."""
    engine = server.app.state.engine_loop.engine
    real = engine.has_unfinished
    released = False

    def gated() -> bool:
        nonlocal released
        released = released or len(engine.scheduler.waiting) >= num_requests
        return released and real()

    engine.has_unfinished = gated
    try:
        yield
    finally:
        engine.has_unfinished = real


def post_all(server: RunningServer, bodies: list[dict]) -> list:
    def post(body: dict):
        with server.http() as http:
            return http.post("/v1/completions", json=body)

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(post, bodies))


def test_a_top_k_above_the_vocabulary_fails_nobody(server: RunningServer) -> None:
    [alone] = post_all(server, [NORMAL])
    assert alone.status_code == 200, alone.text
    with in_one_step(server, 2):
        normal, extreme = post_all(server, [NORMAL, NORMAL | {"top_k": 100_000, "seed": 4}])
    assert normal.status_code == 200, normal.text
    assert extreme.status_code == 200, extreme.text
    assert normal.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    assert extreme.json()["usage"]["completion_tokens"] == 8
    wait_until(lambda: all_blocks_free(server))


def test_a_failed_step_tells_each_client_only_its_own_request(server: RunningServer) -> None:
    runner = server.app.state.engine_loop.engine.runner
    real_execute = runner.execute

    def fail_once(output):
        runner.execute = real_execute
        raise RuntimeError("simulated kernel fault")

    runner.execute = fail_once
    try:
        with in_one_step(server, 2):
            responses = post_all(server, [NORMAL, NORMAL])
    finally:
        runner.execute = real_execute
    messages = [response.json()["error"]["message"] for response in responses]
    assert [response.status_code for response in responses] == [500, 500]
    assert all("simulated kernel fault" in message for message in messages)
    named = [REQUEST_ID.findall(message) for message in messages]
    assert [len(ids) for ids in named] == [1, 1], messages
    assert named[0] != named[1]
    wait_until(lambda: all_blocks_free(server))


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 5000}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5000},
        ),
    ],
)
def test_an_explicit_max_tokens_beyond_the_context_is_refused_for_its_client(
    server: RunningServer, path: str, body: dict
) -> None:
    """vLLM's server answers 400 here (its engine alone would stop at the limit)."""
    with server.http() as http:
        refused = http.post(path, json=body)
    [served] = post_all(server, [NORMAL])
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert (
        "max_tokens is 5000" in error["message"]
        and f"model allows {MAX_MODEL_LEN}" in error["message"]
    )
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 8
