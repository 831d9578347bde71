"""The `priority` extra field: lower runs first under `--scheduling-policy priority`, and a
server scheduling first come, first served refuses it with a 400 naming the value."""

from __future__ import annotations

import re
import threading

import pytest

from tests.server.conftest import HANG_GUARD_S, RunningServer, all_blocks_free, wait_until

LONG = {"max_tokens": 1000, "stream": True, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def priority_server(serve) -> RunningServer:
    # One sequence at a time: whoever is admitted next is the scheduler's choice alone.
    return serve(num_gpu_blocks=256, max_num_seqs=1, scheduling_policy="priority")


@pytest.fixture(scope="module")
def fcfs_server(serve) -> RunningServer:
    return serve(num_gpu_blocks=64)


def num_waiting(server: RunningServer) -> int:
    with server.http() as http:
        text = http.get("/metrics").text
    return int(float(re.search(r"^pagedkv:num_requests_waiting\{.*\} (\S+)$", text, re.M)[1]))


def test_the_waiting_request_with_the_lowest_priority_value_runs_first(
    priority_server: RunningServer,
) -> None:
    # Three requests wait behind a running one, arriving in an order unlike their priorities.
    # Each streams: its first chunk comes only once it is admitted, and the next one can be
    # admitted only after it is closed, so `admitted` is the scheduler's order exactly.
    # (/v1/chat/completions forwards `priority` the same way: see the fcfs test below.)
    admitted: list[int] = []
    closing = {priority: threading.Event() for priority in (5, 0, 3)}

    def ask(client, model: str, priority: int) -> None:
        stream = client.completions.create(
            model=model,
            prompt="Hi",
            max_tokens=500,
            stream=True,
            extra_body={"ignore_eos": True, "priority": priority},
        )
        next(iter(stream))
        admitted.append(priority)
        closing[priority].wait(timeout=HANG_GUARD_S)
        stream.close()

    with priority_server.client() as client:
        model = client.models.list().data[0].id
        blocker = client.completions.create(model=model, prompt="Hello", **LONG)
        next(iter(blocker))  # running: everyone else waits behind it
        threads = []
        for queued, priority in enumerate(closing, 1):
            thread = threading.Thread(target=ask, args=(client, model, priority))
            thread.start()
            threads.append(thread)
            wait_until(lambda n=queued: num_waiting(priority_server) == n)
        blocker.close()
        for count in (1, 2, 3):
            wait_until(lambda n=count: len(admitted) == n)
            closing[admitted[-1]].set()
        for thread in threads:
            thread.join(timeout=HANG_GUARD_S)
    assert admitted == [0, 3, 5]
    wait_until(lambda: all_blocks_free(priority_server))


def test_priority_under_fcfs_is_a_400_naming_the_value_and_the_policy(
    fcfs_server: RunningServer,
) -> None:
    with fcfs_server.http() as http:
        for path, body in (
            ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "priority": 2}),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "priority": 2},
            ),
        ):
            response = http.post(path, json=body)
            assert response.status_code == 400, path
            message = response.json()["error"]["message"]
            assert "priority is 2, but scheduling_policy is 'fcfs'" in message
        # Priority 0 is the default and means nothing else under fcfs: accepted.
        response = http.post(
            "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "priority": 0}
        )
        assert response.status_code == 200
    wait_until(lambda: all_blocks_free(fcfs_server))


def test_a_priority_that_is_not_an_integer_is_a_400(priority_server: RunningServer) -> None:
    with priority_server.http() as http:
        response = http.post("/v1/completions", json={"prompt": "Hi", "priority": "high"})
    assert response.status_code == 400
    assert "priority" in response.json()["error"]["message"]
