"""The benchmark's workloads: seeded prompts of random lengths, each with an exact output length.

Lengths are drawn from inclusive ranges so that a workload is never all the easy case: `mixed`
spreads its outputs over 16-512 tokens, which is where contiguous reservation loses most.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkloadSpec:
    """How many prompts, and the ranges (inclusive) their lengths and outputs are drawn from."""

    num_prompts: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]


WORKLOADS: dict[str, WorkloadSpec] = {
    "uniform": WorkloadSpec(32, (32, 256), (128, 128)),
    "mixed": WorkloadSpec(48, (32, 256), (16, 512)),
}


@dataclass(frozen=True)
class Workload:
    """Seeded prompts (token ids) and each request's exact output length."""

    name: str
    spec: WorkloadSpec
    seed: int
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def requested_tokens(self) -> int:
        """Tokens the workload asks for: the useful output of every system."""
        return sum(self.output_lens)

    @property
    def max_request_tokens(self) -> int:
        """The longest a request could be: max prompt + max output of the spec."""
        return self.spec.prompt_len[1] + self.spec.output_len[1]

    def describe(self) -> str:
        """One line: counts and ranges."""
        spec = self.spec
        return (
            f"{self.name}: {spec.num_prompts} prompts of {_range(spec.prompt_len)} tokens, "
            f"outputs {_range(spec.output_len)} (ignore_eos, greedy), seed {self.seed}; "
            f"{sum(map(len, self.prompts))} prompt tokens, {self.requested_tokens} to generate"
        )


def make_workload(name: str, spec: WorkloadSpec, vocab_size: int, seed: int) -> Workload:
    """Random prompts over ids [3, vocab_size) (clear of the usual specials) and output lengths."""
    rng = random.Random(f"{name}:{seed}")
    low = min(3, vocab_size - 1)
    prompts, output_lens = [], []
    for _ in range(spec.num_prompts):
        length = rng.randint(*spec.prompt_len)
        prompts.append([rng.randrange(low, vocab_size) for _ in range(length)])
        output_lens.append(rng.randint(*spec.output_len))
    return Workload(name, spec, seed, prompts, output_lens)


def _range(bounds: tuple[int, int]) -> str:
    low, high = bounds
    return str(low) if low == high else f"{low}-{high}"
