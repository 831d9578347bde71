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
from dataclasses import replace
from pathlib import Path

from pagedkv.commands.arguments import (
    fraction,
    non_negative_int,
    positive_float,
    positive_gb,
    positive_int,
    token_counts,
)
from pagedkv.commands.planning_model import (
    add_device_argument,
    add_hub_arguments,
    add_kv_dtype_arguments,
    kv_dtype_of,
    on_device,
    resolve_planning_model,
)
from pagedkv.kvmath.parallel import check_even_split, per_rank_spec
from pagedkv.kvmath.presets import MODEL_PRESETS, Model
from pagedkv.kvmath.spec import GB, ConfigError, format_bytes
from pagedkv.sim.render import (
    Comparison,
    as_json,
    print_report,
    progress_bars,
    run_scheme,
    run_sweep,
    write_plots,
)
from pagedkv.sim.report import summarize
from pagedkv.sim.schemes import SCHEME_LABELS
from pagedkv.sim.sharing import shared_prompt_blocks
from pagedkv.sim.simulator import SimulationError
from pagedkv.sim.sweep import fillable_batch_sizes
from pagedkv.sim.workloads import (
    WORKLOADS,
    WorkloadError,
    WorkloadRequest,
    generate_requests,
    load_trace,
    workload,
)

DEFAULT_BATCH_SIZES = "10,25,50,100,200"
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
        "--trace",
        type=Path,
        help="JSONL: prompt_len, output_len[, prefix_id, prefix_len, n, max_tokens] (max_tokens, "
        "what (b) reserves past the prompt: the rest of max_model_len when left out)",
    )
    parser.add_argument(
        "--model",
        help=f"preset ({', '.join(MODEL_PRESETS)}), config.json, model folder, .gguf file or a "
        "Hugging Face repo id in the local cache; "
        "default gpt-tutorial for the tutorial workload, llama-3.1-8b otherwise",
    )
    add_hub_arguments(parser)
    add_kv_dtype_arguments(parser)
    add_device_argument(parser)
    parser.add_argument(
        "--pool-gb",
        type=positive_gb,
        default=40.0,
        help="KV pool in GB (default 40); each rank's under --tensor-parallel-size",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        help="ranks the KV heads are split across, as the engine splits them: each rank's pool "
        "holds its share of every block, so a GB holds more blocks (default 1)",
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
        "--max-num-seqs",
        type=positive_int,
        default=256,
        help="sequences a step runs at most, as the engine's (default 256)",
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
        with progress_bars() as progress:
            results = [
                run_scheme(
                    progress,
                    name,
                    requests,
                    num_blocks=num_blocks,
                    block_size=args.block_size,
                    max_model_len=max_model_len,
                    max_num_seqs=args.max_num_seqs,
                )
                for name in SCHEME_LABELS
            ]
            sweep = run_sweep(
                progress,
                sweep_requests,
                batch_sizes,
                block_size=args.block_size,
                max_model_len=max_model_len,
            )
        sharing = None
        if args.system_prompt:
            sharing = shared_prompt_blocks(
                SHARING_SEQUENCES,
                args.system_prompt,
                args.block_size,
                model.spec.bytes_per_block(args.block_size),
            )
        summaries = [summarize(result) for result in results]
        plots = []
        if args.plot is not None:
            plots = write_plots(
                args.plot,
                requests,
                results,
                sweep,
                num_blocks=num_blocks,
                block_size=args.block_size,
                max_model_len=max_model_len,
                max_num_seqs=args.max_num_seqs,
            )
    except (ConfigError, WorkloadError, SimulationError) as exc:
        print(f"pagedkv simulate: error: {exc}", file=sys.stderr)
        return 2
    comparison = Comparison(
        trace=args.trace,
        workload_name=args.workload,
        rate=args.rate,
        model=model,
        requests=requests,
        block_size=args.block_size,
        num_blocks=num_blocks,
        batch_sizes=args.batch_sizes,
        summaries=summaries,
        sweep=sweep,
        sharing=sharing,
        plots=plots,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    if args.json:
        print(json.dumps(as_json(comparison), indent=2))
    else:
        print_report(comparison)
    return 0


def _inputs(args: argparse.Namespace) -> tuple[Model, list[WorkloadRequest], int]:
    """The model, the request stream and the context it is served with."""
    default_model = "gpt-tutorial" if args.workload == "tutorial" and not args.trace else None
    name = args.model or default_model or "llama-3.1-8b"
    kv_dtype = kv_dtype_of(args)
    model = resolve_planning_model(name, kv_dtype, args.revision, args.download_dir)
    model = on_device(model, args.device, kv_dtype_given=kv_dtype is not None)
    if args.tensor_parallel_size > 1:  # one rank's cache: its share of the KV heads
        check_even_split(model.config, args.tensor_parallel_size)
        model = replace(model, spec=per_rank_spec(model.spec, args.tensor_parallel_size))
    if args.trace:
        max_model_len = model.spec.served_context(args.max_model_len)
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


def _generate(args: argparse.Namespace, count: int, rate: float | None) -> list[WorkloadRequest]:
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
    num_blocks = round(args.pool_gb * GB) // bytes_per_block
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


def _sweep_requests(
    args: argparse.Namespace, requests: list[WorkloadRequest]
) -> list[WorkloadRequest]:
    """The stream the sweep takes its batches from: a trace as it is; for a workload, enough
    requests for the largest batch (each batch arrives at once, so arrival times do not
    matter)."""
    if args.trace or len(requests) >= max(args.batch_sizes):
        return requests
    return _generate(args, max(args.batch_sizes), rate=None)
