"""Drafters: what proposes each sample's drafts for its next step.

The executor asks once per step, after sampling, for every sample that drew tokens and still
drafts (its recent drafts paid: `acceptance.py`), with the sample's tokens as they will be once
this step's are appended (`propose`). A drafter answers up to `max_drafts` tokens per sample;
the scheduler reserves their slots and verifies them in the sample's next step. A drafter that
needs the model's step to draft (a draft model) answers placeholders and fills them in when
that step starts (`fill`).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from pagedkv.engine.spec.config import SpeculativeConfig
from pagedkv.engine.spec.ngram import propose_ngram
from pagedkv.engine.structured.state import GrammarState
from pagedkv.worker.step import SchedulerOutput

SeqId = tuple[str, int]


@dataclass(frozen=True)
class DraftRequest:
    """One sample to draft for: its tokens (prompt, output and this step's new tokens) and the
    most drafts it may verify."""

    seq_id: SeqId
    token_ids: array
    max_drafts: int


class Drafter(Protocol):
    """Proposes drafts for a step's samples."""

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Drafts per request, in order (an empty list: none for that sample)."""
        ...

    def fill(
        self, output: SchedulerOutput, grammars: Mapping[SeqId, GrammarState]
    ) -> SchedulerOutput:
        """The step as the model runs it: its chunks' drafts as they are to be verified, each
        allowed by its sample's grammar in `grammars` (samples with structured outputs)."""
        ...


class NgramDrafter:
    """Prompt lookup: each sample's drafts come from its own tokens (`ngram.py`)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [
            propose_ngram(request.token_ids, self.min_n, self.max_n, request.max_drafts)
            for request in requests
        ]

    def fill(
        self, output: SchedulerOutput, grammars: Mapping[SeqId, GrammarState]
    ) -> SchedulerOutput:
        """As it is: the drafts were proposed whole (and cut to what the grammar allows when
        their slots were reserved)."""
        return output
