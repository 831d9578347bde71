"""Errors in OpenAI's JSON shape, so every client library reports them the same way.

Every failure a client can cause becomes an `APIError` carrying the HTTP status and the
fields of `{"error": {"message", "type", "param", "code"}}`; the handlers installed by
`install_error_handlers` also turn FastAPI's own 404/405 and stray exceptions into that shape.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pagedkv.server.responses import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


class APIError(Exception):
    """A request the server refuses: status code plus OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers

    def response(self) -> JSONResponse:
        """The JSON response reporting this error, whether raised or built to be returned."""
        body = ErrorResponse(error=self.info).model_dump()
        return JSONResponse(body, self.status, headers=self.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Route APIError, Starlette's HTTP errors and unexpected exceptions to OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
        code = "not_found" if error.status_code == 404 else None
        # Kept headers carry a 405's `Allow` (the methods the path takes).
        return APIError(
            error.status_code, str(error.detail), code=code, headers=error.headers
        ).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error serving %s", request.url.path)
        return APIError(500, f"internal error: {error}", type="server_error").response()
