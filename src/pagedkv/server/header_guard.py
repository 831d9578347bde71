"""Refusals that need only the request line and headers, answered before the body is read.

`BodyLimit` buffers up to 2 MiB of body before the app sees a request; a check that can be
decided from the headers must not wait for that, or a client that sends headers and never a
body holds the server's attention for free. This middleware sits outside `BodyLimit` and
answers at once, closing the connection (the unread body is never wanted).
"""

from __future__ import annotations

import secrets

from starlette.datastructures import Headers
from starlette.routing import Match, Mount, Router
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedkv.server.errors import APIError

PROTECTED_PREFIX = "/v1"  # routes that need the API key; probes, metrics and the page stay open
# vLLM leaves these open, but it refuses a request's own chat template by default, which
# /tokenize renders, and the profiler's routes write files and slow every step: with a key
# set, they need it too.
PROTECTED_PATHS = ("/tokenize", "/detokenize", "/start_profile", "/stop_profile")
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")  # the names of a loopback-bound server
JSON_MEDIA_TYPE = "application/json"


class HeaderGuard:
    """ASGI middleware refusing, in OpenAI's error shape, requests naming a host outside
    `allowed_hosts` (400; None allows any), requests with a missing or wrong API key on `/v1`
    routes (401) and POST requests to a POST route whose body is not declared as JSON (415; a
    POST without a body has nothing to declare).
    A POST to a path with no POST route passes on, and the router answers 405 (another
    method's path) or 404, as vLLM's does: the method is checked before the body's type.

    The Host check stops DNS rebinding: a page whose name is made to resolve to 127.0.0.1
    reaches the local server as "same origin", but its requests still carry its own name.

    The content type matters because a web page may POST `text/plain`, form-encoded or untyped
    bodies to any address, the local server included, without the browser asking the server
    first (a CORS "simple request"); only `application/json` makes the browser ask, and this
    server says yes only to the origins `--allowed-origins` names, so requiring it keeps other
    sites from driving the API.
    """

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | tuple[str, ...] | None,
        allowed_hosts: tuple[str, ...] | None,
        router: Router,
    ) -> None:
        self.app = app
        self.router = router
        keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
        self.api_keys = tuple(key.encode() for key in keys if key)  # any one is accepted
        self.allowed_hosts = None if allowed_hosts is None else {h.lower() for h in allowed_hosts}

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
        if self.allowed_hosts is not None:
            host = _host_name(headers.get("host", ""))
            if host not in self.allowed_hosts:
                return APIError(
                    400,
                    f"host {host!r} is not served here (allowed: "
                    f"{', '.join(sorted(self.allowed_hosts))}; see --allowed-hosts)",
                    code="invalid_host",
                )
        if self.api_keys and _is_protected(routed_path(scope)):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            sent = token.strip().encode()
            matches = [secrets.compare_digest(sent, key) for key in self.api_keys]  # each one
            if scheme.lower() != "bearer" or not any(matches):
                return APIError(
                    401,
                    "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                )
        if scope["method"] == "POST" and _has_body(headers) and self._routes_post(scope):
            content_type = headers.get("content-type", "")
            if content_type.partition(";")[0].strip().lower() != JSON_MEDIA_TYPE:
                return APIError(
                    415,
                    f"send the body as JSON with 'Content-Type: {JSON_MEDIA_TYPE}' "
                    f"(got {repr(content_type) if content_type else 'none'})",
                    code="unsupported_media_type",
                )
        return None

    def _routes_post(self, scope: Scope) -> bool:
        """Whether a route serves this POST, asked as the router asks (`matches`); the static
        mount is left out, as it matches any method and takes no body."""
        return any(
            not isinstance(route, Mount) and route.matches(scope)[0] is Match.FULL
            for route in self.router.routes
        )


def _has_body(headers: Headers) -> bool:
    """Whether a request carries a body: a POST with none (vLLM's `/ping`, a cancel) has no
    content to type, and nothing a cross-site page could smuggle."""
    return "transfer-encoding" in headers or headers.get("content-length", "0") != "0"


def routed_path(scope: Scope) -> str:
    """The path the router matches: under `--root-path` uvicorn puts the prefix in front of
    the path (ASGI's full path) and the router takes it off again, so a check of the path
    must too, or `/v1/...` would reach the routes as `/prefix/v1/...`, unchecked."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :] or "/"
    return path


def _is_protected(path: str) -> bool:
    return (
        path == PROTECTED_PREFIX
        or path.startswith(PROTECTED_PREFIX + "/")
        or path in PROTECTED_PATHS
    )


def _host_name(host: str) -> str:
    """A Host header's name without its port, lowercased: "[::1]:8000" -> "[::1]"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host.partition("]")[0] + "]"
    return host.partition(":")[0]
