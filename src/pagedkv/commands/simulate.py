"""`pagedkv simulate`: one request stream, one pool, four allocation schemes, side by side.

Runs the workload through (a) slab at max_model_len, (b) slab at prompt + max_tokens,
(c) paged and (d) paged with prefix caching and forks; then the utilisation-vs-batch-size
sweep; then, with a shared system prompt, what sharing it saves.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pagedkv.commands.arguments import (
    fraction,
    non_negative_int,
    positive_float,
    positive_gb,
    positive_int,
    token_counts,
)
from pagedkv.kvmath.presets import MODEL_PRESETS, Model, load_model
from pagedkv.kvmath.spec import DTYPE_BYTES, GB, ConfigError, format_bytes
from pagedkv.sim.report import SchemeSummary, summarize
from pagedkv.sim.schemes import SCHEME_LABELS, make_scheme
from pagedkv.sim.sharing import SharingReport, shared_prompt_blocks
from pagedkv.sim.simulator import SimResult, SimulationError, simulate
from pagedkv.sim.sweep import SweepPoint, fillable_batch_sizes, utilisation_by_batch_size
from pagedkv.sim.workloads import (
    WORKLOADS,
    Request,
    WorkloadError,
    generate_requests,
    load_trace,
    workload,
)

DEFAULT_BATCH_SIZES = "10,25,50,100,200"
_SHORT = {
    "slab-max": "(a) slab",
    "slab-exact": "(b) slab",
    "paged": "(c) paged",
    "paged-shared": "(d) paged",
}
SHARING_SEQUENCES = 10
# The simulator builds every block of the pool as an object: past this, a pool costs
# gigabytes and minutes before the first step.
MAX_POOL_BLOCKS = 2_000_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare `pagedkv simulate`'s options."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--workload",
        choices=list(WORKLOADS),
        default="tutorial",
        help="built-in request mix (default tutorial)",
    )
    source.add_argument(
        "--trace", type=Path, help="JSONL: prompt_len, output_len[, prefix_id, prefix_len, n]"
    )
    parser.add_argument(
        "--model",
        help=f"preset ({', '.join(MODEL_PRESETS)}), config.json or model folder; "
        "default gpt-tutorial for the tutorial workload, llama-3.1-8b otherwise",
    )
    parser.add_argument("--kv-dtype", choices=sorted(DTYPE_BYTES), help="default: the config's")
    parser.add_argument(
        "--pool-gb", type=positive_gb, default=40.0, help="KV pool in GB (default 40)"
    )
    parser.add_argument("--block-size", type=positive_int, default=16, help="tokens per block")
    parser.add_argument(
        "--num-requests", type=positive_int, default=200, help="requests to draw (default 200)"
    )
    parser.add_argument(
        "--rate", type=positive_float, help="Poisson arrivals per step (default: all at step 0)"
    )
    parser.add_argument(
        "--system-prompt",
        type=non_negative_int,
        default=0,
        metavar="P",
        help="prepend a shared P-token system prompt (prefix caching can share it)",
    )
    parser.add_argument(
        "--shared-fraction",
        type=fraction,
        default=1.0,
        help="fraction of requests carrying the system prompt (default 1)",
    )
    parser.add_argument("--n", type=positive_int, default=1, help="parallel samples per request")
    parser.add_argument(
        "--max-model-len", type=positive_int, help="context for --trace (default: the model's)"
    )
    parser.add_argument(
        "--max-running", type=positive_int, default=256, help="requests running at most"
    )
    parser.add_argument(
        "--batch-sizes",
        type=token_counts,
        default=token_counts(DEFAULT_BATCH_SIZES),
        help=f"batch sizes of the utilisation sweep (default {DEFAULT_BATCH_SIZES})",
    )
    parser.add_argument("--seed", type=non_negative_int, default=0, help="random seed (default 0)")
    parser.add_argument("--plot", type=Path, metavar="DIR", help="write PNG figures to DIR")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def run(args: argparse.Namespace) -> int:
    """Simulate, print the comparison, write plots; bad input is a one-line error, exit 2."""
    try:
        model, requests, max_model_len = _inputs(args)
        num_blocks = _pool_blocks(args, model)
        if args.plot is not None:
            _check_plot_folder(args.plot)
        sweep_requests = _sweep_requests(args, requests)
        batch_sizes = fillable_batch_sizes(args.batch_sizes, len(sweep_requests))
        with _progress() as progress:
            results = [
                _run_scheme(progress, name, requests, num_blocks, args, max_model_len)
                for name in SCHEME_LABELS
            ]
            sweep = _run_sweep(progress, sweep_requests, batch_sizes, args, max_model_len)
        sharing = None
        if args.system_prompt:
            sharing = shared_prompt_blocks(
                SHARING_SEQUENCES,
                args.system_prompt,
                args.block_size,
                model.spec.bytes_per_block(args.block_size),
            )
        summaries = [summarize(result) for result in results]
        plots = _write_plots(args, requests, num_blocks, max_model_len, results, sweep)
    except (ConfigError, WorkloadError, SimulationError) as exc:
        print(f"pagedkv simulate: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(
            json.dumps(
                _as_json(args, model, num_blocks, summaries, sweep, sharing, plots), indent=2
            )
        )
    else:
        _print_report(Console(), args, model, requests, num_blocks, summaries, sweep, sharing)
        for path in plots:
            print(f"wrote {path}")
    return 0


def _inputs(args: argparse.Namespace) -> tuple[Model, list[Request], int]:
    """The model, the request stream and the context it is served with."""
    default_model = "gpt-tutorial" if args.workload == "tutorial" and not args.trace else None
    model = load_model(args.model or default_model or "llama-3.1-8b", args.kv_dtype)
    if args.trace:
        max_model_len = args.max_model_len or model.spec.max_model_len
        if max_model_len is None:
            raise ConfigError(f"{model.name} names no context; give --max-model-len")
        requests = load_trace(args.trace, max_model_len, seed=args.seed, rate=args.rate)
        return model, requests, max_model_len
    if args.max_model_len:
        raise ConfigError(f"--max-model-len is for --trace; workload {args.workload} fixes its own")
    max_model_len = workload(args.workload).max_model_len
    context = model.spec.max_model_len
    if context is not None and max_model_len > context:
        raise ConfigError(
            f"workload {args.workload} needs a {max_model_len:,}-token context, "
            f"{model.name} has {context:,}; choose another --model"
        )
    return model, _generate(args, args.num_requests, args.rate), max_model_len


def _generate(args: argparse.Namespace, count: int, rate: float | None) -> list[Request]:
    """`count` requests of the workload; the seed fixes their lengths, whatever the rate."""
    return generate_requests(
        workload(args.workload),
        count,
        seed=args.seed,
        rate=rate,
        system_prompt=args.system_prompt,
        shared_fraction=args.shared_fraction,
        n=args.n,
    )


def _pool_blocks(args: argparse.Namespace, model: Model) -> int:
    """Blocks in a pool of `--pool-gb`: at least one, and few enough to build."""
    bytes_per_block = model.spec.bytes_per_block(args.block_size)
    num_blocks = int(args.pool_gb * GB) // bytes_per_block
    if num_blocks == 0:
        raise ConfigError(
            f"a {args.pool_gb:g} GB pool holds no block of {model.name}: one block of "
            f"{args.block_size:,} tokens is {format_bytes(bytes_per_block)}"
        )
    if num_blocks > MAX_POOL_BLOCKS:
        raise ConfigError(
            f"a {args.pool_gb:g} GB pool is {num_blocks:,} blocks of {args.block_size:,} tokens "
            f"of {model.name}; the simulator builds at most {MAX_POOL_BLOCKS:,}: give a smaller "
            "--pool-gb or a larger --block-size"
        )
    return num_blocks


def _check_plot_folder(folder: Path) -> None:
    """Fail before simulating, not after: `--plot` must be, or become, a writable folder."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"--plot {folder} is a file, not a folder") from None
    except OSError as exc:
        raise ConfigError(f"--plot {folder}: cannot create the folder ({exc.strerror})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"--plot {folder}: the folder is not writable")


def _sweep_requests(args: argparse.Namespace, requests: list[Request]) -> list[Request]:
    """The stream the sweep takes its batches from: a trace as it is; for a workload, enough
    requests for the largest batch (each batch arrives at once, so arrival times do not
    matter)."""
    if args.trace or len(requests) >= max(args.batch_sizes):
        return requests
    return _generate(args, max(args.batch_sizes), rate=None)


def _progress() -> Progress:
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


def _run_scheme(
    progress: Progress,
    name: str,
    requests: list[Request],
    num_blocks: int,
    args: argparse.Namespace,
    max_model_len: int,
    snapshot_step: int | None = None,
) -> SimResult:
    total = sum(request.n * request.output_len for request in requests)
    task = progress.add_task(SCHEME_LABELS[name], total=total)
    result = simulate(
        requests,
        make_scheme(name, num_blocks, args.block_size, max_model_len),
        max_running=args.max_running,
        snapshot_step=snapshot_step,
        on_step=lambda tokens: progress.advance(task, tokens),
    )
    progress.remove_task(task)
    return result


def _run_sweep(
    progress: Progress,
    requests: list[Request],
    batch_sizes: list[int],
    args: argparse.Namespace,
    max_model_len: int,
) -> list[SweepPoint]:
    schemes = ("slab-max", "paged")
    total = len(schemes) * sum(
        request.n * request.output_len for size in batch_sizes for request in requests[:size]
    )
    task = progress.add_task("utilisation vs batch size", total=total)
    points = utilisation_by_batch_size(
        requests,
        batch_sizes,
        block_size=args.block_size,
        max_model_len=max_model_len,
        schemes=schemes,
        on_step=lambda tokens: progress.advance(task, tokens),
    )
    progress.remove_task(task)
    return points


def _write_plots(
    args: argparse.Namespace,
    requests: list[Request],
    num_blocks: int,
    max_model_len: int,
    results: list[SimResult],
    sweep: list[SweepPoint],
) -> list[Path]:
    """Write the three figures; the memory maps rerun (a) and (d) to catch one common step.

    The step is where (d) holds the most memory: the busiest moment of the paged pool.
    """
    if args.plot is None:
        return []
    from pagedkv.sim import plots  # matplotlib is slow to import: only when plotting

    by_name = {result.scheme: result for result in results}
    step = by_name["paged-shared"].peak_held_step
    with _progress() as progress:
        maps = [
            _run_scheme(progress, name, requests, num_blocks, args, max_model_len, step).memory_map
            for name in ("slab-max", "paged-shared")
        ]
    try:
        return [
            plots.plot_utilisation_vs_batch_size(
                sweep, args.plot / "utilisation_vs_batch_size.png"
            ),
            plots.plot_concurrency(results, args.plot / "concurrency_over_time.png"),
            plots.plot_memory_maps(maps, args.plot / "memory_map.png"),
        ]
    except OSError as exc:
        raise ConfigError(f"--plot {args.plot}: cannot write a figure ({exc})") from None


def _print_report(
    console: Console,
    args: argparse.Namespace,
    model: Model,
    requests: list[Request],
    num_blocks: int,
    summaries: list[SchemeSummary],
    sweep: list[SweepPoint],
    sharing: SharingReport | None,
) -> None:
    spec = model.spec
    source = str(args.trace) if args.trace else f"workload {args.workload}"
    arrivals = f"Poisson {args.rate:g}/step" if args.rate else "at step 0"
    prompt_mean = sum(request.prompt_len for request in requests) / len(requests)
    output_mean = sum(request.output_len for request in requests) / len(requests)
    console.print(
        f"[bold]{source}[/]: {len(requests):,} requests {arrivals}; mean "
        f"{prompt_mean:,.0f} prompt + {output_mean:,.0f} output tokens"
    )
    if not args.trace:
        console.print(f"  {workload(args.workload).description}", style="dim", highlight=False)
    pool_bytes = num_blocks * spec.bytes_per_block(args.block_size)
    console.print(
        f"[bold]{model.name}[/]: {spec.bytes_per_token:,} B/token; pool {format_bytes(pool_bytes)}"
        f" = {num_blocks:,} blocks of {args.block_size}"
    )
    if spec.sliding_window:
        console.print(
            f"[yellow]note[/]: {model.name} has a {spec.sliding_window:,}-token sliding window; "
            "the simulator keeps every token (pagedkv.memory does not drop blocks outside it)"
        )
    console.print()
    console.print(_scheme_table(summaries))
    stats = next(summary for summary in summaries if summary.scheme == "paged-shared").stats
    _notes(
        console,
        ", ".join(list(SCHEME_LABELS.values())[:2]),
        ", ".join(list(SCHEME_LABELS.values())[2:]) + " (prefix caching, forks)",
        "utilisation = token state / held KV memory; mean = over every step;",
        "  at completion = each request at its largest; peak = the fullest step",
        "waste, saved by sharing = time-averaged share of the pool",
        f"(d): {stats['prefix_hit_tokens']:,} of {stats['prefix_queried_tokens']:,} prompt "
        "tokens hit the prefix cache;",
        f"     {stats['cow_copies']:,} blocks copied on write",
    )
    console.print(_sweep_table(sweep))
    _notes(
        console,
        "each batch arrives at once into a pool of batch x max_model_len tokens",
        "at completion = each request at its largest: token state / memory held then;",
        "mean = averaged over every step",
        *_left_out_notes(args, sweep, len(requests)),
    )
    if sharing is not None:
        console.print(_sharing_table(sharing))
        _notes(
            console,
            f"blocks of {sharing.block_size} tokens, "
            f"{format_bytes(sharing.bytes_per_block)} each on {model.name}",
            f"prefix caching ({sharing.num_sequences} separate requests) shares full blocks "
            "only: each",
            "  request keeps its own partial last block",
            f"fork (1 request, n={sharing.num_sequences}: parallel sampling) shares that block "
            "too, until",
            "  each sample's first token copies it on write",
        )


def _left_out_notes(
    args: argparse.Namespace, sweep: list[SweepPoint], num_requests: int
) -> list[str]:
    """Batch sizes the stream (a trace: a workload draws enough) was too short to fill."""
    left_out = _left_out(args, sweep)
    if not left_out:
        return []
    sizes = ", ".join(f"{size:,}" for size in left_out)
    notes = [f"batch sizes {sizes} left out: the trace has only {num_requests:,} requests"]
    if sweep[0].batch_size not in args.batch_sizes:
        notes.append(f"swept at {sweep[0].batch_size:,} instead, the whole trace")
    return notes


def _left_out(args: argparse.Namespace, sweep: list[SweepPoint]) -> list[int]:
    swept = {point.batch_size for point in sweep}
    return [size for size in args.batch_sizes if size not in swept]


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
            f"prefix caching: {sequences} requests",
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


def _as_json(
    args: argparse.Namespace,
    model: Model,
    num_blocks: int,
    summaries: list[SchemeSummary],
    sweep: list[SweepPoint],
    sharing: SharingReport | None,
    plots: list[Path],
) -> dict[str, object]:
    return {
        "source": str(args.trace) if args.trace else args.workload,
        "description": None if args.trace else workload(args.workload).description,
        "model": model.name,
        "spec": model.spec.to_dict(),
        "block_size": args.block_size,
        "num_blocks": num_blocks,
        "pool_bytes": num_blocks * model.spec.bytes_per_block(args.block_size),
        "schemes": [summary.to_dict() for summary in summaries],
        "batch_sweep": [
            {
                "batch_size": point.batch_size,
                "scheme": point.scheme,
                "utilisation_at_completion": point.utilisation_at_completion,
                "mean_utilisation": point.mean_utilisation,
                "peak_utilisation_over_time": point.peak_utilisation_over_time,
            }
            for point in sweep
        ],
        "batch_sizes_left_out": _left_out(args, sweep),
        "sharing": sharing.to_dict() if sharing else None,
        "plots": [str(path) for path in plots],
    }
