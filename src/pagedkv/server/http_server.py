"""uvicorn around the app: guarded connections, and a drain before it stops.

`build_server(app)` serves an app made by `build_app` with its `ServerConfig`: the connection
cap and request deadline of `connections.GuardedH11Protocol`, and a `DrainingServer` that
drains (`drain.Drain`) when told to stop, by a signal or by `should_exit`.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import socket
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import uvicorn

from pagedkv.server.connections import (
    LISTEN_BACKLOG,
    ConnectionGuard,
    GuardedH11Protocol,
    fit_to_file_limit,
)
from pagedkv.server.drain import Drain

if TYPE_CHECKING:
    from fastapi import FastAPI

    from pagedkv.server.app import ServerConfig

# After the drain: how long uvicorn waits for the last responses to be written before it
# cancels them and closes their connections.
FLUSH_S = 3
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def build_server(app: FastAPI, **options: Any) -> DrainingServer:
    """uvicorn serving `app` under its ServerConfig; `options` are uvicorn.Config's own
    (host, port, log_level, ...)."""
    config: ServerConfig = app.state.config
    guard = ConnectionGuard(fit_to_file_limit(config.max_connections), config.request_read_timeout)
    uvicorn_config = uvicorn.Config(
        app,
        http=functools.partial(GuardedH11Protocol, guard=guard),  # type: ignore[arg-type]
        backlog=LISTEN_BACKLOG,
        timeout_graceful_shutdown=FLUSH_S,
        lifespan="on",
        **options,
    )
    return DrainingServer(uvicorn_config, app.state.drain, config.shutdown_timeout)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which drains the app before its own shutdown and exits normally
    after a signal."""

    def __init__(self, config: uvicorn.Config, drain: Drain, grace_s: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Drain (still listening, so new requests are told 503), then stop as uvicorn does.

        A second Ctrl-C during the drain ends the running requests (uvicorn reads it as force
        exit); once they are ended it has done its work, so the stop that follows is uvicorn's
        normal one, the app's lifespan shutdown included: skipped, the lifespan task was
        cancelled at exit and logged a CancelledError traceback. A further Ctrl-C forces."""
        await self.drain.run(self.grace_s, cut_short=lambda: self.force_exit)
        self.force_exit = False
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGINT and SIGTERM start the drain (a second SIGINT cuts it short) while serving.

        uvicorn's own version sends the signal again once the server has stopped, so a server
        that drained would still die of SIGTERM; this one returns, and the process exits 0.
        """
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach only the main thread: there, whoever runs it handles them
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
