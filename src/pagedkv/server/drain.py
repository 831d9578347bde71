"""A graceful end: on SIGINT or SIGTERM the server drains before it exits.

1. It stops admitting: a new completion gets 503 in OpenAI's JSON shape (code
   "shutting_down"), /health answers 503 so load balancers look elsewhere, and page-map
   streams end. The listening socket stays open meanwhile, so a client is told why instead
   of being refused a connection.
2. Running requests go on for up to `grace_s` seconds (`--shutdown-timeout`); a second
   Ctrl-C cuts this short.
3. Whatever still runs then is ended: a stream with an error event and `data: [DONE]`, a
   non-streamed request with the same 503 JSON error; their blocks are freed.

Then uvicorn closes the listener and the connections, the engine thread stops, and the
process exits 0 (`http_server.DrainingServer`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from pagedkv.server.engine_loop import EngineLoop
from pagedkv.server.page_map import PageMapFeed

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 5.0  # with the flush after it, inside `docker stop`'s 10 s
POLL_S = 0.1  # how often the wait looks for a second Ctrl-C


class Drain:
    """What a graceful end touches: the engine's requests and the page map's viewers."""

    def __init__(self, engine_loop: EngineLoop, page_map: PageMapFeed) -> None:
        self.engine_loop = engine_loop
        self.page_map = page_map

    async def run(self, grace_s: float, cut_short: Callable[[], bool]) -> None:
        """Refuse new work, wait up to `grace_s` (or until `cut_short()`) for the running
        requests, then end those still running."""
        idle = self.engine_loop.drain()
        self.page_map.close()
        stats = self.engine_loop.stats
        # A warning, so that it shows without any logging set up: the wait that follows
        # should not look like a hang.
        logger.warning(
            "shutting down: refusing new requests, waiting up to %g s for %d running and %d "
            "waiting (--shutdown-timeout; a second Ctrl-C ends them now)",
            grace_s,
            stats.num_running,
            stats.num_waiting,
        )
        deadline = time.monotonic() + grace_s
        while not idle.done() and not cut_short() and time.monotonic() < deadline:
            await asyncio.wait({idle}, timeout=min(POLL_S, deadline - time.monotonic()))
        if not idle.done():
            logger.warning("shutting down: ending the requests still running")
            self.engine_loop.interrupt_all(
                f"server shutting down: the request was still running after the {grace_s:g} s "
                "grace period (--shutdown-timeout)"
            )
