"""Servers for the server tests: a tiny seeded model, uvicorn in a thread, a free loopback port.

The servers are built as `pagedkv serve` builds its own (`build_server`): the same connection
limits, and the same drain when they stop.

Each test module starts one server (module scope) with the engine settings it needs; the
model folder is built once per session with `tests.model.tiny_models`.
"""

from __future__ import annotations

import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest
from fastapi import FastAPI

from pagedkv.engine import Engine, EngineArgs
from pagedkv.server import ServerConfig, build_app, build_server
from pagedkv.server.http_server import DrainingServer
from tests.model.tiny_models import build_model_folder

STARTUP_TIMEOUT_S = 30.0
# How long `wait_until` waits: it returns as soon as its condition holds, so this limit only
# turns a hang into a failure and is generous enough for a loaded CI machine.
HANG_GUARD_S = 60.0
# The engine's default 1 GiB of swap is 131,072 CPU blocks of the tiny model: every snapshot
# would walk them all. A few thousand keep swap in play and the snapshots cheap.
SWAP_SPACE_GB = 0.02


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seeded tiny Llama folder every server test serves."""
    return build_model_folder("llama", tmp_path_factory.mktemp("server_model") / "llama")


@dataclass
class RunningServer:
    """A uvicorn server on 127.0.0.1 in a background thread."""

    url: str
    app: FastAPI
    server: DrainingServer
    thread: threading.Thread
    api_key: str | None

    def client(self, **kwargs: Any) -> openai.OpenAI:
        """The official OpenAI client pointed at this server, with no retries."""
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0, **kwargs
        )

    def http(self) -> httpx2.Client:
        """A raw HTTP client carrying the API key, for what the OpenAI client cannot send."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx2.Client(base_url=self.url, headers=headers, timeout=30.0)

    def post(self, path: str, body: dict) -> httpx2.Response:
        """POST `body` as JSON, as sent (no client parses or fills it in)."""
        with self.http() as http:
            return http.post(path, json=body)

    def stop(self) -> None:
        """Ask uvicorn to exit (it drains first) and wait for its thread."""
        self.server.should_exit = True
        self.thread.join(timeout=HANG_GUARD_S)


def start_server(
    model: Path, config: ServerConfig | None = None, **engine_args: Any
) -> RunningServer:
    """Build an Engine for `model` and serve it on a free loopback port."""
    engine_args.setdefault("swap_space_gb", SWAP_SPACE_GB)
    engine = Engine(EngineArgs(model=str(model), **engine_args))
    app = build_app(engine, config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = build_server(app, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    api_key = config.api_key if config else None
    return RunningServer(f"http://127.0.0.1:{port}", app, server, thread, api_key)


@pytest.fixture(scope="module")
def serve(tiny_model: Path) -> Iterator[Any]:
    """`serve(config, **engine_args)` starts a server that is stopped after the module."""
    servers: list[RunningServer] = []

    def start(config: ServerConfig | None = None, **engine_args: Any) -> RunningServer:
        servers.append(start_server(tiny_model, config, **engine_args))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model: Path) -> Any:
    """transformers' tokenizer of the served tiny model: the oracle for token ids."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[Any]:
    """An OpenAI client of the test module's own `server` fixture."""
    with server.client() as client:
        yield client


@pytest.fixture(scope="module")
def model_name(client) -> str:
    """The name the module's server serves its model under."""
    return client.models.list().data[0].id


def all_blocks_free(server: RunningServer) -> bool:
    """True when no GPU or CPU block is held (cached-but-free counts as free)."""
    with server.http() as http:
        snapshot = http.get("/v1/kv").json()
    return all(block["ref_count"] == 0 for block in snapshot["gpu"] + snapshot["cpu"])


def one_prompt_body(path: str, **fields: Any) -> dict[str, Any]:
    """A request to /v1/completions or /v1/chat/completions with one short prompt or user
    message, and `fields`."""
    if path == "/v1/completions":
        return {"prompt": "Paged attention stores", **fields}
    return {"messages": [{"role": "user", "content": "Hi"}], **fields}


def fail_next_step(server: RunningServer, message: str) -> None:
    """Make the server's next engine step raise RuntimeError(message), once."""
    engine = server.app.state.engine_loop.engine
    real_step = engine.step

    def failing_step():
        engine.step = real_step
        raise RuntimeError(message)

    engine.step = failing_step


def wait_until(condition: Any, timeout: float = HANG_GUARD_S, interval: float = 0.02) -> None:
    """Poll `condition()` until it holds; fail after `timeout` seconds (a guard against hangs,
    never a measure of speed)."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


def slow_down(server: RunningServer, step_s: float) -> None:
    """Make each engine step take at least `step_s` longer (a bigger model, in effect)."""
    engine = server.app.state.engine_loop.engine
    real_step = engine.step

    def slow_step() -> list:
        time.sleep(step_s)
        return real_step()

    engine.step = slow_step


def free_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def answers_health(
    url: str, server: subprocess.Popen, verify: ssl.SSLContext | bool = True
) -> bool:
    """True once /health says 200 (over HTTPS, checked with `verify`); fails at once if the
    server has exited."""
    assert server.poll() is None, "pagedkv serve exited"
    try:
        return httpx2.get(f"{url}/health", verify=verify, timeout=2).status_code == 200
    except httpx2.TransportError:
        return False


def start_serve(
    model: Path,
    *flags: str,
    env: dict[str, str] | None = None,
    verify: ssl.SSLContext | None = None,
) -> tuple[subprocess.Popen, str]:
    """`pagedkv serve` as a user runs it, on a free loopback port, with `flags` after the
    pool's; returns the process and its URL (https when `verify`, the client's TLS context,
    is given) once /health answers."""
    port = free_port()
    command = [sys.executable, "-m", "pagedkv.cli", "serve", "--model", str(model)]
    command += ["--port", str(port), "--num-gpu-blocks", "128", "--swap-space-gb", "0.01"]
    server = subprocess.Popen(
        [*command, *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    url = f"{'https' if verify else 'http'}://127.0.0.1:{port}"
    try:
        wait_until(lambda: answers_health(url, server, verify or True))
    except AssertionError as error:  # exited, or never answered: say what it printed
        server.kill()
        raise AssertionError(f"{error}:\n{server.communicate()[0].decode()}") from None
    return server, url


def stop_serve(server: subprocess.Popen) -> str:
    """Ctrl-C the server; it must exit 0. Its output."""
    server.send_signal(signal.SIGINT)
    output = server.communicate(timeout=30)[0].decode()
    assert server.returncode == 0, output
    return output
