"""`pagedkv demo`: the project's main job, on the built-in model or any `--model`.

By default it serves a mixed batch of real chat requests through the engine with a live view
of the queues and the block pool (`serving_demo`). `--memory` runs the model-free
walk-through of the memory manager instead (`memory_walkthrough`).
"""

from __future__ import annotations

import argparse
import sys

# A pool small enough that the demo's requests contend for it: blocks come and go, forks
# share, and requests sometimes give way. --num-gpu-blocks overrides it.
DEMO_NUM_GPU_BLOCKS = 64
DEMO_SWAP_SPACE_GB = 0.25
DEMO_MAX_TOKENS = 96
DEMO_TEMPERATURE = 0.7


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--memory, the answers' length and temperature, and the engine flags."""
    from pagedkv.engine.args import EngineArgs

    parser.add_argument(
        "--memory",
        action="store_true",
        help="walk through the memory manager step by step instead (no model)",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=DEMO_MAX_TOKENS, help="default: %(default)s"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=DEMO_TEMPERATURE,
        help="for the requests with two samples; the others are greedy (default: %(default)s)",
    )
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(swap_space_gb=DEMO_SWAP_SPACE_GB)


def run(args: argparse.Namespace) -> int:
    """Run the serving demo, or the memory walk-through with --memory."""
    if args.memory:
        from pagedkv.commands.arguments import engine_flags_given
        from pagedkv.commands.memory_walkthrough import run_walkthrough

        given = engine_flags_given(args, defaults={"swap_space_gb": DEMO_SWAP_SPACE_GB})
        given += ["--max-tokens"] if args.max_tokens != DEMO_MAX_TOKENS else []
        given += ["--temperature"] if args.temperature != DEMO_TEMPERATURE else []
        if given:
            print(
                f"pagedkv demo: error: {', '.join(given)} do{'es' if len(given) == 1 else ''} not "
                "apply to --memory (it walks through the memory manager alone, with no model)",
                file=sys.stderr,
            )
            return 2
        return run_walkthrough()
    from rich.console import Console

    from pagedkv.commands.serving_demo import run_serving_demo
    from pagedkv.engine import Engine, EngineArgs
    from pagedkv.engine.args import flag_error
    from pagedkv.engine.errors import STARTUP_ERRORS

    console = Console()
    try:
        console.print(f"Loading {args.model} ...")
        engine_args = EngineArgs.from_cli_args(args)
        if engine_args.num_gpu_blocks is None and engine_args.kv_cache_memory is None:
            engine_args.num_gpu_blocks = DEMO_NUM_GPU_BLOCKS  # a small pool, to show paging
        engine = Engine(engine_args)
        return run_serving_demo(engine, args.max_tokens, args.temperature, console)
    except STARTUP_ERRORS as error:
        print(f"pagedkv demo: error: {flag_error(error)}", file=sys.stderr)
        return 2
