"""MemoryPlan: the block moves a step needs, typed and in the one order that is correct.

The manager releases blocks at once, so within a step a block that `swap_out` is saving can
be the destination of a later copy-on-write or `swap_in`. Correctness therefore depends on
running the moves in the order the manager produced them. A plan keeps that order as a single
list of kind-tagged moves: there are no per-kind lists to run in the wrong order, and the
runner executes one plan per step.

`batches()` groups consecutive moves of one kind so the runner can move them with one indexed
copy each, splitting a run wherever batching would change the result.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum


class MoveKind(Enum):
    """Where a block move reads and writes."""

    COPY = "copy"  # device block -> device block (copy-on-write)
    SWAP_OUT = "swap_out"  # device block -> CPU swap block
    SWAP_IN = "swap_in"  # CPU swap block -> device block


@dataclass(frozen=True, slots=True)
class BlockMove:
    """Copy the whole block `src` (every layer, K and V) to `dst`, as `kind` says."""

    kind: MoveKind
    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class MoveBatch:
    """Moves of one kind that may run as one gather of `srcs` then one scatter to `dsts`."""

    kind: MoveKind
    srcs: list[int]
    dsts: list[int]


@dataclass
class MemoryPlan:
    """Block moves to execute, in order, before the next forward pass."""

    moves: list[BlockMove] = field(default_factory=list)

    @classmethod
    def of(cls, kind: MoveKind, pairs: Iterable[tuple[int, int]]) -> MemoryPlan:
        """A plan of `(src, dst)` pairs all of one kind."""
        return cls([BlockMove(kind, src, dst) for src, dst in pairs])

    def extend(self, other: MemoryPlan) -> None:
        """Append `other`'s moves after this plan's own: they run later."""
        self.moves.extend(other.moves)

    def pairs(self) -> list[tuple[int, int]]:
        """`(src, dst)` of every move, in order (for display and tests)."""
        return [(move.src, move.dst) for move in self.moves]

    def batches(self) -> Iterator[MoveBatch]:
        """Consecutive same-kind moves, grouped so gather-then-scatter equals running in order.

        A run is split where a move reads a block an earlier move of the run wrote (a copy of
        a copy) or writes a block the run already wrote (a destination reused in the step):
        a gather would read the old data, a scatter with repeated indices has no defined winner.
        """
        batch: MoveBatch | None = None
        written: set[int] = set()
        for move in self.moves:
            reads_written = move.kind is MoveKind.COPY and move.src in written
            if batch is None or move.kind is not batch.kind or reads_written or move.dst in written:
                if batch is not None:
                    yield batch
                batch = MoveBatch(move.kind, [], [])
                written = set()
            batch.srcs.append(move.src)
            batch.dsts.append(move.dst)
            written.add(move.dst)
        if batch is not None:
            yield batch

    def __str__(self) -> str:
        """The `(src, dst)` pairs, as the demo prints a one-kind plan; `repr` shows kinds."""
        return str(self.pairs())

    def __bool__(self) -> bool:
        return bool(self.moves)

    def __iter__(self) -> Iterator[BlockMove]:
        return iter(self.moves)

    def __len__(self) -> int:
        return len(self.moves)
