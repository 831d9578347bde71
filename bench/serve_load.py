"""Load test of `pagedkv serve`: many concurrent streaming clients on loopback.

Starts `pagedkv serve` (or targets `--url`), sends `--num-requests` streamed completions of
mixed prompt and output lengths from `--concurrency` clients at once, each with `ignore_eos`
so it must produce exactly the tokens it asked for, and prints requests/s, output tokens/s,
time to first token and time per output token (p50 / p99). It then checks through
`GET /v1/kv` that every KV block is free again. Exits non-zero if any check fails. With
`--page-map-viewers N`, N clients read the page map's stream (`/v1/kv/stream`) throughout, as
N open browser tabs would: quote a run with 50 beside the run without.

    .venv/bin/python bench/serve_load.py                      # the built-in model
    .venv/bin/python bench/serve_load.py --page-map-viewers 50
    .venv/bin/python bench/serve_load.py --model PATH --serve-arg=--num-gpu-blocks=2048
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2

from pagedkv.hub import DEFAULT_MODEL

WORDS = [
    *("memory", "block", "table", "page", "cache", "token", "sequence", "prefix", "share"),
    *("copy", "write", "swap", "host", "device", "attention", "key", "value", "layer", "head"),
    *("batch", "request", "stream", "model", "engine", "paged", "fragment", "pool", "free"),
    *("hold", "reference", "count", "evict", "recent", "chain", "hash", "prompt", "sample"),
]
STARTUP_TIMEOUT_S = 600.0


@dataclass
class Result:
    """One request's outcome and timings (seconds)."""

    requested_tokens: int
    completion_tokens: int
    finish_reason: str | None
    ttft: float
    tpot: float | None


def main() -> int:
    """Run the load, print the figures, check completeness and that the pool is empty."""
    args = parse_args()
    rng = random.Random(args.seed)
    system_prompt = " ".join(rng.choices(WORDS, k=args.shared_prefix_words))
    workload = []
    for index in range(args.num_requests):
        prompt = " ".join(rng.choices(WORDS, k=rng.randint(*args.prompt_words)))
        if index % 2 == 0:  # half the requests share a system prompt: prefix-cache hits
            prompt = f"{system_prompt}\n{prompt}"
        workload.append((prompt, rng.randint(*args.output_tokens)))
    print(f"load average {os.getloadavg()[0]:.1f} at the start ({os.cpu_count()} CPUs)")
    server = None if args.url else start_server(args)
    url = args.url or server[0]
    try:
        wait_for_health(url, STARTUP_TIMEOUT_S)
        model = httpx2.get(f"{url}/v1/models", headers=auth(args)).json()["data"][0]["id"]
        results, elapsed, frames = asyncio.run(run_load(url, model, workload, args))
        pool = pool_after(url, args)
    finally:
        if server is not None:
            stop_server(server[1])
    baseline = None if args.url or args.no_baseline else engine_alone(workload, args)
    return report(results, elapsed, args, pool, baseline, frames)


def parse_args() -> argparse.Namespace:
    """The load's shape and where to send it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="model to serve (default: %(default)s)"
    )
    parser.add_argument("--url", help="load an already running server instead of starting one")
    parser.add_argument("--api-key", default=os.environ.get("PAGEDKV_API_KEY"))
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--prompt-words", type=int, nargs=2, default=(8, 128), metavar=("MIN", "MAX")
    )
    parser.add_argument(
        "--output-tokens", type=int, nargs=2, default=(8, 64), metavar=("MIN", "MAX")
    )
    parser.add_argument(
        "--shared-prefix-words",
        type=int,
        default=64,
        help="words of the system prompt every other request starts with (default: %(default)s)",
    )
    parser.add_argument(
        "--page-map-viewers",
        type=int,
        default=0,
        help="page-map streams read during the load, each on its own connection (default: "
        "%(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads of the server and the baseline (default: torch's); on a busy "
        "machine 1 can be several times faster than oversubscribed OpenMP threads",
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the same workload through the Engine in-process (the server's overhead)",
    )
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="extra `pagedkv serve` argument, e.g. --serve-arg=--num-gpu-blocks=4096 (repeatable)",
    )
    return parser.parse_args()


def auth(args: argparse.Namespace) -> dict[str, str]:
    """The Authorization header, when the server needs a key."""
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def start_server(args: argparse.Namespace) -> tuple[str, subprocess.Popen]:
    """`pagedkv serve` on a free loopback port, its log in a temporary file."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log_path = Path(tempfile.mkdtemp(prefix="serve_load_")) / "serve.log"
    print(f"starting pagedkv serve --model {args.model} on port {port} (log: {log_path})")
    command = [sys.executable, "-m", "pagedkv.cli", "serve", "--model", args.model]
    command += ["--host", "127.0.0.1", "--port", str(port), "--max-waiting", "100000"]
    if args.page_map_viewers:
        command += ["--max-page-map-viewers", str(args.page_map_viewers)]
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)  # torch's intra-op threads in the server
    with log_path.open("w") as log:  # the child keeps its own handle
        process = subprocess.Popen(
            command + args.serve_arg, stdout=log, stderr=subprocess.STDOUT, env=env
        )
    return f"http://127.0.0.1:{port}", process


