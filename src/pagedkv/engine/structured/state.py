"""GrammarState: where one sample is in its grammar, advanced with every token it keeps.

Each sample owns one (n > 1 forks start each sample from the compiled grammar's start, so
they diverge freely). The state lives on the `Sequence`, so it survives preemption: a
recomputed or swapped sample keeps its tokens and its state, and recomputing its KV samples
nothing new, so the state is neither replayed nor rolled back. The matcher is copied from the
compiled grammar when the sample first samples: the scheduler admits a request only once its
grammar is compiled, so that copy never waits. Speculative drafts are checked against the state
(`valid_prefix`) and masked from copies of it (`advanced`): the sample's own state only ever
advances over tokens it keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import llguidance


class GrammarState:
    """One sample's matcher over its grammar."""

    def __init__(self, new_matcher: Callable[[], llguidance.LLMatcher]) -> None:
        """`new_matcher()`: a matcher at the grammar's start (the compiled grammar's copy)."""
        self._new_matcher = new_matcher
        self._matcher: llguidance.LLMatcher | None = None

    @property
    def matcher(self) -> llguidance.LLMatcher:
        """The sample's llguidance matcher (what the sampler's mask is computed from)."""
        if self._matcher is None:
            self._matcher = self._new_matcher()
        return self._matcher

    def accept(self, token_id: int) -> None:
        """Advance over a sampled token. Masked sampling picks only tokens the grammar allows,
        unless the request's other constraints masked those too (then the grammar `failed`)."""
        self.matcher.consume_token(token_id)

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of `token_ids` the grammar would take in a row from here
        (speculative drafts past the first it refuses are never verified); nothing changes."""
        return self.matcher.validate_tokens(list(token_ids))

    def advanced(self, token_ids: Sequence[int]) -> GrammarState:
        """A copy of this state past `token_ids`, which the grammar allows (what masks the
        position after a run of drafts); this state is unchanged."""
        copy = GrammarState(self._new_matcher)
        copy._matcher = self.matcher.deep_copy()
        copy._matcher.consume_tokens(list(token_ids))
        return copy

    @property
    def finished(self) -> bool:
        """True when the grammar allows nothing more (complete, or failed): the sample ends."""
        return self.matcher.is_stopped() or self.matcher.is_error()

    @property
    def failed(self) -> bool:
        """True once a token the grammar refuses was taken (nothing it allows was left: e.g.
        allowed_token_ids or bad_words excluding all of it), or llguidance itself failed."""
        return self.matcher.is_error()

    @property
    def error(self) -> str:
        """Once `failed`, llguidance's reason (its first line): the token it refused, or a
        limit the grammar passed (e.g. more than 2,000 items in one parser row: a choice of
        thousands of strings, an object with thousands of properties)."""
        return (self.matcher.get_error() or "").split("\n", 1)[0]
