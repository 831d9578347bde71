"""Refusals that need only the request line and headers, answered before the body is read.

`BodyLimit` buffers up to 2 MiB of body before the app sees a request; a check that can be
decided from the headers must not wait for that, or a client that sends headers and never a
body holds the server's attention for free. This middleware sits outside `BodyLimit` and
answers at once, closing the connection (the unread body is never wanted).
"""

from __future__ import annotations

import secrets

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedkv.server.errors import APIError

PROTECTED_PREFIX = "/v1"  # routes that need the API key; probes, metrics and the page stay open


JSON_MEDIA_TYPE = "application/json"


class Admission:
    """ASGI middleware refusing, in OpenAI's error shape, requests with a missing or wrong API
    key on `/v1` routes (401) and POST requests whose body is not declared as JSON (415).

    The content type matters because a web page may POST `text/plain`, form-encoded or untyped
    bodies to any address, the local server included, without the browser asking the server
    first (a CORS "simple request"); only `application/json` makes the browser ask, and this
    server never says yes, so requiring it keeps other sites from driving the API.
    """

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass acceptable requests on; answer the others without touching their body."""
        if scope["type"] == "http":
            error = self._refusal(scope)
            if error is not None:
                response = error.response()
                response.headers["Connection"] = "close"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> APIError | None:
        headers = Headers(scope=scope)
        if self.api_key is not None and _is_protected(scope["path"]):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(
                token.strip().encode(), self.api_key.encode()
            ):
                return APIError(
                    401,
                    "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                )
        if scope["method"] == "POST":
            content_type = headers.get("content-type", "")
            if content_type.partition(";")[0].strip().lower() != JSON_MEDIA_TYPE:
                return APIError(
                    415,
                    f"send the body as JSON with 'Content-Type: {JSON_MEDIA_TYPE}' "
                    f"(got {repr(content_type) if content_type else 'none'})",
                    code="unsupported_media_type",
                )
        return None


def _is_protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")