def stop_server(process: subprocess.Popen) -> None:
    """Ask the server to shut down gracefully; kill it if it will not."""
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()


def wait_for_health(url: str, timeout: float) -> None:
    """Wait while the server loads its model (the first run may also pull it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx2.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx2.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"server at {url} not healthy after {timeout:.0f} s")
        time.sleep(0.5)


async def run_load(
    url: str, model: str, workload: list[tuple[str, int]], args: argparse.Namespace
) -> tuple[list[Result], float, list[int]]:
    """Every request of `workload`, at most `--concurrency` in flight, while the page-map
    viewers (all connected before the clock starts) watch; the results, the wall time and
    the frames each viewer received."""
    limits = httpx2.Limits(
        max_connections=args.concurrency, max_keepalive_connections=args.concurrency
    )
    timeout = httpx2.Timeout(None)
    queue: asyncio.Queue = asyncio.Queue()
    for item in workload:
        queue.put_nowait(item)
    results: list[Result] = []
    frames = [0] * args.page_map_viewers
    viewer_limits = httpx2.Limits(max_connections=max(1, args.page_map_viewers))
    async with (
        httpx2.AsyncClient(
            base_url=url, limits=limits, timeout=timeout, headers=auth(args)
        ) as client,
        httpx2.AsyncClient(
            base_url=url, limits=viewer_limits, timeout=timeout, headers=auth(args)
        ) as viewer_client,
    ):

        async def worker() -> None:
            while not queue.empty():
                prompt, max_tokens = queue.get_nowait()
                results.append(await one_request(client, model, prompt, max_tokens))
                done = len(results)
                if done % 32 == 0:
                    print(f"  {done}/{len(workload)} requests done", flush=True)

        viewers = [
            asyncio.create_task(watch_page_map(viewer_client, frames, index))
            for index in range(args.page_map_viewers)
        ]
        while not all(frames) and not any(viewer.done() for viewer in viewers):
            await asyncio.sleep(0.05)
        for viewer in viewers:
            if viewer.done():
                viewer.result()  # a refused viewer: its SystemExit
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - started
        for viewer in viewers:
            viewer.cancel()
        await asyncio.gather(*viewers, return_exceptions=True)
    return results, elapsed, frames


async def watch_page_map(client: httpx2.AsyncClient, frames: list[int], index: int) -> None:
    """One page-map viewer: reads `/v1/kv/stream` until cancelled, counting its frames."""
    async with client.stream("GET", "/v1/kv/stream") as response:
        if response.status_code != 200:
            raise SystemExit(f"page map: HTTP {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                frames[index] += 1


async def one_request(
    client: httpx2.AsyncClient, model: str, prompt: str, max_tokens: int
) -> Result:
    """One streamed completion; token times are taken as each chunk arrives."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first = last = None
    finish_reason = None
    completion_tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise SystemExit(f"HTTP {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise SystemExit(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                finish_reason = choice["finish_reason"] or finish_reason
    assert first is not None and last is not None
    tpot = (last - first) / (completion_tokens - 1) if completion_tokens > 1 else None
    return Result(max_tokens, completion_tokens, finish_reason, first - sent, tpot)


@dataclass
class PoolAfter:
    """The KV pool once the load is over."""

    free: bool
    num_gpu_blocks: int
    num_cpu_blocks: int
    prefix_hit_rate: float
    preemptions: int


def engine_alone(workload: list[tuple[str, int]], args: argparse.Namespace) -> float:
    """Output tokens/s of the same requests through an in-process Engine, as many in flight.

    Run after the server has exited, with the same engine flags, so the ratio of the two
    rates is the cost of HTTP, streaming and the engine thread on this machine and load.
    """
    import torch

    from pagedkv.engine import Engine, EngineArgs, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    engine_args, _ = parser.parse_known_args(["--model", args.model, *args.serve_arg])
    engine = Engine(EngineArgs.from_cli_args(engine_args))
    print(f"engine alone: the same {len(workload)} requests in-process", flush=True)
    pending = list(enumerate(workload))
    in_flight = output_tokens = 0
    started = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and in_flight < args.concurrency:
            index, (prompt, max_tokens) = pending.pop(0)
            engine.add_request(
                str(index), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            )
            in_flight += 1
        for output in engine.step():
            output_tokens += sum(len(completion.token_ids) for completion in output.outputs)
            in_flight -= output.finished
    return output_tokens / (time.perf_counter() - started)


def pool_after(url: str, args: argparse.Namespace) -> PoolAfter:
    """Read the pool through `GET /v1/kv`."""
    snapshot = httpx2.get(f"{url}/v1/kv", headers=auth(args), timeout=60).json()
    stats = snapshot["stats"]
    return PoolAfter(
        free=all(b["ref_count"] == 0 for b in snapshot["gpu"] + snapshot["cpu"]),
        num_gpu_blocks=len(snapshot["gpu"]),
        num_cpu_blocks=len(snapshot["cpu"]),
        prefix_hit_rate=stats["prefix_hit_rate"],
        preemptions=stats["num_swap_preemptions"] + stats["num_recompute_preemptions"],
    )


def report(
    results: list[Result],
    elapsed: float,
    args: argparse.Namespace,
    pool: PoolAfter,
    baseline: float | None,
    frames: list[int],
) -> int:
    """Print the figures; 0 if every request got its tokens and the pool is empty."""
    complete = [
        r
        for r in results
        if r.completion_tokens == r.requested_tokens and r.finish_reason == "length"
    ]
    output_tokens = sum(r.completion_tokens for r in results)
    ttfts = [r.ttft for r in results]
    tpots = [r.tpot for r in results if r.tpot is not None]
    load = f"\nload average {os.getloadavg()[0]:.1f} at the end ({os.cpu_count()} CPUs)"
    if not args.url:  # otherwise the server's threads are whatever it was started with
        load += f", torch threads {args.threads or 'default'}"
    print(load)
    print(
        f"{len(results)} requests, {args.concurrency} concurrent streaming clients, "
        f"prompts {args.prompt_words[0]}-{args.prompt_words[1]} words, "
        f"outputs {args.output_tokens[0]}-{args.output_tokens[1]} tokens, half after a shared "
        f"{args.shared_prefix_words}-word system prompt, {args.model}"
    )
    if frames:
        print(f"page-map viewers    {len(frames):8d}   ({min(frames)}-{max(frames)} frames each)")
    print(f"wall time           {elapsed:8.1f} s")
    print(f"requests/s          {len(results) / elapsed:8.2f}")
    print(f"output tokens/s     {output_tokens / elapsed:8.1f}   ({output_tokens} tokens)")
    if baseline is not None:
        ratio = output_tokens / elapsed / baseline
        print(f"engine alone        {baseline:8.1f}   output tokens/s; server/engine {ratio:.2f}")
    ttft = [percentile(ttfts, q) * 1e3 for q in (50, 99)]
    tpot = [percentile(tpots, q) * 1e3 for q in (50, 99)]
    print(f"TTFT p50 / p99      {ttft[0]:8.0f} / {ttft[1]:.0f} ms")
    print(f"TPOT p50 / p99      {tpot[0]:8.1f} / {tpot[1]:.1f} ms")
    print(f"complete            {len(complete)}/{len(results)} with exactly the requested tokens")
    print(f"prefix cache hits   {pool.prefix_hit_rate:8.1%} of prompt tokens")
    print(f"preemptions         {pool.preemptions:8d}")
    verdict = "yes" if pool.free else "NO"
    print(
        f"blocks free after   {verdict:>8} "
        f"({pool.num_gpu_blocks} GPU, {pool.num_cpu_blocks} CPU blocks, all ref counts 0)"
    )
    return 0 if pool.free and len(complete) == len(results) == args.num_requests else 1


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (inclusive method, as most load tools report it)."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


if __name__ == "__main__":
    raise SystemExit(main())
