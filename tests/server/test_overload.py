"""Over `--max-waiting`, new requests get 503 with Retry-After; the queued ones are unaffected."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedkv.server import ServerConfig
from tests.server.conftest import RunningServer, all_blocks_free, slow_down, wait_until

LONG = {"max_tokens": 1000, "stream": True, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(serve) -> RunningServer:
    # One sequence runs at a time, one may wait: the third concurrent request is one too many.
    return serve(ServerConfig(max_waiting=1), num_gpu_blocks=256, max_num_seqs=1)


def test_request_over_max_waiting_gets_503_with_retry_after(server: RunningServer) -> None:
    with server.client() as client:
        model = client.models.list().data[0].id
        running = client.completions.create(model=model, prompt="Hello", **LONG)
        next(iter(running))  # scheduled and generating
        waiting = client.completions.create(model=model, prompt="Hello", **LONG)
        with server.http() as http:
            response = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert response.status_code == 503
        assert int(response.headers["Retry-After"]) >= 1
        error = response.json()["error"]
        assert "max-waiting" in error["message"] and error["code"] == "overloaded"
        running.close()
        next(iter(waiting))  # the waiting request gets the freed slot and runs
        waiting.close()
    wait_until(lambda: all_blocks_free(server))
    with server.client() as client:
        completion = client.completions.create(model=model, prompt="Hi", max_tokens=2)
    assert completion.usage.completion_tokens >= 1


def test_a_burst_on_an_idle_server_fills_the_batch_before_anything_waits(serve) -> None:
    """Four seats and room for two to wait: six requests arriving together are all admitted,
    however their arrivals and the steps interleave (requests running take seats, and only
    those beyond the free seats wait); counting every request not yet stepped as waiting
    refused from the third on."""
    server = serve(ServerConfig(max_waiting=2), num_gpu_blocks=256, max_num_seqs=4)
    body = {"prompt": "Hello", "max_tokens": 8, "ignore_eos": True}

    def post(_: int) -> int:
        with server.http() as http:
            return http.post("/v1/completions", json=body).status_code

    with ThreadPoolExecutor(max_workers=6) as pool:
        assert list(pool.map(post, range(6))) == [200] * 6
    wait_until(lambda: all_blocks_free(server))


def test_a_waiting_request_takes_as_many_seats_as_its_samples(serve) -> None:
    """Four seats, room for one to wait, requests of n = 4: the first takes the batch, the
    second waits, and the others are refused, however arrivals and steps interleave (they
    were admitted while each counted as one seat)."""
    server = serve(ServerConfig(max_waiting=1), num_gpu_blocks=256, max_num_seqs=4)
    slow_down(server, 0.2)  # the first runs for over a second: all five arrive meanwhile
    body = {"prompt": "Hello", "max_tokens": 6, "ignore_eos": True, "n": 4}

    def post(_: int) -> int:
        with server.http() as http:
            return http.post("/v1/completions", json=body).status_code

    with ThreadPoolExecutor(max_workers=5) as pool:
        codes = sorted(pool.map(post, range(5)))
    assert codes == [200, 200, 503, 503, 503]
    wait_until(lambda: all_blocks_free(server))


def test_a_bad_request_gets_its_400_while_the_queue_is_full(server: RunningServer) -> None:
    """The queue cap is asked only of a request with nothing wrong in itself: a token id
    outside the vocabulary, a prompt past the context or too many logprobs get their 400
    (which clients do not retry) while a good request gets the 503."""
    engine = server.app.state.engine_loop.engine  # read only what is fixed at start
    vocab, context = engine.config.vocab_size, engine.max_model_len
    bad = [
        ({"prompt": [vocab], "max_tokens": 1}, "vocabulary"),
        ({"prompt": [1] * (context + 1), "max_tokens": 1}, str(context)),
        ({"prompt": "Hi", "max_tokens": 1, "logprobs": 1000}, "logprobs"),
    ]
    with server.client() as client:
        model = client.models.list().data[0].id
        running = client.completions.create(model=model, prompt="Hello", **LONG)
        next(iter(running))
        waiting = client.completions.create(model=model, prompt="Hello", **LONG)
        with server.http() as http:
            for body, named in bad:
                response = http.post("/v1/completions", json=body)
                assert response.status_code == 400, (body, response.text)
                assert named in response.json()["error"]["message"]
            good = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
            assert good.status_code == 503
        running.close()
        next(iter(waiting))
        waiting.close()
    wait_until(lambda: all_blocks_free(server))
