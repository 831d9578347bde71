"""`GET /v1/kv` and `GET /v1/kv/stream`: the KV pool for the page map.

The snapshot is taken on the engine thread between steps (the Engine is not thread-safe),
after every command queued before it, so an abort that was sent earlier is already visible.
The stream sends one full frame, then the blocks that changed, a few times a second.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pagedkv.server.engine_loop import EngineLoop, KVWatch
from pagedkv.server.kv_frames import KVFrameEncoder
from pagedkv.server.serving import EventStream, sse

RECONNECT_MS = 1000


async def snapshot(engine_loop: EngineLoop) -> dict[str, Any]:
    """The engine's `kv_snapshot().to_dict()` plus its stats, taken now."""

    def take(engine) -> dict[str, Any]:
        return {**engine.kv_snapshot().to_dict(), "stats": engine.stats.to_dict()}

    return await engine_loop.call(take)


def stream_response(engine_loop: EngineLoop) -> EventStream:
    """Server-sent page-map frames until the client goes away."""
    watch = engine_loop.watch_kv()
    return EventStream(_frames(watch), on_close=lambda: engine_loop.unwatch_kv(watch))


async def _frames(watch: KVWatch) -> AsyncIterator[str]:
    encoder = KVFrameEncoder()
    yield f"retry: {RECONNECT_MS}\n\n"
    while True:
        frame = await watch.next()
        yield sse(json.dumps(encoder.encode(frame), separators=(",", ":")))
