"""`pagedkv demo`: a mixed batch of real chat requests served by the engine, watched live.

Most requests share one system prompt (their first blocks come from the prefix cache), some
ask for two samples (forked: the prompt's blocks are held once), and they arrive over time
into a pool small enough that requests come and go, and sometimes give way. A live view
shows the queues and the block pool; at the end come the answers and a summary of where
the KV memory went, beside what a contiguous (slab) allocator would have allowed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from pagedkv.engine import Engine, RequestOutput, SamplingParams
from pagedkv.memory import NoContiguousSpace, SlabAllocator

SYSTEM_PROMPT = (
    "You are a concise, helpful assistant running inside pagedkv, a small inference engine "
    "that stores the attention keys and values of every conversation in fixed-size blocks. "
    "Answer the user's question directly, in at most three sentences."
)
# (question, uses the shared system prompt, samples)
QUESTIONS: list[tuple[str, bool, int]] = [
    ("Name the capital of France.", False, 1),
    ("Explain what a KV cache is in a language model.", True, 2),
    ("Give three tips for writing readable Python code.", True, 1),
    ("Why is the sky blue?", True, 1),
    ("Suggest two names for a pet cat.", True, 2),
    ("What is the difference between a process and a thread?", True, 1),
    ("Summarise the plot of Romeo and Juliet.", True, 1),
    ("How do vaccines train the immune system?", True, 1),
    ("Translate 'good morning' into Spanish, French and German.", True, 1),
    ("What are the health benefits of walking every day?", True, 1),
    ("Name the planets of the solar system in order.", False, 1),
    ("What does a compiler do?", True, 2),
]
FIRST_ARRIVALS = 4  # requests queued at the start; the rest arrive one every few steps
STEPS_BETWEEN_ARRIVALS = 3
MAX_MAP_CELLS = 1024  # the pool map draws at most this many blocks
STYLES = [
    "white on blue",
    "white on magenta",
    "black on yellow",
    "white on dark_green",
    "black on cyan",
    "white on red",
    "black on bright_green",
    "white on purple",
    "black on orange1",
    "white on grey39",
    "black on bright_cyan",
    "white on dark_orange3",
]


@dataclass
class DemoTotals:
    """What the demo measured while it ran."""

    steps: int = 0
    peak_running: int = 0
    peak_shared_blocks: int = 0
    utilisation_sum: float = 0.0
    utilisation_samples: int = 0
    answers: dict[str, dict[int, str]] = field(default_factory=dict)


def run_serving_demo(engine: Engine, max_tokens: int, temperature: float, console: Console) -> int:
    """Serve the demo's requests through `engine`; print answers and the memory summary."""
    requests = list(_requests(engine, max_tokens, temperature))
    totals = DemoTotals()
    started = time.perf_counter()
    pending = list(requests)
    live = Live(console=console, auto_refresh=False) if console.is_terminal else None
    if live is not None:
        live.start()
    try:
        while pending or engine.has_unfinished():
            if pending and (
                totals.steps < FIRST_ARRIVALS or totals.steps % STEPS_BETWEEN_ARRIVALS == 0
            ):
                request_id, prompt, params = pending.pop(0)
                engine.add_request(request_id, prompt, params)
            _record(engine.step(), totals)
            _measure(engine, totals)
            totals.steps += 1
            if live is not None:
                live.update(_view(engine, totals), refresh=True)
            elif totals.steps % 25 == 0:
                stats = engine.stats
                console.print(
                    f"step {totals.steps}: {stats.num_running} running, "
                    f"{stats.num_waiting} waiting, {stats.num_swapped} swapped, "
                    f"KV usage {stats.kv_usage:.0%}"
                )
    finally:
        if live is not None:
            live.stop()
    elapsed = time.perf_counter() - started
    _print_answers(console, requests, totals)
    _print_summary(console, engine, requests, totals, elapsed)
    engine.manager.check_invariants()
    leaked = engine.manager.num_gpu_blocks - engine.manager.num_free_blocks
    console.print(
        "every block is free again, invariants hold"
        if leaked == 0
        else f"[red]{leaked} blocks still held"
    )
    return 0 if leaked == 0 else 1


def _requests(
    engine: Engine, max_tokens: int, temperature: float
) -> Iterator[tuple[str, list[int], SamplingParams]]:
    for index, (question, with_system, n) in enumerate(QUESTIONS):
        messages = [{"role": "user", "content": question}]
        if with_system:
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        params = SamplingParams(
            n=n,
            temperature=temperature if n > 1 else 0.0,
            top_p=0.9,
            max_tokens=max_tokens,
            seed=index,
        )
        yield f"q{index:02d}", engine.tokenizer.encode_chat(messages), params


def _record(deltas: list[RequestOutput], totals: DemoTotals) -> None:
    for delta in deltas:
        samples = totals.answers.setdefault(delta.request_id, {})
        for output in delta.outputs:
            samples[output.index] = samples.get(output.index, "") + output.text


def _measure(engine: Engine, totals: DemoTotals) -> None:
    stats = engine.stats
    totals.peak_running = max(totals.peak_running, stats.num_running)
    manager = engine.manager
    shared = sum(1 for block in range(manager.num_gpu_blocks) if manager.block_ref_count(block) > 1)
    totals.peak_shared_blocks = max(totals.peak_shared_blocks, shared)
    if stats.kv_usage > 0:
        totals.utilisation_sum += stats.kv_utilisation
        totals.utilisation_samples += 1


