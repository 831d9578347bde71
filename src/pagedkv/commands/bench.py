"""`pagedkv bench`: engine throughput against transformers (the code: pagedkv.bench)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Workload, rounds, systems and KV budget flags, then every engine flag."""
    from pagedkv.bench.main import add_arguments as add_bench_arguments

    add_bench_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print its tables; 1 if a system's token count is wrong."""
    from pagedkv.bench.main import run as run_bench

    return run_bench(args)
