"""SpecDecodingStats: what speculative decoding drafted and kept, counted as vLLM counts it."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Counters since the engine started (vLLM's `spec_decode_*` metrics).

    `num_speculative_tokens`: the configured k, 0 when speculation is off; `num_drafts`:
    verification steps of one sequence with at least one draft; `num_draft_tokens`: drafted
    tokens verified; `num_accepted_tokens`: drafts kept; `accepted_per_position[i]`: how often
    the draft at position i (0: the first after the sequence's last token) was kept, one entry
    per position from the start (as vLLM's per-position counter has a series for each of its k
    positions before any draft, so a dashboard's rate per position never lacks one).
    """

    num_speculative_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    @property
    def enabled(self) -> bool:
        """Whether the engine speculates (vLLM exports these metrics only then)."""
        return self.num_speculative_tokens > 0

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One sequence's step verified `num_draft_tokens` drafts (at most k) and kept the
        first `num_accepted`."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def snapshot(self) -> SpecDecodingStats:
        """A copy that later steps do not change."""
        return SpecDecodingStats(
            self.num_speculative_tokens,
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.accepted_per_position),
        )

    @property
    def acceptance_rate(self) -> float:
        """Share of drafted tokens kept (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification step produced on average: the kept drafts plus the one token
        sampled after them (vLLM's mean acceptance length); 0 before any draft."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def since(self, earlier: SpecDecodingStats) -> SpecDecodingStats:
        """What was drafted and kept after `earlier`, a snapshot of these counters."""
        return self._combined(earlier, operator.sub)

    def __add__(self, other: SpecDecodingStats) -> SpecDecodingStats:
        """Both runs' counts together (runs of one engine: the same k)."""
        return self._combined(other, operator.add)

    def _combined(
        self, other: SpecDecodingStats, op: Callable[[int, int], int]
    ) -> SpecDecodingStats:
        """Every counter of this and `other` put through `op`."""
        positions = zip(self.accepted_per_position, other.accepted_per_position, strict=True)
        return SpecDecodingStats(
            self.num_speculative_tokens,
            op(self.num_drafts, other.num_drafts),
            op(self.num_draft_tokens, other.num_draft_tokens),
            op(self.num_accepted_tokens, other.num_accepted_tokens),
            [op(a, b) for a, b in positions],
        )

    def describe(self) -> str:
        """One line for the commands' figures and the benchmark: the acceptance rate and the
        mean accepted length (or that nothing was verified: speculation was on all the same)."""
        if not self.num_drafts:
            return "speculative decoding: no drafts verified"
        plural = "s" if self.num_drafts != 1 else ""
        return (
            f"speculative decoding: {self.num_drafts} verification{plural} of "
            f"{self.num_draft_tokens} drafted tokens; acceptance rate {self.acceptance_rate:.1%}, "
            f"mean accepted length {self.mean_accepted_length:.2f}"
        )

    def as_dict(self) -> dict[str, object]:
        """The counters with the acceptance rate and the mean accepted length, for JSON."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
        }
