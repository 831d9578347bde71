"""The OpenAI-compatible HTTP server and the live page map of the KV pool.

`build_app(engine, ...)` wires the routes to an `EngineLoop`: one background thread owns the
Engine (it is not thread-safe) and feeds per-request asyncio queues, so HTTP handlers never
block the event loop. `build_server(app)` runs it under uvicorn with the connection limits
and the drain on shutdown; `pagedkv serve` builds the Engine, the app and the server.
"""

from pagedkv.server.app import ServerConfig, build_app
from pagedkv.server.http_server import build_server

__all__ = ["ServerConfig", "build_app", "build_server"]
