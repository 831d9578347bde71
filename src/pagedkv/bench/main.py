"""Engine throughput against transformers: one workload, one model, one KV budget, one process.

`run_benchmark` runs a `BenchConfig`: it loads the systems, warms each up, then runs every
workload for a few rounds in alternating order and prints the report. `add_arguments` and
`run` are `pagedkv bench`; `main` is `python bench/engine_bench.py`, the same flags.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from pagedkv.bench.random_model import RANDOM_MODEL, random_model_folder
from pagedkv.bench.report import header, report_workload
from pagedkv.bench.results import EngineFigures, RunResult
from pagedkv.bench.systems import SYSTEM_TITLES, SYSTEMS, BenchConfig, Systems
from pagedkv.bench.workloads import WORKLOADS, make_workload
from pagedkv.engine import EngineArgs
from pagedkv.engine.args import flag_error
from pagedkv.engine.errors import STARTUP_ERRORS
from pagedkv.worker.threads import physical_cores

DEFAULT_KV_TOKENS = 8192  # every system's KV budget unless --kv-tokens or --num-gpu-blocks


def run_benchmark(config: BenchConfig, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every workload; print the tables; return the figures (JSON-ready)."""
    systems = Systems(config)
    out(header(config, systems.num_parameters))
    report: dict[str, Any] = {
        "model": config.model_label,
        "kv_tokens": config.kv_tokens,
        "block_size": config.engine_args.block_size,
        "rounds": config.rounds,
        "workloads": {},
    }
    systems.warm_up()
    for workload in config.workloads:
        results: list[RunResult] = []
        for round_index in range(config.rounds):
            order = config.systems if round_index % 2 == 0 else config.systems[::-1]
            for system in order:
                result = systems.run(system, workload, round_index)
                results.append(result)
                out(
                    f"  round {round_index + 1}  {SYSTEM_TITLES[system]:<34} "
                    f"{result.seconds:8.2f} s  {result.tokens_per_s:9.1f} tok/s"
                )
        report["workloads"][workload.name] = report_workload(workload, results, out)
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench's flags, then the engine's (`EngineArgs.add_cli_args`)."""
    parser.add_argument(
        "--workload",
        choices=[*WORKLOADS, "all"],
        default="all",
        help="uniform: 32 prompts of 32-256 tokens, 128 new; mixed: 48 prompts of 32-256, "
        "outputs 16-512 (default: all, one after the other)",
    )
    parser.add_argument("--rounds", type=positive_int, default=2, help="rounds (default: 2)")
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all)",
    )
    parser.add_argument(
        "--kv-tokens",
        type=positive_int,
        default=None,
        help="KV budget in tokens for every system, whole blocks of --block-size (default: "
        f"{DEFAULT_KV_TOKENS}; or give --num-gpu-blocks)",
    )
    parser.add_argument("--num-prompts", type=positive_int, help="override the workload's count")
    parser.add_argument(
        "--prompt-len", type=positive_int, nargs=2, metavar=("MIN", "MAX"), help="override"
    )
    parser.add_argument(
        "--output-len", type=positive_int, nargs=2, metavar=("MIN", "MAX"), help="override"
    )
    parser.add_argument(
        "--workload-seed", type=int, default=0, help="seed of prompts and lengths (default: 0)"
    )
    parser.add_argument(
        "--cb-page-size",
        type=positive_int,
        default=None,
        help="transformers CB page size in tokens (default: the engine's --block-size)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model=RANDOM_MODEL, swap_space_gb=1.0)
    for action in parser._actions:
        if action.dest == "model":
            action.help = (
                f"{RANDOM_MODEL} (seeded random Llama, made on first use; the default), a "
                "Hugging Face folder, a built-in name such as smollm2-135m-instruct, or a "
                ".gguf file (with --systems pagedkv: transformers loads folders)"
            )


def run(args: argparse.Namespace) -> int:
    """Parse the flags into a `BenchConfig`, run it, print; 1 if a token count is wrong."""
    # The engine's --threads, applied here too so transformers runs on the same count.
    torch.set_num_threads(args.threads or physical_cores())
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        print(
            f"pagedkv bench: error: --systems takes {','.join(SYSTEMS)}, got {args.systems!r}",
            file=sys.stderr,
        )
        return 2
    if args.json and not args.json.resolve().parent.is_dir():  # found out before the run
        print(f"pagedkv bench: error: --json {args.json}: no such directory", file=sys.stderr)
        return 2
    try:
        config = _config(args, systems)
        report = run_benchmark(config)
    except STARTUP_ERRORS as error:  # a bad flag, model or workload (a prompt too long): one line
        print(f"pagedkv bench: error: {flag_error(error)}", file=sys.stderr)
        return 2
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=_json_default))
    wrong = [
        f"{name}/{system}: {useful} useful tokens, {figures['requested_tokens']} requested"
        for name, figures in report["workloads"].items()
        for system, per_system in figures["systems"].items()
        for useful in per_system["useful_tokens"]
        if useful != figures["requested_tokens"]
    ]
    for line in wrong:
        print(f"pagedkv bench: error: token count mismatch: {line}")
    return 1 if wrong else 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python bench/engine_bench.py [flags]`: the same as `pagedkv bench [flags]`."""
    parser = argparse.ArgumentParser(prog="engine_bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def _config(args: argparse.Namespace, systems: list[str]) -> BenchConfig:
    """The benchmark's model, workloads and engine from the flags; one of STARTUP_ERRORS
    names a bad one."""
    model, folder, label, source = _models(args, systems)
    vocab_size = _vocab_size(source)
    workloads = []
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    for name in names:
        spec = WORKLOADS[name]
        if args.num_prompts:
            spec = replace(spec, num_prompts=args.num_prompts)
        if args.prompt_len:
            spec = replace(spec, prompt_len=tuple(sorted(args.prompt_len)))
        if args.output_len:
            spec = replace(spec, output_len=tuple(sorted(args.output_len)))
        workloads.append(make_workload(name, spec, vocab_size, args.workload_seed))
    args.model = model
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.kv_cache_memory is not None:
        raise ValueError(
            "--kv-cache-memory: the benchmark gives every system one KV budget in tokens; "
            "size it with --kv-tokens or --num-gpu-blocks"
        )
    if engine_args.num_gpu_blocks is None:
        kv_tokens = args.kv_tokens or DEFAULT_KV_TOKENS
        engine_args.num_gpu_blocks = max(1, kv_tokens // engine_args.block_size)
    elif args.kv_tokens is not None:
        raise ValueError("give --kv-tokens or --num-gpu-blocks, not both: each sets the budget")
    return BenchConfig(
        engine_args=engine_args,
        hf_folder=None if folder is None else str(folder),
        model_label=label,
        workloads=workloads,
        kv_tokens=engine_args.num_gpu_blocks * engine_args.block_size,
        rounds=args.rounds,
        systems=systems,
        cb_page_size=args.cb_page_size or engine_args.block_size,
        seed=args.seed,
    )


def _models(args: argparse.Namespace, systems: list[str]) -> tuple[str, Path | None, str, Path]:
    """What pagedkv loads (`args.model`), the Hugging Face folder of the same weights in float
    that transformers loads, a label, and the folder or file the vocabulary is read from. A built-in
    model runs in pagedkv as itself (under --quantization auto, its own GGUF blocks); a folder
    runs as it is in both; a .gguf file runs in pagedkv alone (no folder: transformers loads
    folders); a Hub name runs as its folder or file in the Hugging Face cache."""
    model = args.model
    if model == RANDOM_MODEL:
        folder = random_model_folder(args.seed)
        return str(folder), folder, f"{RANDOM_MODEL} (seed {args.seed})", folder
    from pagedkv.weights.load import converted_folder, find_source

    path = find_source(model, args.revision, args.download_dir)
    if path is None:  # a built-in model
        folder = converted_folder(model)
        return model, folder, model, folder
    label = path.name if path == Path(model) else model  # a Hub name: as it was given
    if path.is_dir():
        return model, path, label, path
    transformers = [system for system in systems if system != "pagedkv"]
    if transformers:
        raise ValueError(
            f"{model}: transformers ({', '.join(transformers)}) loads a folder, not a "
            ".gguf file: `pagedkv convert` it to a folder first, or bench the file with "
            "--systems pagedkv (a built-in name is converted on its own)"
        )
    return model, None, label, path


def _vocab_size(source: Path) -> int:
    """The vocabulary the workloads draw token ids from: a folder's config.json, or a GGUF
    file's metadata."""
    if source.is_file():
        from pagedkv.weights.gguf.config import config_dict
        from pagedkv.weights.gguf.file import GGUFFile

        return config_dict(GGUFFile(source))["vocab_size"]
    config_file = source / "config.json"
    try:
        return json.loads(config_file.read_text())["vocab_size"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{config_file}: no vocab_size in valid JSON ({error})") from error


def positive_int(text: str) -> int:
    """argparse type: an integer above zero."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _json_default(value: Any) -> Any:
    if isinstance(value, EngineFigures):
        return asdict(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
