"""When a sequence stops drafting: its recent drafts were accepted too rarely to pay.

A drafted token costs a row of the step's forward pass whether or not it is kept. A sequence
whose drafts keep failing (free-form text that repeats nothing, a draft model that disagrees)
pays for rows that buy nothing, so each sequence keeps a decaying average of the share of its
drafts accepted; below `MIN_ACCEPTANCE` it stops drafting for a while, then tries again, and
waits twice as long each time it fails again (up to `MAX_PAUSE_STEPS`). One good step after a
pause resets the wait.
"""

from __future__ import annotations

from dataclasses import dataclass

# Below this share of drafts accepted (recent average), drafting costs more rows than it saves.
MIN_ACCEPTANCE = 0.3
# Weight of the newest step in the average.
NEW_WEIGHT = 0.5
FIRST_PAUSE_STEPS = 4
MAX_PAUSE_STEPS = 64


@dataclass
class Acceptance:
    """One sequence's recent acceptance and how long it still waits before drafting again."""

    rate: float = 1.0  # decaying average share of drafts accepted (optimistic at first)
    paused_steps: int = 0  # steps left without drafts
    next_pause: int = FIRST_PAUSE_STEPS

    @property
    def drafting(self) -> bool:
        """Whether the sequence drafts for its next step."""
        return self.paused_steps == 0

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """A step verified `num_drafts` drafts and kept `num_accepted` of them."""
        self.rate = (1 - NEW_WEIGHT) * self.rate + NEW_WEIGHT * num_accepted / num_drafts
        if self.rate >= MIN_ACCEPTANCE:
            self.next_pause = FIRST_PAUSE_STEPS
            return
        self.paused_steps = self.next_pause
        self.next_pause = min(2 * self.next_pause, MAX_PAUSE_STEPS)
        self.rate = MIN_ACCEPTANCE  # after the pause, one good step lets it go on

    def step_without_drafts(self) -> None:
        """A step passed while paused."""
        self.paused_steps = max(0, self.paused_steps - 1)
