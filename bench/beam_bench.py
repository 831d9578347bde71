"""Beam search memory: the blocks beams hold sharing their common past, against one block
table each, on the built-in model at beam width 4 and 8.

Each search runs on the engine to `--max-tokens` with `ignore_eos` (every width stays full
to the end). After every step the bench reads the pool: blocks held (distinct physical
blocks: what paged memory spends) and the sum of the live beams' block-table lengths (what
the same beams cost with a table of their own each, nothing shared). It prints the peak and
the mean over the steps of both, and how many times fewer blocks sharing holds. Long prompts
are the case beams share most: every beam reads the whole prompt.

Run: .venv/bin/python bench/beam_bench.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

from pagedkv.engine import BeamSearchParams, Engine, EngineArgs
from pagedkv.hub import DEFAULT_MODEL

REQUEST_ID = "beams"


@dataclass
class BeamMemory:
    """Per step of one search: blocks held with sharing, and without (one table per beam)."""

    shared: list[int]
    unshared: list[int]
    seconds: float

    @property
    def saving(self) -> float:
        """How many times fewer blocks sharing holds at the peak."""
        return max(self.unshared) / max(self.shared)


def prompt_ids(length: int, vocab_size: int, seed: int) -> list[int]:
    """A seeded prompt of `length` ordinary token ids (memory depends on the count only)."""
    draw = random.Random(seed)
    return [draw.randrange(3, vocab_size) for _ in range(length)]


def measure(engine: Engine, prompt: list[int], params: BeamSearchParams) -> BeamMemory:
    """Run one search to the end, reading the pool after every step it holds beams."""
    manager = engine.manager
    engine.add_request(REQUEST_ID, prompt, beam_search=params)
    shared: list[int] = []
    unshared: list[int] = []
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        seq_ids = [seq_id for seq_id in manager.seq_ids if seq_id[0] == REQUEST_ID]
        if seq_ids:
            shared.append(manager.num_gpu_blocks - manager.num_free_blocks)
            unshared.append(sum(len(manager.block_table(seq_id)) for seq_id in seq_ids))
    return BeamMemory(shared, unshared, time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--widths", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    block_size = 16
    longest = max(args.prompt_lengths) + args.max_tokens
    num_gpu_blocks = max(args.widths) * -(-longest // block_size)  # a search's worst case
    engine = Engine(
        EngineArgs(model=args.model, num_gpu_blocks=num_gpu_blocks, block_size=block_size)
    )
    print(f"model {args.model}; block size {block_size}; max_tokens {args.max_tokens}")
    print(
        f"{'prompt':>7} {'width':>5} | {'peak shared':>11} {'peak unshared':>13} "
        f"{'saving':>7} | {'mean shared':>11} {'mean unshared':>13} | {'seconds':>7}"
    )
    for length in args.prompt_lengths:
        for width in args.widths:
            # A prompt of its own: no search finds another's prompt in the prefix cache.
            prompt = prompt_ids(length, engine.config.vocab_size, seed=length * 100 + width)
            params = BeamSearchParams(width, args.max_tokens, ignore_eos=True)
            memory = measure(engine, prompt, params)
            print(
                f"{length:>7} {width:>5} | {max(memory.shared):>11} {max(memory.unshared):>13} "
                f"{memory.saving:>6.2f}x | {statistics.mean(memory.shared):>11.1f} "
                f"{statistics.mean(memory.unshared):>13.1f} | {memory.seconds:>7.1f}"
            )


if __name__ == "__main__":
    main()
