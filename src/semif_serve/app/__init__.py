"""The ASGI app: request context (ids, logs, metrics) -> admission control -> gzip for the
clients that accept it -> FastAPI, which
composes the doors (the native API, System One, and any further door given), the operations routes
(ops.py), the published API pages (docs.py) and the error handlers (handlers.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.middleware.gzip import GZipMiddleware
from starlette.types import ASGIApp

from semif_serve import __version__
from semif_serve.app.docs import add_docs
from semif_serve.app.handlers import add_error_handlers
from semif_serve.app.ops import ops_router
from semif_serve.doors.base import DecisionDoor, door_of
from semif_serve.doors.native.api import NativeDoor
from semif_serve.doors.systemone.api import SystemOneDoor
from semif_serve.http.admission import Admission
from semif_serve.http.auth import Authenticator
from semif_serve.http.body_encoding import ReplyCoding
from semif_serve.http.errors import ServiceError
from semif_serve.http.observability import REQUEST_ID_HEADER, Metrics, RequestContext
from semif_serve.http.tracing import tracing_from_env
from semif_serve.playground import playground_router
from semif_serve.service.startup import Service
from semif_serve.service.status import take_snapshot

__all__ = ["Service", "create_app"]

# Replies this long or longer go gzip-compressed to a client that accepts it (contract.md, Reply budget).
COMPRESS_FROM_BYTES = 1024


def create_app(service: Service, doors: Sequence[DecisionDoor] | None = None) -> RequestContext:
    """The ASGI app over `service`, with the native and System One doors and any further `doors`.

    The returned app exposes `.admission` and `.metrics`.
    """
    api = FastAPI(
        title="semif-serve",
        version=__version__,
        description="SemIf option-logit decisions over HTTP: one forward pass, no decoding.",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,
    )
    all_doors: list[DecisionDoor] = [NativeDoor(service), SystemOneDoor(service), *(doors or [])]
    settings = service.settings
    protected = {path for door in all_doors for path in door.protected_paths}
    if not settings.metrics_public:
        protected.add("/metrics")

    def render(error: ServiceError, request: Request) -> Response:
        # The one renderer of every error, whether admission or FastAPI refuses the request.
        return door_of(all_doors, request.url.path).render(error, request)

    def body_limit(path: str, content_type: str | None) -> int:
        return door_of(all_doors, path).body_limit(path, content_type, settings.max_body_bytes)

    admission = Admission(
        ReplyCoding(cast(ASGIApp, GZipMiddleware(api, minimum_size=COMPRESS_FROM_BYTES))),
        max_queue=settings.max_queue,
        max_body_bytes=settings.max_body_bytes,
        body_timeout_seconds=settings.body_timeout_seconds,
        authenticator=Authenticator(service.token),
        protected_paths=protected,
        render=render,
        body_limit=body_limit,
    )
    metrics = Metrics()
    metrics.watch(lambda: take_snapshot(service, admission))
    metrics.identify(service)
    routers = [*(door.router() for door in all_doors), playground_router()]
    for router in routers:
        api.include_router(router)

    add_error_handlers(api, render)
    ops = ops_router(service, admission, metrics)
    api.include_router(ops)
    add_docs(api, [model for door in all_doors for model in door.request_models])
    # Metric and log labels: every declared route of the app, its doors and the ops routes (FastAPI
    # keeps an included router's routes inside it); any other path is "other".
    declared = [*api.routes, *(route for router in [*routers, ops] for route in router.routes)]
    routes = {route.path for route in declared if isinstance(route, APIRoute)}

    def id_headers(path: str) -> tuple[bytes, ...]:
        return (REQUEST_ID_HEADER, *door_of(all_doors, path).request_id_headers)

    return RequestContext(admission, metrics, routes, id_headers, tracing_from_env())
