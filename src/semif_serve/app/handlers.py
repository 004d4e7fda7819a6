"""The app's error handlers: every error FastAPI raises (a refusal, a missing route or method, an
unexpected failure) is rendered by the door that owns the path, in that door's shape."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from semif_serve.http.errors import ServiceError, internal

log = logging.getLogger("semif_serve.app")

Render = Callable[[ServiceError, Request], Response]


def add_error_handlers(api: FastAPI, render: Render) -> None:
    """Handle ServiceError, Starlette's HTTP errors (404, 405) and any other exception (500) on `api`."""

    @api.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> Response:
        return render(exc, request)

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        messages = {
            404: ("not_found", f"no route {request.url.path}"),
            405: ("method_not_allowed", f"{request.method} is not allowed on {request.url.path}"),
        }
        code, message = messages.get(exc.status_code, ("http_error", str(exc.detail)))
        error = ServiceError(exc.status_code, code, message, headers=dict(exc.headers or {}))
        return render(error, request)

    @api.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.error("unexpected failure: %s", type(exc).__name__)
        return render(internal(), request)
