"""What one system's run of a workload produced: tokens and seconds, and pagedkv's own figures.

Only each request's requested tokens count as useful output; a static batch that runs past a
request's length produces tokens that are counted as generated, never as useful.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedkv.engine.spec.metrics import SpecDecodingStats

# The concurrency goal: steps whose forward runs at least this many sequences are the
# busy steps, where the outside-forward share is judged.
GOAL_CONCURRENCY = 32


@dataclass
class RunResult:
    """One system's run of the workload."""

    system: str
    round: int
    seconds: float
    useful_tokens: int  # requested output tokens produced (what counts)
    generated_tokens: int  # every token the system produced, padding batches included
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        """Useful tokens per second."""
        return self.useful_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class EngineFigures:
    """What the pagedkv engine did during one run (from its counters and its runner's clocks)."""

    steps: int = 0
    peak_running: int = 0
    mean_running: float = 0.0
    peak_kv_usage: float = 0.0
    mean_kv_utilisation: float = 0.0  # token state / held block capacity, over the steps
    swap_preemptions: int = 0
    recompute_preemptions: int = 0
    prefix_hit_tokens: int = 0
    step_seconds: float = 0.0
    model_forward_seconds: float = 0.0  # inside the model's forward only
    engine_forward_seconds: float = 0.0  # the engine's own clock: plan + batch + forward
    busy_steps: int = 0  # steps with at least GOAL_CONCURRENCY sequences in the forward
    busy_step_seconds: float = 0.0
    busy_forward_seconds: float = 0.0
    # Speculative decoding's counts over the run (None: off).
    spec: SpecDecodingStats | None = None

    @property
    def outside_forward_share(self) -> float:
        """Share of step time outside the model's forward (scheduling, batch, sampling)."""
        return 1.0 - self.model_forward_seconds / self.step_seconds if self.step_seconds else 0.0

    @property
    def engine_outside_share(self) -> float:
        """The same share by the engine's own forward clock (which counts batch building in)."""
        if not self.step_seconds:
            return 0.0
        return 1.0 - self.engine_forward_seconds / self.step_seconds

    @property
    def busy_outside_share(self) -> float | None:
        """Outside-forward share over the steps running at least GOAL_CONCURRENCY sequences."""
        if not self.busy_steps:
            return None
        return 1.0 - self.busy_forward_seconds / self.busy_step_seconds
