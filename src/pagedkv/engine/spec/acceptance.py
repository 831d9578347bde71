"""How many drafts pay: each sequence's acceptance, weighed against what a row of a step costs.

A drafted token costs a row of the step's forward pass whether or not it is kept. Draft i of
a sequence (i = 1, 2, ...) is kept only if the i - 1 before it were, so with a per-draft
acceptance probability `a` it yields `a ** i` tokens on average. A row costs `per_row`
seconds, and a token of a plain decode step of B sequences costs `(fixed + per_row * B) / B`.
Draft i pays while `a ** i * token_seconds >= per_row`, i.e. while

    a ** i >= per_row * B / (fixed + per_row * B)          (`StepCost.threshold`)

and never below `MIN_THRESHOLD`, whatever the fit.

At batch 1, where a step mostly reads weights, rows are cheap and drafts with a fair chance
pay; with many sequences a step is mostly arithmetic, and only near-certain drafts do.

`Acceptance` estimates `a` per sequence from its recent verifications (kept drafts against
refusals, decayed). A sequence whose first draft would not pay stops drafting for a while, then
verifies one draft to measure again, and waits twice as long each time that one fails too (up
to `MAX_PAUSE_STEPS`). `StepCost` fits `fixed` and `per_row` to the engine's own steps (seconds
against rows, least squares over the recent ones; decode steps only, once there are enough), so
the rule follows the machine and model.
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight of the past in each running estimate, per verification (Acceptance) or step (StepCost).
DECAY = 0.8
STEP_DECAY = 0.98
FIRST_PAUSE_STEPS = 4
MAX_PAUSE_STEPS = 64
# Before the engine has timed steps of different sizes: a row costs a quarter of a step.
DEFAULT_ROW_SHARE = 0.25
# The least chance of being kept a draft needs, whatever the fit: a row is never free (its
# logits, its sampling, its bookkeeping), though on a loaded machine timing noise can hide its
# cost and fit 0 seconds a row, which would keep a sequence whose drafts are all refused
# drafting for ever.
MIN_THRESHOLD = 0.05


@dataclass
class Acceptance:
    """One sequence's recent drafts: kept and refused (decayed counts), and its pause."""

    kept: float = 2.0  # prior: two kept for one refused (a = 2/3) until it has drafted
    refused: float = 1.0
    paused_steps: int = 0  # steps left without drafts
    next_pause: int = FIRST_PAUSE_STEPS
    probing: bool = False  # the first drafting step after a pause: verify one draft anyway

    @property
    def rate(self) -> float:
        """Estimated probability that a draft is kept, given the ones before it were."""
        return self.kept / (self.kept + self.refused)

    @property
    def drafting(self) -> bool:
        """Whether the sequence drafts for its next step."""
        return self.paused_steps == 0

    def drafts_to_verify(self, threshold: float, available: int) -> int:
        """How many of its `available` drafts pay at `threshold` (StepCost.threshold); none
        starts a pause, except that a probe after a pause verifies one."""
        count, chance = 0, 1.0
        while count < available and chance * self.rate >= threshold:
            chance *= self.rate
            count += 1
        if count == 0 and available:
            if self.probing:
                count = 1
            else:
                self.paused_steps = self.next_pause
                self.next_pause = min(2 * self.next_pause, MAX_PAUSE_STEPS)
        self.probing = False
        return count

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """A step verified `num_drafts` drafts and kept the first `num_accepted`."""
        self.kept = DECAY * self.kept + num_accepted
        self.refused = DECAY * self.refused + (num_accepted < num_drafts)
        if num_accepted:
            self.next_pause = FIRST_PAUSE_STEPS

    def step_without_drafts(self) -> None:
        """A step passed without drafts: a pause runs down, and ends in a probe."""
        if self.paused_steps:
            self.paused_steps -= 1
            self.probing = self.paused_steps == 0


@dataclass
class _LeastSquares:
    """Decayed sums of (rows, seconds) pairs, and the line through them."""

    weight: float = 0.0
    rows: float = 0.0
    seconds: float = 0.0
    rows2: float = 0.0
    cross: float = 0.0

    def record(self, rows: int, seconds: float) -> None:
        self.weight = STEP_DECAY * self.weight + 1
        self.rows = STEP_DECAY * self.rows + rows
        self.seconds = STEP_DECAY * self.seconds + seconds
        self.rows2 = STEP_DECAY * self.rows2 + rows * rows
        self.cross = STEP_DECAY * self.cross + rows * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed, per_row), or None until steps of more than one size were recorded."""
        if not self.weight:
            return None
        mean_rows, mean_seconds = self.rows / self.weight, self.seconds / self.weight
        spread = self.rows2 / self.weight - mean_rows**2
        if spread <= 1e-9 * max(1.0, mean_rows**2):
            return None
        per_row = max(0.0, (self.cross / self.weight - mean_rows * mean_seconds) / spread)
        return max(0.0, mean_seconds - per_row * mean_rows), per_row


class StepCost:
    """Seconds a step takes as `fixed + per_row * rows`, fitted to the steps seen: to the decode
    steps once they came in more than one size (a decode row, like a draft's, goes through the
    LM head and the sampler, where a prompt's rows need no logits and look cheaper), to every
    step until then."""

    def __init__(self) -> None:
        self._decodes = _LeastSquares()
        self._steps = _LeastSquares()

    def record(self, rows: int, seconds: float, decodes_only: bool) -> None:
        """One executed step: its rows (tokens computed), its seconds, and whether its chunks
        were all decodes (a token and its drafts)."""
        self._steps.record(rows, seconds)
        if decodes_only:
            self._decodes.record(rows, seconds)

    def threshold(self, num_sequences: int) -> float:
        """The least chance a draft must have of being kept to pay, in a step of
        `num_sequences` decoding sequences."""
        fixed, per_row = self.fit()
        rows = per_row * max(1, num_sequences)
        return max(MIN_THRESHOLD, rows / (fixed + rows) if fixed + rows > 0 else 0.0)

    def fit(self) -> tuple[float, float]:
        """(fixed, per_row) in seconds; a row a quarter of the fixed part until steps of more
        than one size have been timed."""
        return self._decodes.fit() or self._steps.fit() or (1.0, DEFAULT_ROW_SHARE)
