"""`GET /v1/kv` and `GET /v1/kv/stream`: the KV pool for the page map.

The snapshot is taken on the engine thread between steps (the Engine is not thread-safe),
after every command queued before it, so an abort that was sent earlier is already visible.
The stream sends one full frame, then the blocks that changed, a few times a second.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from pagedkv.server.engine_loop import EngineLoop, KVWatch
from pagedkv.server.kv_frames import KVFrameEncoder
from pagedkv.server.serving import EventStream, sse

RECONNECT_MS = 1000


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
