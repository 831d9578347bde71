"""Page-map frames: the KV pool as compact JSON, in full or as the blocks that changed.

A `KVFrame` holds what the page map needs of one `KVSample` (the snapshot and stats the
engine thread took between two steps, handed to each `KVWatch`), as immutable tuples. One
`KVFrameEncoder` turns the successive frames into the one stream of messages every viewer is
sent: a full frame first, then only the blocks that changed since the previous frame, and a
new full frame every `FULL_FRAME_INTERVAL_S` so its table of request names stays small. A
viewer that joins mid-stream (or missed a message) is sent `full_message` of the latest
frame instead, naming every request the next messages may refer to.

A block is encoded as a flat list `[ref_count, cached, r0, s0, p0, r1, s1, p1, ...]`: one
`(request, sample, position)` triple per holder, `r` indexing the stream's table of `names`;
`cached` is 2 for a host-tier block copied back since the previous frame. A delta entry puts
the block id first. The pools are the GPU pool, the CPU swap pool and the host tier. Every
message also lists, as `drafts`, the GPU blocks that hold speculative drafts not yet accepted:
`[block_id, slots]` pairs (few, and whole in every message, so a viewer needs no history),
and, as `adapters`, the runs of GPU blocks that hold LoRA adapters' weights: `[first_block,
blocks, name]`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedkv.engine import EngineStats, KVSnapshot

FULL_FRAME_INTERVAL_S = 30.0


Holder = tuple[str, int, int]  # request id, sample index, block index in that sequence
Block = tuple[int, int, tuple[Holder, ...]]  # ref count, cached (2: hit just now), holders
POOLS = ("gpu", "cpu", "offload")


@dataclass(frozen=True)
class KVFrame:
    """One moment of the pool: every GPU, CPU and host-tier block, and the engine's stats."""

    time: float
    block_size: int
    gpu: tuple[Block, ...]
    cpu: tuple[Block, ...]
    stats: dict[str, Any]
    offload: tuple[Block, ...] = ()
    drafts: tuple[tuple[int, int], ...] = ()  # (GPU block, slots holding drafts)
    adapters: tuple[tuple[int, int, str], ...] = ()  # LoRA runs: (first block, blocks, name)

    @classmethod
    def capture(cls, sample: KVSample) -> KVFrame:
        """Copy what the page map needs out of a sample (O(pool): not on the engine thread)."""
        snapshot = sample.snapshot
        return cls(
            time=sample.time,
            block_size=snapshot.block_size,
            gpu=tuple(_block(state) for state in snapshot.gpu),
            cpu=tuple(_block(state) for state in snapshot.cpu),
            stats=sample.stats.to_dict(),
            offload=tuple(_block(state) for state in snapshot.offload),
            drafts=tuple(
                (state.block_id, state.draft_slots) for state in snapshot.gpu if state.draft_slots
            ),
            adapters=tuple(snapshot.adapters),
        )


def _block(state: Any) -> Block:
    return (
        state.ref_count,
        2 if state.hit else int(bool(state.cached)),
        tuple((str(r), int(s), int(p)) for r, s, p in state.holders),
    )


class KVFrameEncoder:
    """Turns successive frames into the one stream of full and delta messages."""

    def __init__(self) -> None:
        self._sent: KVFrame | None = None
        self._sent_full_at = 0.0
        self._names: dict[str, int] = {}

    @property
    def names(self) -> tuple[str, ...]:
        """The stream's table of request names so far, in index order."""
        return tuple(self._names)

    def encode(self, frame: KVFrame) -> dict[str, Any]:
        """The message for `frame`: `type` "full" or "delta", blocks, new names, stats."""
        sent = self._sent
        full = (
            sent is None
            or any(len(getattr(sent, pool)) != len(getattr(frame, pool)) for pool in POOLS)
            or frame.time - self._sent_full_at >= FULL_FRAME_INTERVAL_S
        )
        if full:
            self._names = {}
            self._sent_full_at = frame.time
        known = len(self._names)
        if full or sent is None:
            pools = {
                pool: [_encode(block, self._names) for block in getattr(frame, pool)]
                for pool in POOLS
            }
        else:
            pools = {
                pool: self._changed(getattr(sent, pool), getattr(frame, pool)) for pool in POOLS
            }
        self._sent = frame
        new_names = list(self._names)[known:]
        return _message(frame, "full" if full else "delta", pools, new_names, known)

    def _changed(self, before: tuple[Block, ...], after: tuple[Block, ...]) -> list[list[Any]]:
        return [
            [block_id, *_encode(block, self._names)]
            for block_id, (old, block) in enumerate(zip(before, after, strict=True))
            if old != block
        ]


def full_message(frame: KVFrame, names: tuple[str, ...]) -> dict[str, Any]:
    """A full message of `frame` for a viewer joining a stream whose table was `names` when
    it encoded `frame`: the whole table comes with it, for the deltas that follow (it holds
    every name the frame uses, each added when its block was first encoded)."""
    index = {name: i for i, name in enumerate(names)}
    pools = {pool: [_encode(block, index) for block in getattr(frame, pool)] for pool in POOLS}
    return _message(frame, "full", pools, list(names), 0)


def _encode(block: Block, names: dict[str, int]) -> list[Any]:
    """A block as a flat list, adding holders not yet in `names` to it."""
    ref_count, cached, holders = block
    encoded: list[Any] = [ref_count, cached]
    for request_id, sample, position in holders:
        encoded += (names.setdefault(request_id, len(names)), sample, position)
    return encoded


def _message(
    frame: KVFrame,
    kind: str,
    pools: dict[str, list[list[Any]]],
    names: list[str],
    first_index: int,
) -> dict[str, Any]:
    return {
        "type": kind,
        "time": frame.time,
        "block_size": frame.block_size,
        "num_gpu_blocks": len(frame.gpu),
        "num_cpu_blocks": len(frame.cpu),
        "num_offload_blocks": len(frame.offload),
        "names": {str(first_index + i): name for i, name in enumerate(names)},
        **pools,
        "drafts": [list(draft) for draft in frame.drafts],
        "adapters": [list(run) for run in frame.adapters],
        "stats": frame.stats,
    }


@dataclass(frozen=True)
class KVSample:
    """The KV pool and the stats as the engine thread saw them between two steps.

    `kv_snapshot()` copies what it reports, so a sample may be read on any thread.
    """

    time: float  # time.time() when it was taken
    snapshot: KVSnapshot
    stats: EngineStats


class KVWatch:
    """The latest KV sample for one watcher; older unread samples are dropped."""

    def __init__(self) -> None:
        self._sample: KVSample | None = None
        self._ready = asyncio.Event()

    def put(self, sample: KVSample) -> None:
        """Replace the pending sample (event-loop thread only)."""
        self._sample = sample
        self._ready.set()

    async def next(self) -> KVSample:
        """Wait for a sample newer than the last one returned."""
        await self._ready.wait()
        self._ready.clear()
        assert self._sample is not None
        return self._sample
