"""The connections the server holds: how many at once, and how long each may take to send
its request.

uvicorn's h11 protocol accepts every connection it is offered and waits for a request's
headers and body for ever. Clients that open sockets, send half a request and go silent
(slow loris) then hold a file descriptor each until the process runs out: accepting fails,
/health stops answering, and asyncio logs a traceback for every accept that fails (thousands
a second). `GuardedH11Protocol` closes

- a connection opened while `max_connections` are open, at once, so its descriptor is free
  again before the next accept. uvicorn's own `limit_concurrency` does not do this: it counts
  only when a request's headers have all arrived, so silent sockets still pile up, and it
  answers them a plain-text 503;
- a connection that has not sent a whole request (headers and body) `read_timeout_s` after
  the server began to read it (when it opened, or when the previous response ended).

A long response is not limited: the deadline ends once the request has arrived. Each kind of
closing is logged at most once a minute, with a count, rather than once per socket.
`fit_to_file_limit` keeps the cap within what the process may open.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 2048  # past --max-waiting's 512 queued, 256 running, viewers and probes
# Time to send a request's headers and body: a whole 2 MiB body at 70 KB/s, and short enough
# that a socket holding a descriptor for nothing is let go soon.
REQUEST_READ_TIMEOUT_S = 30.0
# Connections the kernel queues for accepting. asyncio also accepts up to this many at a time,
# and closes those beyond the cap only a few loop turns later, while more batches come in: room
# is kept for ACCEPT_BATCHES_HELD batches (1,500 connections opened at once against a limit of
# 1,024 descriptors peaked at 641 open, with 448 allowed).
LISTEN_BACKLOG = 128
ACCEPT_BATCHES_HELD = 4
FILES_RESERVED = 64  # descriptors besides connections: the listener, logs, model files, pipes
LOG_INTERVAL_S = 60.0
# Their states while the server waits for the client's request (h11 calls the client "them").
READING = (h11.IDLE, h11.SEND_BODY)


class ConnectionGuard:
    """One server's limits on its connections, and its log of the connections it closed."""

    def __init__(self, max_connections: int, read_timeout_s: float) -> None:
        self.max_connections = max_connections
        self.read_timeout_s = read_timeout_s
        self.log_refused = ThrottledWarning(
            f"refusing connections: {max_connections} are open (--max-connections)"
        )
        self.log_timed_out = ThrottledWarning(
            f"closed a connection that sent no whole request within {read_timeout_s:g} s "
            "(--request-read-timeout)"
        )


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with `guard`'s connection cap and request deadline."""

    def __init__(self, *args: Any, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard
        self._read_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Refuse the connection if the cap is reached; else serve it, with a deadline."""
        if len(self.connections) >= self.guard.max_connections:
            self.guard.log_refused()
            transport.abort()  # closes the socket now, sending nothing
            return
        super().connection_made(transport)
        self._watch_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        """Clean up, unless the connection was refused (then nothing was set up)."""
        self._cancel_read_deadline()
        if self.transport is not None:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Parse as uvicorn does; end the deadline once the request has arrived."""
        super().data_received(data)
        self._watch_reading()

    def on_response_complete(self) -> None:
        """A kept-alive connection begins reading its next request: a new deadline."""
        super().on_response_complete()
        self._watch_reading()

    def _watch_reading(self) -> None:
        if self.conn.their_state not in READING:
            self._cancel_read_deadline()
        elif self._read_deadline is None:
            self._read_deadline = self.loop.call_later(
                self.guard.read_timeout_s, self._read_timed_out
            )

    def _cancel_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self.conn.their_state in READING and not self.transport.is_closing():
            self.guard.log_timed_out()
            self.transport.close()


class ThrottledWarning:
    """A warning logged at most once per `interval_s`, counting the occurrences not logged."""

    def __init__(self, message: str, interval_s: float = LOG_INTERVAL_S) -> None:
        self.message = message
        self.interval_s = interval_s
        self._logged_at: float | None = None
        self._unlogged = 0

    def __call__(self) -> None:
        """Note one occurrence; log it unless one was logged less than `interval_s` ago."""
        now = time.monotonic()
        if self._logged_at is not None and now - self._logged_at < self.interval_s:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more since the last such message)" if self._unlogged else ""
        logger.warning("%s%s", self.message, more)
        self._logged_at = now
        self._unlogged = 0


def fit_to_file_limit(max_connections: int) -> int:
    """`max_connections`, lowered if need be so the process never runs out of descriptors.

    It needs one per connection, one per connection accepted but not yet refused, and
    `FILES_RESERVED` of its own. The soft limit is raised toward the hard one first (a usual
    soft limit is 1024); only what even the hard limit cannot hold is cut.
    """
    overhead = ACCEPT_BATCHES_HELD * LISTEN_BACKLOG + FILES_RESERVED
    needed = max_connections + overhead
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return max_connections
    raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        soft = raised
    except (ValueError, OSError):
        pass
    fitted = max(1, min(max_connections, soft - overhead))
    if fitted < max_connections:
        logger.warning(
            "--max-connections lowered from %d to %d: the process may open %d files "
            "(ulimit -n) and keeps %d for accepting and its own",
            max_connections,
            fitted,
            soft,
            overhead,
        )
    return fitted
