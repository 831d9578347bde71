"""Request streams for the simulator: built-in length distributions, shared prompts, n > 1, traces.

A request is only lengths and sharing: how many prompt tokens, how many it will generate,
the `max_tokens` cap its client sent (what a slab sized per request reserves), which leading
prompt tokens it shares with others (`prefix_id`, `prefix_len`), and how many samples `n` it
draws from that prompt. Arrivals are all at step 0, or a Poisson process at `rate` requests
per step.
"""

from __future__ import annotations

import json
import math
from collections.abc import Hashable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

MAX_ARRIVAL_STEP = 1_000_000


class WorkloadError(ValueError):
    """A workload that cannot be simulated: unknown name, bad trace line, lengths over limits."""


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload; every sample has the same prompt and output length."""

    req_id: int
    arrival_step: int
    prompt_len: int
    output_len: int
    max_tokens: int
    prefix_id: Hashable | None = None
    prefix_len: int = 0
    n: int = 1

    @property
    def total_len(self) -> int:
        """Tokens one sample holds when it finishes."""
        return self.prompt_len + self.output_len


@dataclass(frozen=True)
class LengthDistribution:
    """Token counts drawn from a normal or log-normal distribution, rounded and clipped.

    For `lognormal`, `mean` is the mean of the distribution itself (before clipping) and
    `spread` its log-space sigma: the larger, the longer the tail.
    """

    kind: str
    mean: float
    spread: float
    low: int
    high: int

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """`size` integer lengths in [low, high]."""
        if self.kind == "fixed":
            values = np.full(size, self.mean)
        elif self.kind == "normal":
            values = rng.normal(self.mean, self.spread, size)
        elif self.kind == "lognormal":
            mu = np.log(self.mean) - self.spread**2 / 2
            values = rng.lognormal(mu, self.spread, size)
        else:
            raise WorkloadError(f"unknown length distribution {self.kind!r}")
        return np.clip(np.rint(values), self.low, self.high).astype(int)


@dataclass(frozen=True)
class Workload:
    """A named request mix: prompt and output lengths, context and max_tokens limits."""

    name: str
    description: str
    prompt: LengthDistribution
    output: LengthDistribution
    max_model_len: int
    max_tokens: int


def _fixed(tokens: int) -> LengthDistribution:
    return LengthDistribution("fixed", tokens, 0, tokens, tokens)


WORKLOADS: dict[str, Workload] = {
    workload.name: workload
    for workload in (
        Workload(
            "tutorial",
            "paged-attention tutorial: 1-token prompt, outputs N(500, 200) in [200, 2048]",
            _fixed(1),
            LengthDistribution("normal", 500, 200, 200, 2048),
            max_model_len=2048,
            max_tokens=2048,
        ),
        Workload(
            "chat",
            "multi-turn chat: ~1,000 tokens of history in, ~500 out, ~1,500 in all",
            LengthDistribution("lognormal", 1010, 0.6, 16, 3072),
            LengthDistribution("lognormal", 520, 0.6, 8, 1024),
            max_model_len=4096,
            max_tokens=1024,
        ),
        Workload(
            "docs",
            "document QA: ~12,500-token documents in, ~500 tokens out, ~13,000 in all",
            LengthDistribution("lognormal", 12_500, 0.3, 2_000, 28_000),
            LengthDistribution("lognormal", 500, 0.5, 16, 2048),
            max_model_len=32_768,
            max_tokens=2048,
        ),
        Workload(
            "sharegpt",
            "ShareGPT conversations: mean input 161, output 338 tokens, long-tailed",
            LengthDistribution("lognormal", 166, 1.0, 4, 1024),
            LengthDistribution("lognormal", 353, 0.9, 4, 1536),
            max_model_len=2048,
            max_tokens=1536,
        ),
        Workload(
            "alpaca",
            "Alpaca instructions: mean input 19, output 58 tokens",
            LengthDistribution("lognormal", 19, 0.6, 1, 256),
            LengthDistribution("lognormal", 58, 0.8, 1, 512),
            max_model_len=2048,
            max_tokens=512,
        ),
    )
}


def workload(name: str) -> Workload:
    """The built-in workload called `name`, or an error listing them."""
    try:
        return WORKLOADS[name]
    except KeyError:
        raise WorkloadError(
            f"unknown workload {name!r}; built in: {', '.join(WORKLOADS)} (or --trace FILE)"
        ) from None


def generate_requests(
    mix: Workload,
    num_requests: int,
    *,
    seed: int = 0,
    rate: float | None = None,
    system_prompt: int = 0,
    shared_fraction: float = 1.0,
    n: int = 1,
) -> list[WorkloadRequest]:
    """Draw `num_requests` requests from `mix`.

    A `system_prompt` of P tokens is prepended to a `shared_fraction` of them (the same P
    tokens each time, so a prefix cache can share them). Output lengths are clipped so
    prompt + output fits `mix.max_model_len`; `max_tokens` likewise.
    """
    if num_requests <= 0:
        raise WorkloadError(f"number of requests must be positive, got {num_requests}")
    if not 0 <= shared_fraction <= 1:
        raise WorkloadError(f"shared fraction must be in [0, 1], got {shared_fraction}")
    if system_prompt < 0 or n < 1:
        raise WorkloadError(f"need system prompt >= 0 and n >= 1, got {system_prompt} and {n}")
    rng = np.random.default_rng(seed)
    prompts = mix.prompt.sample(rng, num_requests)
    outputs = mix.output.sample(rng, num_requests)
    shared = rng.random(num_requests) < shared_fraction if system_prompt else [False] * num_requests
    arrivals = arrival_steps(rng, num_requests, rate)
    requests = []
    for req_id in range(num_requests):
        prefix_len = system_prompt if shared[req_id] else 0
        prompt_len = int(prompts[req_id]) + prefix_len
        room = mix.max_model_len - prompt_len
        if room < 1:
            raise WorkloadError(
                f"request {req_id}: prompt of {prompt_len} tokens leaves no room for output "
                f"in max_model_len {mix.max_model_len}"
            )
        requests.append(
            WorkloadRequest(
                req_id=req_id,
                arrival_step=int(arrivals[req_id]),
                prompt_len=prompt_len,
                output_len=min(int(outputs[req_id]), room),
                max_tokens=min(mix.max_tokens, room),
                prefix_id="system" if prefix_len else None,
                prefix_len=prefix_len,
                n=n,
            )
        )
    return requests


def arrival_steps(rng: np.random.Generator, count: int, rate: float | None) -> np.ndarray:
    """Arrival step of each request: all 0, or a Poisson process of `rate` per step.

    The simulator walks every step, idle ones too, so arrivals may span at most
    `MAX_ARRIVAL_STEP` steps; a slower rate is refused rather than run for hours.
    """
    if rate is None:
        return np.zeros(count, dtype=int)
    if not 0 < rate < math.inf:
        raise WorkloadError(f"arrival rate must be a positive number, got {rate}")
    times = np.cumsum(rng.exponential(1 / rate, count))
    if times[-1] > MAX_ARRIVAL_STEP:
        span = f"{times[-1]:,.0f}" if times[-1] < 1e15 else f"{times[-1]:.1e}"
        raise WorkloadError(
            f"at {rate:g} requests per step, {count:,} arrivals span {span} steps; "
            f"the simulator walks at most {MAX_ARRIVAL_STEP:,}: raise the rate"
        )
    return np.floor(times).astype(int)


def load_trace(
    path: str | Path, max_model_len: int, *, seed: int = 0, rate: float | None = None
) -> list[WorkloadRequest]:
    """Requests from a JSONL trace, one object per line.

    Fields: `prompt_len`, `output_len` (required); `prefix_id` with `prefix_len` (requests with
    the same id share their first `prefix_len` prompt tokens); `n` (samples, default 1);
    `max_tokens` (default: what max_model_len leaves after the prompt).
    """
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read trace ({exc.strerror})") from None
    records = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    if not records:
        raise WorkloadError(f"{path}: trace has no requests")
    arrivals = arrival_steps(np.random.default_rng(seed), len(records), rate)
    return [
        replace(
            _trace_request(f"{path} line {number}", line, max_model_len),
            req_id=index,
            arrival_step=int(arrivals[index]),
        )
        for index, (number, line) in enumerate(records)
    ]


def _trace_request(where: str, line: str, max_model_len: int) -> WorkloadRequest:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise WorkloadError(f"{where}: expected a JSON object")

    def count(key: str, default: int | None = None, low: int = 1) -> int:
        value = record.get(key, default)
        if value is None:
            raise WorkloadError(f"{where}: missing {key}")
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise WorkloadError(f"{where}: {key} must be an integer >= {low}, got {value!r}")
        return value

    prompt_len = count("prompt_len")
    output_len = count("output_len")
    if prompt_len + output_len > max_model_len:
        raise WorkloadError(
            f"{where}: prompt_len + output_len = {prompt_len + output_len} exceeds "
            f"max_model_len {max_model_len}"
        )
    prefix_id = record.get("prefix_id")
    prefix_len = count("prefix_len") if prefix_id is not None else 0
    if prefix_len > prompt_len:
        raise WorkloadError(f"{where}: prefix_len {prefix_len} exceeds prompt_len {prompt_len}")
    if prefix_id is not None and not isinstance(prefix_id, str | int):
        raise WorkloadError(f"{where}: prefix_id must be a string or integer")
    max_tokens = count("max_tokens", max_model_len - prompt_len, low=output_len)
    return WorkloadRequest(
        req_id=0,
        arrival_step=0,
        prompt_len=prompt_len,
        output_len=output_len,
        max_tokens=min(max_tokens, max_model_len - prompt_len),
        prefix_id=prefix_id,
        prefix_len=prefix_len,
        n=count("n", 1),
    )