def _view(engine: Engine, totals: DemoTotals) -> Group:
    """Queues, per-request progress and the block pool, for the live display."""
    stats = engine.stats
    header = Text(
        f"step {totals.steps}  running {stats.num_running}  waiting {stats.num_waiting}  "
        f"swapped {stats.num_swapped}  KV usage {stats.kv_usage:.0%}  "
        f"utilisation {stats.kv_utilisation:.0%}  prefix hits {stats.prefix_hit_tokens} tokens  "
        f"preemptions {stats.num_swap_preemptions} swap / "
        f"{stats.num_recompute_preemptions} recompute  {stats.tokens_per_s:.0f} tokens/s",
        style="bold",
    )
    table = Table(box=None, pad_edge=False, show_header=True, header_style="dim")
    table.add_column("request")
    table.add_column("state")
    table.add_column("answer so far", overflow="ellipsis", no_wrap=True, max_width=70)
    states = _request_states(engine)
    for request_id, samples in sorted(totals.answers.items()):
        text = " | ".join(samples[i].replace("\n", " ") for i in sorted(samples))
        style = STYLES[int(request_id[1:]) % len(STYLES)]
        table.add_row(Text(request_id, style=style), states.get(request_id, "done"), text[-70:])
    return Group(header, table, Text("GPU block pool:", style="dim"), _pool_map(engine))


def _request_states(engine: Engine) -> dict[str, str]:
    scheduler = engine.scheduler
    states = {}
    for name, queue in (
        ("waiting", scheduler.waiting),
        ("running", scheduler.running),
        ("swapped", scheduler.swapped),
    ):
        for request in queue:
            states[request.request_id] = name
    return states


def _pool_map(engine: Engine) -> Text:
    """One cell per block: the holder's colour, its ref count when shared, 'c' cached-free."""
    snapshot = engine.kv_snapshot()
    text = Text()
    blocks = snapshot.gpu[:MAX_MAP_CELLS]
    for position, block in enumerate(blocks):
        if position and position % 64 == 0:
            text.append("\n")
        if block.ref_count == 0:
            text.append("c" if block.cached else "·", style="dim")
            continue
        request_id = block.holders[0][0]
        style = STYLES[int(request_id[1:]) % len(STYLES)] if request_id[1:].isdigit() else ""
        text.append(str(min(block.ref_count, 9)) if block.ref_count > 1 else " ", style=style)
    if len(snapshot.gpu) > MAX_MAP_CELLS:
        text.append(f"\n(first {MAX_MAP_CELLS} of {len(snapshot.gpu)} blocks)", style="dim")
    return text


def _print_answers(
    console: Console, requests: list[tuple[str, list[int], SamplingParams]], totals: DemoTotals
) -> None:
    console.rule("[bold]Answers")
    for (request_id, _, _), (question, _, _) in zip(requests, QUESTIONS, strict=True):
        console.print(Text(f"{request_id}  {question}", style="bold"))
        samples = totals.answers.get(request_id, {})
        for index in sorted(samples):
            label = f"  [{index}] " if len(samples) > 1 else "  "
            console.print(label + samples[index].strip())


def _print_summary(
    console: Console,
    engine: Engine,
    requests: list[tuple[str, list[int], SamplingParams]],
    totals: DemoTotals,
    elapsed: float,
) -> None:
    stats = engine.stats
    pool_tokens = stats.num_gpu_blocks * stats.block_size
    utilisation = totals.utilisation_sum / max(totals.utilisation_samples, 1)
    slab_exact = _slab_concurrency(
        pool_tokens, [(len(p), s.max_tokens or 0, s.n) for _, p, s in requests], None
    )
    slab_worst = _slab_concurrency(
        pool_tokens, [(len(p), 0, s.n) for _, p, s in requests], engine.max_model_len
    )
    table = Table(title="Where the KV memory went", show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    table.add_row(
        "KV pool", f"{stats.num_gpu_blocks} blocks x {stats.block_size} tokens = {pool_tokens}"
    )
    table.add_row("KV utilisation", f"{utilisation:.1%} of held block slots hold tokens (mean)")
    table.add_row("peak concurrency", f"{totals.peak_running} sequences running at once")
    table.add_row("prefix cache", f"{stats.prefix_hit_tokens} prompt tokens not recomputed")
    table.add_row("forks", f"up to {totals.peak_shared_blocks} blocks shared at once")
    table.add_row(
        "preemptions",
        f"{stats.num_swap_preemptions} swap, {stats.num_recompute_preemptions} recompute",
    )
    table.add_row(
        "throughput",
        f"{stats.generation_tokens_total} tokens in {elapsed:.1f} s = "
        f"{stats.generation_tokens_total / elapsed:.1f} tokens/s",
    )
    table.add_row(
        "slab allocator, same pool",
        f"{slab_exact} sequences at once reserving prompt + max_tokens; "
        f"{slab_worst} reserving max_model_len ({engine.max_model_len})",
    )
    console.print(table)


def _slab_concurrency(
    pool_tokens: int, requests: list[tuple[int, int, int]], reserve_len: int | None
) -> int:
    """Sequences a first-fit slab allocator admits, in arrival order, before one does not fit."""
    slab = SlabAllocator(pool_tokens)
    admitted = 0
    for index, (prompt_len, max_tokens, n) in enumerate(requests):
        size = reserve_len if reserve_len is not None else prompt_len + max_tokens
        for sample in range(n):
            try:
                slab.reserve((index, sample), size)
            except NoContiguousSpace:
                return admitted
            admitted += 1
    return admitted
