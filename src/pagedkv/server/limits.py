"""Request-size limit, enforced before any handler reads the body.

A client that posts a huge body must not make the server buffer or parse it: bodies are
counted as they arrive and refused the moment they pass the limit. The rest of a refused body
is read and dropped (up to `DRAIN_BYTES`) before answering, because a client still writing
its body would otherwise see a reset connection instead of the 413. An accepted body is
replayed to the app, after which `receive` is the server's own again (so handlers still see
the disconnect).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedkv.server.errors import APIError

MAX_BODY_BYTES = 2 * 1024 * 1024  # ~500k tokens of text: far past any context we serve
DRAIN_BYTES = 64 * 1024 * 1024


class BodyLimit:
    """ASGI middleware answering 413 in OpenAI's error shape for bodies over `max_bytes`."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read and check the body of HTTP requests; pass everything else straight through."""
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        chunks = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, message.get("more_body", False), size)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, more_body: bool, size: int
    ) -> None:
        while more_body and size <= DRAIN_BYTES:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            more_body = message.get("more_body", False)
        response = APIError(
            413,
            f"request body is larger than {self.max_bytes} bytes",
            code="request_too_large",
            headers={"Connection": "close"},
        ).response()
        await response(scope, receive, send)
