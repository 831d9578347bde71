"""The OpenAI-compatible HTTP server and the live page map of the KV pool.

`build_app(engine, ...)` wires the routes to an `EngineLoop`: one background thread owns the
Engine (it is not thread-safe) and feeds per-request asyncio queues, so HTTP handlers never
block the event loop. `pagedkv serve` builds the Engine and runs the app under uvicorn.
"""

from pagedkv.server.app import ServerConfig, build_app

__all__ = ["ServerConfig", "build_app"]
