"""`GET /v1/kv` and `GET /v1/kv/stream`: the KV pool for the page map.

A snapshot is taken on the engine thread between steps (the Engine is not thread-safe), after
every command queued before it, so an abort that was sent earlier is already visible. Nothing
else is: turning it into JSON happens in a worker thread, blocking neither the engine nor the
event loop.

The stream costs the same however many watch it. While anyone does, the engine thread takes
one snapshot per tick (a few a second), and a worker thread encodes it once, as the tick's
message (a full frame, or the blocks changed since the previous tick); every viewer is sent
those same bytes. A viewer that has not been sent the previous tick (it just joined, or was
too slow to take it) is sent a full frame of the current tick instead, also encoded once
however many need it. At most `max_viewers` watch at once; more are refused with 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pagedkv.server.engine_loop import EngineLoop
from pagedkv.server.errors import APIError
from pagedkv.server.kv_frames import KVFrame, KVFrameEncoder, KVSample, full_message
from pagedkv.server.serving import EventStream, shutting_down, sse

logger = logging.getLogger(__name__)

RECONNECT_MS = 1000
MAX_VIEWERS = 64  # people watching one server; each costs one write of shared bytes per tick
RETRY_AFTER_S = 5


async def snapshot_json(engine_loop: EngineLoop) -> bytes:
    """The engine's `kv_snapshot().to_dict()` plus its stats, taken now, as JSON.

    Only the snapshot itself is taken on the engine thread; turning a pool of 100,000+ blocks
    into JSON takes a second, so it happens in a worker thread, blocking neither the engine
    nor the event loop.
    """
    kv, stats = await engine_loop.call(lambda engine: (engine.kv_snapshot(), engine.stats))

    def encode() -> bytes:
        return json.dumps({**kv.to_dict(), "stats": stats.to_dict()}).encode()

    return await asyncio.to_thread(encode)


class PageMapFeed:
    """The page-map stream shared by every viewer (event-loop thread only)."""

    def __init__(self, engine_loop: EngineLoop, max_viewers: int = MAX_VIEWERS) -> None:
        self.engine_loop = engine_loop
        self.max_viewers = max_viewers
        self.num_viewers = 0
        self._tick: _Tick | None = None
        self._new_tick = asyncio.Event()
        self._pump: asyncio.Task | None = None
        self._closed = False

    def stream_response(self) -> EventStream:
        """Server-sent frames until the client goes away; 503 past `max_viewers`."""
        if self._closed:
            raise shutting_down("server shutting down: the page map has stopped")
        if self.num_viewers >= self.max_viewers:
            raise APIError(
                503,
                f"the page map already has {self.num_viewers} viewers, the most "
                f"--max-page-map-viewers allows",
                type="server_error",
                code="too_many_viewers",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.num_viewers += 1
        if self._pump is None:
            self._pump = asyncio.create_task(self._encode_ticks())
        return EventStream(self._frames(), on_close=self._leave)

    def close(self) -> None:
        """End every viewer's stream and refuse new ones (the server is shutting down)."""
        self._closed = True
        self._stop_pump()
        self._new_tick.set()

    async def _frames(self) -> AsyncIterator[bytes]:
        yield f"retry: {RECONNECT_MS}\n\n".encode()
        sent: int | None = None  # the last tick this viewer was sent
        while not self._closed:
            tick = self._tick
            if tick is None or tick.seq == sent:
                await self._new_tick.wait()
                continue
            yield tick.message if sent == tick.seq - 1 else await tick.full()
            sent = tick.seq

    async def _encode_ticks(self) -> None:
        """Encode each sample the engine thread takes, while anyone watches."""
        watch = self.engine_loop.watch_kv()
        encoder = KVFrameEncoder()
        seq = 0
        try:
            while True:
                sample = await watch.next()
                seq += 1
                try:
                    tick = await asyncio.to_thread(_encode_tick, encoder, sample, seq)
                except Exception:  # the viewers wait for the next tick
                    logger.exception("page-map frame failed")
                    continue
                self._publish(tick)
        finally:
            self.engine_loop.unwatch_kv(watch)

    def _publish(self, tick: _Tick) -> None:
        self._tick = tick
        self._new_tick.set()
        self._new_tick = asyncio.Event()

    def _leave(self) -> None:
        self.num_viewers -= 1
        if self.num_viewers == 0:
            self._stop_pump()  # no snapshots while nobody watches

    def _stop_pump(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            self._pump = None
        self._tick = None  # the next viewer starts a new stream, with a full frame


@dataclass
class _Tick:
    """One tick of the stream, encoded once for every viewer."""

    seq: int
    message: bytes  # for viewers that were sent tick seq - 1
    is_full: bool
    frame: KVFrame
    names: tuple[str, ...]  # the stream's name table once this tick was encoded
    _full: asyncio.Future | None = field(default=None, repr=False)

    async def full(self) -> bytes:
        """This tick as a full frame, encoded (in a worker thread) on first demand only."""
        if self.is_full:
            return self.message
        if self._full is None:
            self._full = asyncio.ensure_future(
                asyncio.to_thread(_full_event, self.frame, self.names)
            )
        # Shielded: a viewer leaving while it waits must not cancel it for the others.
        return await asyncio.shield(self._full)


def _encode_tick(encoder: KVFrameEncoder, sample: KVSample, seq: int) -> _Tick:
    """A sample as the stream's next tick (in a worker thread: O(pool) work)."""
    frame = KVFrame.capture(sample)
    message = encoder.encode(frame)
    is_full = message["type"] == "full"
    return _Tick(seq, _event(message), is_full, frame, encoder.names)


def _full_event(frame: KVFrame, names: tuple[str, ...]) -> bytes:
    return _event(full_message(frame, names))


def _event(message: dict[str, Any]) -> bytes:
    return sse(json.dumps(message, separators=(",", ":"))).encode()
