"""A graceful end: running requests finish, new ones are told 503, late ones end cleanly.

Each test stops its own server. The engine is slowed down (a sleep per step) so that requests
are still running when the server is told to stop, whatever the machine's speed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx2
import pytest

from pagedkv.server import ServerConfig
from tests.server.conftest import (
    HANG_GUARD_S,
    RunningServer,
    answers_health,
    free_port,
    slow_down,
    wait_until,
)

STEP_S = 0.03
BODY = {"prompt": "Hello", "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "ignore_eos": True}


def test_running_requests_finish_while_new_ones_get_503(serve) -> None:
    server = serve(ServerConfig(shutdown_timeout=HANG_GUARD_S), num_gpu_blocks=64)
    slow_down(server, STEP_S)
    stream = Call(server, "/v1/completions", BODY | {"max_tokens": 60, "stream": True})
    whole = Call(server, "/v1/chat/completions", CHAT | {"max_tokens": 60})
    viewer = Call(server, "/v1/kv/stream", method="GET")
    wait_until(lambda: server.app.state.engine_loop.stats.num_running == 2)

    stopping = threading.Thread(target=server.stop)
    stopping.start()
    with server.http() as http:
        wait_until(lambda: http.get("/health").status_code == 503)
        refused = http.post("/v1/completions", json=BODY | {"max_tokens": 2})
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "shutting_down"
    assert refused.json()["error"]["type"] == "server_error"
    viewer.join()  # the page map's stream ends at once

    events = stream.join().events()
    assert events[-1] == "[DONE]" and '"error"' not in stream.response.text
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    answer = whole.join().response
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 60
    stopping.join(timeout=HANG_GUARD_S)
    assert not server.thread.is_alive()


def test_requests_still_running_after_the_grace_period_end_with_an_error(serve) -> None:
    server = serve(ServerConfig(shutdown_timeout=0.5), num_gpu_blocks=64)
    slow_down(server, STEP_S)
    stream = Call(server, "/v1/chat/completions", CHAT | {"max_tokens": 500, "stream": True})
    whole = Call(server, "/v1/completions", BODY | {"max_tokens": 500})
    wait_until(lambda: server.app.state.engine_loop.stats.num_running == 2)
    metrics = server.app.state.engine_loop.metrics
    aborts = {"model_name": metrics.model_name, "engine": "0", "finished_reason": "abort"}
    before = metrics.registry.get_sample_value("pagedkv:request_success_total", aborts) or 0

    server.stop()
    assert not server.thread.is_alive()
    # Requests the server ended itself count as aborted, as vLLM counts them.
    assert metrics.registry.get_sample_value("pagedkv:request_success_total", aborts) == before + 2
    events = stream.join().events()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "shutting_down" and "--shutdown-timeout" in error["message"]
    answer = whole.join().response
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "shutting_down"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_drains_pagedkv_serve_which_exits_0(tiny_model: Path, sig: int) -> None:
    """The signal path end to end; with no grace, the running stream is ended at once (the
    grace period itself is tested above, where the engine can be slowed down)."""
    port = free_port()
    command = [sys.executable, "-m", "pagedkv.cli", "serve", "--model", str(tiny_model)]
    command += ["--port", str(port), "--num-gpu-blocks", "128", "--swap-space-gb", "0.01"]
    command += ["--shutdown-timeout", "0"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: answers_health(url, server))
        body = BODY | {"max_tokens": 900, "stream": True}
        with httpx2.stream(
            "POST", f"{url}/v1/completions", json=body, timeout=HANG_GUARD_S
        ) as stream:
            lines = (line for line in stream.iter_lines() if line.startswith("data: "))
            next(lines)  # generating: 899 tokens to go
            server.send_signal(sig)
            events = [line.removeprefix("data: ") for line in lines]
        output = server.communicate(timeout=HANG_GUARD_S)[0].decode()
    finally:
        if server.poll() is None:
            server.kill()
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "shutting_down"
    assert server.returncode == 0, output
    assert "ending the requests still running" in output


@pytest.mark.slow
def test_a_second_ctrl_c_ends_the_drain_and_the_server_still_stops_cleanly(
    tiny_model: Path,
) -> None:
    """Ctrl-C drains for --shutdown-timeout; a second one ends the running requests now, and
    the stop after it is the normal one: the app's lifespan shutdown runs (skipping it left
    the lifespan task to be cancelled at exit, which logged a CancelledError traceback)."""
    port = free_port()
    command = [sys.executable, "-m", "pagedkv.cli", "serve", "--model", str(tiny_model)]
    command += ["--port", str(port), "--num-gpu-blocks", "128", "--swap-space-gb", "0.01"]
    command += ["--shutdown-timeout", str(HANG_GUARD_S)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(server.stdout), daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: answers_health(url, server))
        body = BODY | {"max_tokens": 900, "stream": True, "ignore_eos": True}
        with httpx2.stream(
            "POST", f"{url}/v1/completions", json=body, timeout=HANG_GUARD_S
        ) as stream:
            events = (line for line in stream.iter_lines() if line.startswith("data: "))
            next(events)
            server.send_signal(signal.SIGINT)
            wait_until(lambda: any("refusing new requests" in line for line in lines))
            server.send_signal(signal.SIGINT)
            last = [line.removeprefix("data: ") for line in events]
        server.wait(timeout=HANG_GUARD_S)
        reader.join(HANG_GUARD_S)
    finally:
        if server.poll() is None:
            server.kill()
    output = "".join(lines)
    assert json.loads(last[-2])["error"]["code"] == "shutting_down"
    assert server.returncode == 0, output
    assert "ending the requests still running" in output
    assert "Application shutdown complete" in output
    assert "Traceback" not in output and "CancelledError" not in output, output


class Call(threading.Thread):
    """One HTTP request made in the background; `join()` returns it once answered."""

    def __init__(
        self, server: RunningServer, path: str, body: dict | None = None, method: str = "POST"
    ) -> None:
        super().__init__(daemon=True)
        self.server, self.path, self.body, self.method = server, path, body, method
        self.response: httpx2.Response | None = None
        self.start()

    def run(self) -> None:
        """Make the request and keep its response."""
        with self.server.http() as http:
            self.response = http.request(self.method, self.path, json=self.body)

    def join(self, timeout: float | None = HANG_GUARD_S) -> Call:  # type: ignore[override]
        """Wait for the response (failing the test on a hang)."""
        super().join(timeout)
        assert self.response is not None, f"{self.path}: no response within {timeout} s"
        return self

    def events(self) -> list[str]:
        """The data of each server-sent event of the response."""
        assert self.response is not None
        return [
            line.removeprefix("data: ")
            for line in self.response.text.splitlines()
            if line.startswith("data: ")
        ]
