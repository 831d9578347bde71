"""What `pagedkv simulate` shows: progress bars while it simulates, then the comparison as
tables for people or JSON for scripts, and the PNG figures.

The command gathers the inputs and calls these; the simulator itself knows nothing of the
screen (it reports progress through `on_step`). Progress bars go to stderr and only to a
terminal, so piped tables and JSON stay clean. matplotlib is imported only to write figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pagedkv.kvmath.presets import Model
from pagedkv.kvmath.spec import ConfigError, format_bytes
from pagedkv.sim.report import SchemeSummary
from pagedkv.sim.schemes import SCHEME_LABELS, make_scheme
from pagedkv.sim.sharing import SharingReport
from pagedkv.sim.simulator import SimResult, simulate
from pagedkv.sim.sweep import SweepPoint, utilisation_by_batch_size
from pagedkv.sim.workloads import WorkloadRequest, workload

# Column heads of the schemes, short enough for a table.
_SHORT = {
    "slab-max": "(a) slab",
    "slab-exact": "(b) slab",
    "paged": "(c) paged",
    "paged-shared": "(d) paged",
}


@dataclass(frozen=True)
class Comparison:
    """One `pagedkv simulate` run: the stream, the pool, and what each scheme made of them."""

    trace: Path | None  # the trace the requests came from; None for a built-in workload
    workload_name: str  # the built-in workload (when there is no trace)
    rate: float | None  # Poisson arrivals per step; None: all at step 0
    model: Model
    requests: list[WorkloadRequest]
    block_size: int
    num_blocks: int
    batch_sizes: list[int]  # the sweep's sizes as asked for; a short trace fills fewer
    summaries: list[SchemeSummary]
    sweep: list[SweepPoint]
    sharing: SharingReport | None  # only with a shared system prompt
    plots: list[Path]
    # Ranks the KV heads are split across: `model.spec` and the pool are one rank's.
    tensor_parallel_size: int = 1


def progress_bars() -> Progress:
    """Bars on stderr counting generated tokens; disabled off a terminal, gone when done."""
    console = Console(stderr=True)
    return Progress(
        TextColumn("{task.description:<34}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )


def run_scheme(
    progress: Progress,
    name: str,
    requests: list[WorkloadRequest],
    *,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    snapshot_step: int | None = None,
) -> SimResult:
    """Simulate one scheme under a bar of its own, removed when the scheme is done."""
    total = sum(request.n * request.output_len for request in requests)
    task = progress.add_task(SCHEME_LABELS[name], total=total)
    result = simulate(
        requests,
        make_scheme(name, num_blocks, block_size, max_model_len),
        max_num_seqs=max_num_seqs,
        snapshot_step=snapshot_step,
        on_step=lambda tokens: progress.advance(task, tokens),
    )
    progress.remove_task(task)
    return result


def run_sweep(
    progress: Progress,
    requests: list[WorkloadRequest],
    batch_sizes: list[int],
    *,
    block_size: int,
    max_model_len: int,
) -> list[SweepPoint]:
    """The utilisation-vs-batch-size sweep, slab at max_model_len against paged, under one bar."""
    schemes = ("slab-max", "paged")
    total = len(schemes) * sum(
        request.n * request.output_len for size in batch_sizes for request in requests[:size]
    )
    task = progress.add_task("utilisation vs batch size", total=total)
    points = utilisation_by_batch_size(
        requests,
        batch_sizes,
        block_size=block_size,
        max_model_len=max_model_len,
        schemes=schemes,
        on_step=lambda tokens: progress.advance(task, tokens),
    )
    progress.remove_task(task)
    return points


def write_plots(
    folder: Path,
    requests: list[WorkloadRequest],
    results: list[SimResult],
    sweep: list[SweepPoint],
    *,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
) -> list[Path]:
    """Write the three figures; the memory maps rerun (a) and (d) to catch one common step.

    The step is where (d) holds the most memory: the busiest moment of the paged pool.
    """
    from pagedkv.sim import plots  # matplotlib is slow to import: only when plotting

    by_name = {result.scheme: result for result in results}
    step = by_name["paged-shared"].peak_held_step
    with progress_bars() as progress:
        maps = [
            run_scheme(
                progress,
                name,
                requests,
                num_blocks=num_blocks,
                block_size=block_size,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                snapshot_step=step,
            ).memory_map
            for name in ("slab-max", "paged-shared")
        ]
    try:
        return [
            plots.plot_utilisation_vs_batch_size(sweep, folder / "utilisation_vs_batch_size.png"),
            plots.plot_concurrency(results, folder / "concurrency_over_time.png"),
            plots.plot_memory_maps(maps, folder / "memory_map.png"),
        ]
    except OSError as exc:
        raise ConfigError(f"--plot {folder}: cannot write a figure ({exc})") from None


def print_report(comparison: Comparison) -> None:
    """The stream and pool, then the scheme, sweep and sharing tables, each with its notes."""
    console = Console()
    spec = comparison.model.spec
    model_name = comparison.model.name
    requests = comparison.requests
    block_size = comparison.block_size
    source = str(comparison.trace) if comparison.trace else f"workload {comparison.workload_name}"
    arrivals = f"Poisson {comparison.rate:g}/step" if comparison.rate else "at step 0"
    prompt_mean = sum(request.prompt_len for request in requests) / len(requests)
    output_mean = sum(request.output_len for request in requests) / len(requests)
    console.print(
        f"[bold]{source}[/]: {len(requests):,} requests {arrivals}; mean "
        f"{prompt_mean:,.0f} prompt + {output_mean:,.0f} output tokens"
    )
    if not comparison.trace:
        description = workload(comparison.workload_name).description
        console.print(f"  {description}", style="dim", highlight=False)
    pool_bytes = comparison.num_blocks * spec.bytes_per_block(block_size)
    ranks = comparison.tensor_parallel_size
    per_rank = " per rank" if ranks > 1 else ""
    console.print(
        f"[bold]{model_name}[/]: {spec.bytes_per_token:,} B/token{per_rank}; pool "
        f"{format_bytes(pool_bytes)}{per_rank} = {comparison.num_blocks:,} blocks of {block_size}"
    )
    if ranks > 1:
        console.print(
            f"  tensor parallel over {ranks} ranks: each holds {spec.num_kv_heads} KV "
            f"head{'s' if spec.num_kv_heads > 1 else ''} of every block; the blocks are the same "
            "on every rank, so one rank's pool is the simulated pool",
            style="dim",
            highlight=False,
        )
    if spec.sliding_window:
        console.print(
            f"[yellow]note[/]: {model_name} has a {spec.sliding_window:,}-token sliding window; "
            "the simulator keeps every token (pagedkv.memory does not drop blocks outside it)"
        )
    console.print()
    summaries = comparison.summaries
    console.print(_scheme_table(summaries))
    stats = next(summary for summary in summaries if summary.scheme == "paged-shared").stats
    _notes(
        console,
        ", ".join(list(SCHEME_LABELS.values())[:2]),
        ", ".join(list(SCHEME_LABELS.values())[2:]) + " (prefix caching, forks)",
        "utilisation = token state / held KV memory; mean = sums over every step;",
        "  at completion = each request at its largest; peak = the fullest step",
        "waste, saved by sharing = time-averaged share of the pool",
        f"(d): {stats['prefix_hit_tokens']:,} of {stats['prefix_queried_tokens']:,} prompt "
        "tokens looked up hit the prefix cache",
        "     (a preempted request looks its tokens up again);",
        f"     {stats['cow_copies']:,} blocks copied on write",
    )
    console.print(_sweep_table(comparison.sweep))
    _notes(
        console,
        "each batch arrives at once into a pool of batch x max_model_len tokens",
        "at completion = each request at its largest: token state / memory held then;",
        "mean = token state / memory held, both summed over every step",
        *_left_out_notes(comparison),
    )
    sharing = comparison.sharing
    if sharing is not None:
        console.print(_sharing_table(sharing))
        _notes(
            console,
            f"blocks of {sharing.block_size} tokens, "
            f"{format_bytes(sharing.bytes_per_block)} each{per_rank} on {model_name}",
            f"prefix caching ({sharing.num_sequences} separate requests, prefilled in one step)",
            "  shares full blocks only: each keeps its own partial last block; a block is",
            "  shared once a step schedules it, so requests that come in turn share as much",
            f"fork (1 request, n={sharing.num_sequences}: parallel sampling) shares that block "
            "too, until",
            "  each sample's first token copies it on write",
        )
    for path in comparison.plots:
        print(f"wrote {path}")


def as_json(comparison: Comparison) -> dict[str, object]:
    """The same figures as JSON-ready values (the sweep's points flattened, one per scheme)."""
    spec = comparison.model.spec
    return {
        "source": str(comparison.trace) if comparison.trace else comparison.workload_name,
        "description": (
            None if comparison.trace else workload(comparison.workload_name).description
        ),
        "model": comparison.model.name,
        "tensor_parallel_size": comparison.tensor_parallel_size,
        "spec": spec.to_dict(),  # one rank's, under tensor parallelism
        "block_size": comparison.block_size,
        "num_blocks": comparison.num_blocks,
        "pool_bytes": comparison.num_blocks * spec.bytes_per_block(comparison.block_size),
        "schemes": [summary.to_dict() for summary in comparison.summaries],
        "batch_sweep": [
            {
                "batch_size": point.batch_size,
                "scheme": point.scheme,
                "utilisation_at_completion": point.utilisation_at_completion,
                "mean_utilisation": point.mean_utilisation,
                "peak_utilisation_over_time": point.peak_utilisation_over_time,
            }
            for point in comparison.sweep
        ],
        "batch_sizes_left_out": _left_out(comparison),
        "sharing": comparison.sharing.to_dict() if comparison.sharing else None,
        "plots": [str(path) for path in comparison.plots],
    }


def _left_out_notes(comparison: Comparison) -> list[str]:
    """Batch sizes the stream (a trace: a workload draws enough) was too short to fill."""
    left_out = _left_out(comparison)
    if not left_out:
        return []
    sizes = ", ".join(f"{size:,}" for size in left_out)
    num_requests = len(comparison.requests)
    notes = [f"batch sizes {sizes} left out: the trace has only {num_requests:,} requests"]
    swept_size = comparison.sweep[0].batch_size
    if swept_size not in comparison.batch_sizes:
        notes.append(f"swept at {swept_size:,} instead, the whole trace")
    return notes


def _left_out(comparison: Comparison) -> list[int]:
    swept = {point.batch_size for point in comparison.sweep}
    return [size for size in comparison.batch_sizes if size not in swept]


def _notes(console: Console, *lines: str) -> None:
    for line in lines:
        console.print(f"  {line}", style="dim", highlight=False)
    console.print()


def _scheme_table(summaries: list[SchemeSummary]) -> Table:
    table = Table(title="Schemes: same requests, same pool", title_justify="left")
    table.add_column("")
    for summary in summaries:
        table.add_column(_SHORT[summary.scheme], justify="right")
    for metric, cell in (
        ("utilisation, mean", lambda s: f"{s.mean_utilisation:.1%}"),
        ("utilisation, at completion", lambda s: f"{s.utilisation_at_completion:.1%}"),
        ("utilisation, peak over time", lambda s: f"{s.peak_utilisation_over_time:.1%}"),
        ("peak requests running", lambda s: f"{s.peak_running:,}"),
        ("waste: reservation", lambda s: f"{s.reservation_waste:.1%}"),
        ("waste: internal frag.", lambda s: f"{s.internal_fragmentation:.1%}"),
        ("waste: external frag.", lambda s: f"{s.external_fragmentation:.1%}"),
        ("saved by sharing", lambda s: f"{s.sharing_saving:.1%}"),
        ("finished / 1,000 steps", lambda s: f"{s.finished_per_1000_steps:,.1f}"),
        ("mean queueing (steps)", lambda s: f"{s.mean_queue_delay:,.0f}"),
        ("preemptions", lambda s: f"{s.preemptions:,}"),
        ("steps to finish all", lambda s: f"{s.steps:,}"),
    ):
        table.add_row(metric, *(cell(summary) for summary in summaries))
    return table


def _sweep_table(points: list[SweepPoint]) -> Table:
    table = Table(title="Utilisation vs batch size", title_justify="left")
    table.add_column("batch size", justify="right")
    schemes = list(dict.fromkeys(point.scheme for point in points))
    for kind in ("at completion", "mean"):
        for scheme in schemes:
            table.add_column(f"{_SHORT[scheme]}\n{kind}", justify="right")
    for size in dict.fromkeys(point.batch_size for point in points):
        by_scheme = {point.scheme: point for point in points if point.batch_size == size}
        table.add_row(
            f"{size:,}",
            *(f"{by_scheme[scheme].utilisation_at_completion:.1%}" for scheme in schemes),
            *(f"{by_scheme[scheme].mean_utilisation:.1%}" for scheme in schemes),
        )
    return table


def _sharing_table(report: SharingReport) -> Table:
    table = Table(
        title=f"{report.num_sequences} sequences, one {report.prompt_tokens}-token prompt",
        title_justify="left",
    )
    table.add_column("shared by")
    table.add_column("blocks", justify="right")
    table.add_column("saved vs unshared", justify="right")
    after_first = (
        report.unshared_blocks - report.forked_after_first_token_blocks
    ) * report.bytes_per_block
    sequences = report.num_sequences
    for how, blocks, saving in (
        (f"nothing: {sequences} copies", report.unshared_blocks, 0),
        (
            f"prefix caching: {sequences} requests at once",
            report.prefix_cached_blocks,
            report.prefix_cached_bytes_saved,
        ),
        (
            f"fork: 1 request, n={sequences}, prefilled",
            report.forked_blocks,
            report.forked_bytes_saved,
        ),
        ("  the same, after 1st tokens", report.forked_after_first_token_blocks, after_first),
    ):
        table.add_row(how, f"{blocks:,}", format_bytes(saving) if saving else "-")
    return table
