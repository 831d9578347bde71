"""`pagedkv serve --tensor-parallel-size 2`: the OpenAI client streams the one-process greedy
text, the page map shows one logical pool whose blocks are half as many bytes on each rank,
and a worker that dies mid-request ends that request and turns /health (and every new
request) into a 503 naming its rank; SIGTERM then ends everything.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import openai

from pagedkv.engine import LLM, SamplingParams
from tests.server.conftest import HANG_GUARD_S, answers_health, free_port, wait_until

# `pagedkv serve`, able to print every thread's stack on SIGUSR1.
DUMPS_STACKS_ON_SIGUSR1 = (
    "import faulthandler, signal, sys; faulthandler.register(signal.SIGUSR1, all_threads=True); "
    "from pagedkv.cli import main; sys.exit(main(sys.argv[1:]))"
)
PROMPT = "Paged attention stores"
MAX_TOKENS = 16


def children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def first_page_map_frame(url: str) -> dict:
    with httpx2.stream("GET", f"{url}/v1/kv/stream", timeout=HANG_GUARD_S) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: "):
                return json.loads(line.removeprefix("data: "))
    raise AssertionError("the page map sent no frame")


def test_serve_with_two_ranks_streams_the_one_rank_text_and_fails_health_when_a_rank_dies(
    tiny_model: Path,
) -> None:
    settings = dict(num_gpu_blocks=64, swap_space_gb=0.01, threads=1)
    single = LLM(str(tiny_model), **settings)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    want = single.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].text
    port = free_port()
    command = [sys.executable, "-c", DUMPS_STACKS_ON_SIGUSR1, "serve", "--model", str(tiny_model)]
    command += ["--port", str(port), "--num-gpu-blocks", "64", "--swap-space-gb", "0.01"]
    command += ["--threads", "1", "--tensor-parallel-size", "2", "--shutdown-timeout", "0"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: answers_health(url, server))
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
            stream = client.completions.create(
                model=str(tiny_model),
                prompt=PROMPT,
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                stream=True,
            )
            got = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert got == want
        frame = first_page_map_frame(url)
        assert frame["num_gpu_blocks"] == 64 and len(frame["gpu"]) == 64  # one logical pool
        stats = frame["stats"]
        assert stats["tensor_parallel_size"] == 2
        assert stats["kv_bytes_per_block"] * 2 == single.engine.kv_bytes_per_block
        (worker,) = [pid for pid in children(server.pid) if b"spawn_main" in _cmdline(pid)]
        body = {"prompt": PROMPT, "max_tokens": 900, "stream": True, "ignore_eos": True}
        # A loaded machine may take seconds to notice the death; a hang is the collective
        # timeout (120 s), which this guard still turns into a failure.
        with httpx2.stream(
            "POST", f"{url}/v1/completions", json=body, timeout=HANG_GUARD_S
        ) as stream:
            lines = (line for line in stream.iter_lines() if line.startswith("data: "))
            next(lines)  # generating: the worker dies mid-request
            os.kill(worker, signal.SIGKILL)
            events = [line.removeprefix("data: ") for line in lines]
        assert "tensor-parallel rank 1 failed" in json.loads(events[-2])["error"]["message"]
        wait_until(lambda: _get(f"{url}/health").status_code == 503, interval=0.2)
        assert "tensor-parallel rank 1 failed" in _get(f"{url}/health").text
        refused = httpx2.post(
            f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=HANG_GUARD_S
        )
        assert refused.status_code == 503 and "rank 1" in refused.text
        server.send_signal(signal.SIGTERM)
        output = server.communicate(timeout=HANG_GUARD_S)[0].decode()
    finally:
        if server.poll() is None:  # hung: its threads' stacks say where, for diagnosis
            print(_children_states(server.pid))  # a worker still running, a zombie, or gone
            server.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            server.kill()
            print(server.communicate()[0].decode())  # shown with the failure, for diagnosis
    assert server.returncode == 0, output


def _get(url: str) -> httpx2.Response:
    """A GET that waits out a loaded machine (httpx's default read timeout is 5 s)."""
    return httpx2.get(url, timeout=HANG_GUARD_S)


def _children_states(pid: int) -> str:
    """Each child process's state line and command, one per line."""
    lines = []
    for child in children(pid):
        try:
            status = Path(f"/proc/{child}/status").read_text().splitlines()
        except FileNotFoundError:  # reaped since
            status = ["State: gone"]
        state = next(line for line in status if line.startswith("State"))
        lines.append(f"child {child} {state} {_cmdline(child)[:120]!r}")
    return "\n".join(lines) or "no child processes"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return b""
