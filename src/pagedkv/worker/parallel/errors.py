"""Errors of a tensor-parallel group: each names the rank that failed."""

from __future__ import annotations


class WorkerFailed(RuntimeError):
    """A tensor-parallel rank died, hung or raised: the engine cannot run another step."""

    def __init__(self, rank: int | None, reason: str) -> None:
        who = "a tensor-parallel rank" if rank is None else f"tensor-parallel rank {rank}"
        super().__init__(f"{who} failed: {reason}; the engine stopped")
        self.rank = rank
