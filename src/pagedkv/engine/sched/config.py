"""SchedulerConfig: the scheduler's settings, resolved once from the engine's arguments."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.worker.step import PreemptionMode


@dataclass(frozen=True)
class SchedulerConfig:
    """How much one step runs and who gives way (vLLM's names).

    `preemption_mode` is resolved: "swap" when swap space is configured unless set otherwise
    (`EngineArgs.resolved_preemption_mode`). `policy` names a `sched.policy` policy.
    `num_speculative_tokens` is the most drafts a sample verifies in a step (0: no speculation).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    preemption_mode: PreemptionMode = "recompute"
    policy: str = "fcfs"
    num_speculative_tokens: int = 0
