"""Page-map frames: the KV pool as compact JSON, in full or as the blocks that changed.

The engine thread captures a `KVFrame` (immutable tuples, safe to hand to the event loop) a
few times a second. Each `/v1/kv/stream` connection has its own `KVFrameEncoder`, which sends
one full frame, then only the blocks that changed since the frame it last sent, and a new
full frame every `FULL_FRAME_INTERVAL_S` so its table of request names stays small.

A block is encoded as a flat list `[ref_count, cached, r0, s0, p0, r1, s1, p1, ...]`: one
`(request, sample, position)` triple per holder, `r` indexing the frame's `names`. A delta
entry puts the block id first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedkv.engine import EngineStats, KVSnapshot

FULL_FRAME_INTERVAL_S = 30.0

Holder = tuple[str, int, int]  # request id, sample index, block index in that sequence
Block = tuple[int, bool, tuple[Holder, ...]]  # ref count, cached, holders


@dataclass(frozen=True)
class KVFrame:
    """One moment of the pool: every GPU and CPU block, and the engine's stats."""

    time: float
    block_size: int
    gpu: tuple[Block, ...]
    cpu: tuple[Block, ...]
    stats: dict[str, Any]

    @classmethod
    def capture(cls, snapshot: KVSnapshot, stats: EngineStats) -> KVFrame:
        """Copy what the page map needs out of a snapshot (engine thread)."""
        return cls(
            time=time.time(),
            block_size=snapshot.block_size,
            gpu=tuple(_block(state) for state in snapshot.gpu),
            cpu=tuple(_block(state) for state in snapshot.cpu),
            stats=stats.to_dict(),
        )


def _block(state: Any) -> Block:
    return (
        state.ref_count,
        bool(state.cached),
        tuple((str(r), int(s), int(p)) for r, s, p in state.holders),
    )


class KVFrameEncoder:
    """Turns successive frames into full or delta messages for one stream connection."""

    def __init__(self) -> None:
        self._sent: KVFrame | None = None
        self._sent_full_at = 0.0
        self._names: dict[str, int] = {}

    def encode(self, frame: KVFrame) -> dict[str, Any]:
        """The message for `frame`: `type` "full" or "delta", blocks, new names, stats."""
        sent = self._sent
        full = (
            sent is None
            or len(sent.gpu) != len(frame.gpu)
            or len(sent.cpu) != len(frame.cpu)
            or frame.time - self._sent_full_at >= FULL_FRAME_INTERVAL_S
        )
        if full:
            self._names = {}
            self._sent_full_at = frame.time
        known = len(self._names)
        if full or sent is None:
            gpu = [self._encode(block) for block in frame.gpu]
            cpu = [self._encode(block) for block in frame.cpu]
        else:
            gpu = self._changed(sent.gpu, frame.gpu)
            cpu = self._changed(sent.cpu, frame.cpu)
        self._sent = frame
        new_names = list(self._names)[known:]
        return {
            "type": "full" if full else "delta",
            "time": frame.time,
            "block_size": frame.block_size,
            "num_gpu_blocks": len(frame.gpu),
            "num_cpu_blocks": len(frame.cpu),
            "names": {str(known + i): name for i, name in enumerate(new_names)},
            "gpu": gpu,
            "cpu": cpu,
            "stats": frame.stats,
        }

    def _changed(self, before: tuple[Block, ...], after: tuple[Block, ...]) -> list[list[Any]]:
        return [
            [block_id, *self._encode(block)]
            for block_id, (old, block) in enumerate(zip(before, after, strict=True))
            if old != block
        ]

    def _encode(self, block: Block) -> list[Any]:
        ref_count, cached, holders = block
        encoded: list[Any] = [ref_count, int(cached)]
        for request_id, sample, position in holders:
            index = self._names.setdefault(request_id, len(self._names))
            encoded += (index, sample, position)
        return encoded
