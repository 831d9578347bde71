"""When the engine fails, requests get errors instead of hanging, and health says so.

The tests share the module's server, except the one that kills its engine thread for good.
"""

from __future__ import annotations

import pytest

from pagedkv.engine.errors import StepFailed
from tests.server.conftest import RunningServer, all_blocks_free, fail_next_step, wait_until

BODY = {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(serve) -> RunningServer:
    return serve(num_gpu_blocks=128)


def test_a_failed_step_fails_its_requests_and_the_next_ones_run(server: RunningServer) -> None:
    fail_next_step(server, "simulated kernel fault")
    with server.http() as http:
        failed = http.post("/v1/completions", json=BODY)
        assert failed.status_code == 500
        assert "simulated kernel fault" in failed.json()["error"]["message"]
        streamed = http.post("/v1/completions", json=BODY | {"stream": True})
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        assert http.post("/v1/completions", json=BODY).json()["usage"]["completion_tokens"] == 4
        assert http.get("/health").status_code == 200
    wait_until(lambda: all_blocks_free(server))


def test_a_step_failure_fails_only_the_requests_it_names(server: RunningServer) -> None:
    engine = server.app.state.engine_loop.engine
    real_step = engine.step
    steps = 0

    def step_failing_for_someone_else():
        nonlocal steps
        steps += 1
        if steps == 3:  # mid-stream, a step fails for another request only
            raise StepFailed(["another-client"], RuntimeError("simulated fault"))
        return real_step()

    engine.step = step_failing_for_someone_else
    try:
        with server.http() as http:
            body = BODY | {"max_tokens": 12, "stream": True}
            streamed = http.post("/v1/completions", json=body)
    finally:
        engine.step = real_step
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    assert "error" not in streamed.text and steps > 3
    wait_until(lambda: all_blocks_free(server))


def test_a_failure_of_one_prompt_stops_the_others_of_its_response(serve) -> None:
    """A step fails one prompt of a two-prompt completion: the response is a 500, and the
    other prompt's request is aborted, not left running to max_tokens for nobody."""
    server = serve(num_gpu_blocks=128, max_num_seqs=1)  # the second prompt waits its turn
    engine = server.app.state.engine_loop.engine
    real_step = engine.step
    failed: list[str] = []

    def step_failing_the_first_prompt():
        first = [request_id for request_id in engine._requests if request_id.endswith("-0")]
        if not failed and first and len(engine._requests) == 2:
            failed.extend(first)
            engine.abort(first[0])  # as the engine does with a failed step's requests
            raise StepFailed(first, RuntimeError("simulated fault"))
        return real_step()

    engine.step = step_failing_the_first_prompt
    body = {"prompt": ["Paged attention", "Hello world"], "max_tokens": 400, "ignore_eos": True}
    with server.http() as http:
        response = http.post("/v1/completions", json=body)
    assert failed and response.status_code == 500
    wait_until(lambda: not engine.has_unfinished() and all_blocks_free(server))
    assert engine.stats.generation_tokens_total < 400  # the second prompt did not run on


def test_a_dead_engine_thread_turns_health_and_requests_into_503(serve) -> None:
    server = serve(num_gpu_blocks=128)  # its own: this test leaves its server unable to serve
    engine_loop = server.app.state.engine_loop

    def broken() -> bool:
        raise RuntimeError("simulated scheduler bug")

    engine_loop.engine.has_unfinished = broken
    with server.http() as http:
        first = http.post("/v1/completions", json=BODY)  # wakes the thread, which dies
        assert first.status_code in (500, 503)
        wait_until(lambda: http.get("/health").status_code == 503)
        assert "simulated scheduler bug" in http.get("/health").json()["error"]["message"]
        refused = http.post("/v1/completions", json=BODY)
        assert refused.status_code == 503
        assert "engine thread failed" in refused.json()["error"]["message"]
