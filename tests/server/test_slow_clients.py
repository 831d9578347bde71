"""Slow and silent clients: a cap on open connections, a deadline to send each request.

Raw sockets send exactly what a hostile client sends (half a request, then nothing), which an
HTTP client library cannot. Every wait ends as soon as its condition holds; `HANG_GUARD_S`
only turns a hang into a failure.
"""

from __future__ import annotations

import contextlib
import logging
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

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

CAP = 16
READ_TIMEOUT_S = 1.0
HALF_HEADERS = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # no blank line: never ends
HALF_BODY = (
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b'Content-Length: 100\r\n\r\n{"prompt": "'
)
CONNECTIONS_LOGGER = "pagedkv.server.connections"
FLOOD = 1500  # sockets: past the 1,024 files the flooded server may open


@pytest.fixture(scope="module")
def capped(serve) -> RunningServer:
    """A server holding at most CAP connections, with a deadline far past the test's length."""
    return serve(ServerConfig(max_connections=CAP, request_read_timeout=60), num_gpu_blocks=64)


@pytest.fixture(scope="module")
def impatient(serve) -> RunningServer:
    """A server that gives each request READ_TIMEOUT_S to arrive."""
    return serve(ServerConfig(request_read_timeout=READ_TIMEOUT_S), num_gpu_blocks=64)


def test_below_the_cap_health_answers_and_past_it_connections_are_closed_at_once(
    capped: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=CONNECTIONS_LOGGER)
    connections = capped.server.server_state.connections
    held = [open_socket(capped, HALF_HEADERS) for _ in range(CAP - 4)]
    try:
        with capped.http() as http:  # one more connection, still below the cap
            assert http.get("/health").status_code == 200
        wait_until(lambda: len(connections) == CAP - 4)  # the server saw /health's close
        extra = [open_socket(capped, HALF_HEADERS) for _ in range(8)]
        held += extra
        # The first four fill the cap; the other four are closed as they open, long before
        # any read deadline.
        assert all(closed_within(sock, HANG_GUARD_S) for sock in extra[4:])
        assert not any(closed_within(sock, 0.05) for sock in held[:CAP])
        assert len(connections) == CAP
    finally:
        for sock in held:
            sock.close()
    refusals = [r for r in caplog.records if "--max-connections" in r.getMessage()]
    assert len(refusals) == 1, "one line for the four refusals, not one per socket"


def test_requests_not_sent_within_the_read_timeout_are_closed_but_long_responses_are_not(
    impatient: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=CONNECTIONS_LOGGER)
    slow_down(impatient, step_s=0.02)  # the stream below takes over 3 READ_TIMEOUT_S
    result: dict = {}
    stream = threading.Thread(target=_long_stream, args=(impatient, result))
    stream.start()
    opened = time.monotonic()
    slow = {f"silent {i}": open_socket(impatient, b"") for i in range(3)}
    slow["half headers"] = open_socket(impatient, HALF_HEADERS)
    slow["half body"] = open_socket(impatient, HALF_BODY)
    # Slow loris: a byte of headers every 0.2 s, so an idle timeout would never fire.
    slow["dribbler"] = open_socket(impatient, b"G")
    closed_at: dict[str, float] = {}
    try:
        while len(closed_at) < len(slow):
            assert time.monotonic() - opened < HANG_GUARD_S, (
                f"still held: {slow.keys() - closed_at.keys()}"
            )
            if "dribbler" not in closed_at:
                with contextlib.suppress(OSError):  # closed since the last look
                    slow["dribbler"].sendall(b"E")
            for name, sock in slow.items():
                if name not in closed_at and closed_within(sock, 0.02):
                    closed_at[name] = time.monotonic() - opened
            time.sleep(0.2)
    finally:
        for sock in slow.values():
            sock.close()
    assert min(closed_at.values()) >= READ_TIMEOUT_S * 0.9  # a deadline, not a refusal
    stream.join(timeout=HANG_GUARD_S)
    assert result["elapsed"] > 3 * READ_TIMEOUT_S
    assert result["text"].endswith("data: [DONE]\n\n") and '"error"' not in result["text"]
    timeouts = [r for r in caplog.records if "--request-read-timeout" in r.getMessage()]
    assert len(timeouts) == 1, "one line for six closed connections, not one per socket"


@pytest.mark.slow
def test_a_slow_loris_flood_past_the_file_limit_leaves_health_answering_and_the_log_short(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The issue's failure, scaled down: FLOOD half-sent requests against a process that may
    open 1,024 files used to exhaust them (accepts failing, /health silent, a traceback per
    failed accept)."""
    port = free_port()
    log_path = tmp_path / "serve.log"
    command = [sys.executable, "-m", "pagedkv.cli", "serve", "--model", str(tiny_model)]
    command += ["--port", str(port), "--num-gpu-blocks", "64", "--swap-space-gb", "0.01"]
    command += ["--request-read-timeout", str(READ_TIMEOUT_S)]
    with log_path.open("w") as log:
        server = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_limit_files_to_1024
        )
    url = f"http://127.0.0.1:{port}"
    flood: list[socket.socket] = []
    try:
        wait_until(lambda: answers_health(url, server))
        with files_allowed(FLOOD + 256):  # the flood's sockets are this process's files too
            for _ in range(FLOOD):
                flood.append(socket.create_connection(("127.0.0.1", port), HANG_GUARD_S))
                with contextlib.suppress(OSError):  # closed at once: past the cap
                    flood[-1].sendall(HALF_HEADERS)
            wait_until(lambda: answers_health(url, server))
    finally:
        for sock in flood:
            sock.close()
        server.send_signal(signal.SIGINT)
        server.wait(timeout=HANG_GUARD_S)
    log_text = log_path.read_text()
    assert server.returncode == 0, log_text[-3000:]
    assert "Traceback" not in log_text
    assert re.search(r"--max-connections lowered from 2048 to \d+", log_text)
    assert len(log_text) < 20_000, log_text[-3000:]


def open_socket(server: RunningServer, data: bytes) -> socket.socket:
    """A connection to `server` that has sent `data` and will send nothing more."""
    url = urlsplit(server.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=HANG_GUARD_S)
    sock.sendall(data)
    return sock


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """True if the server closes `sock` within `seconds` (it sends nothing before closing)."""
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def _long_stream(server: RunningServer, result: dict) -> None:
    body = {"prompt": "Hello", "max_tokens": 160, "ignore_eos": True, "stream": True}
    started = time.monotonic()
    with server.http() as http:
        result["text"] = http.post("/v1/completions", json=body).text
    result["elapsed"] = time.monotonic() - started


def _limit_files_to_1024() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


@contextlib.contextmanager
def files_allowed(count: int) -> Iterator[None]:
    """This process may open `count` files meanwhile (as far as its hard limit allows)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < count:
        raised = count if hard == resource.RLIM_INFINITY else min(count, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
