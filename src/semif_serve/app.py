"""The ASGI app: request context (ids, logs, metrics) -> admission control -> FastAPI, which
composes the doors (the native API, System One), the operations routes and the published API pages."""

from __future__ import annotations

import base64
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import asdict
from html.parser import HTMLParser
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.staticfiles import StaticFiles

from semif_serve import SEMIF_COMMIT, __version__
from semif_serve.domain.prompt import PROMPT_VERSION
from semif_serve.doors.base import DecisionDoor, door_of
from semif_serve.doors.native.api import NativeDoor
from semif_serve.doors.native.schemas import MAX_OPTIONS, ErrorEnvelope, HealthBody
from semif_serve.doors.systemone.api import SystemOneDoor
from semif_serve.doors.systemone.schemas import MAX_OPTIONS as SYSTEMONE_MAX_OPTIONS
from semif_serve.http.admission import Admission, ASGIApp
from semif_serve.http.auth import Authenticator
from semif_serve.http.errors import HTTP_ERRORS, ServiceError, internal
from semif_serve.http.observability import REQUEST_ID_HEADER, Metrics, RequestContext
from semif_serve.playground import playground_router, security_headers
from semif_serve.service.startup import Service
from semif_serve.service.status import StatusSnapshot, take_snapshot

log = logging.getLogger("semif_serve.app")

OPENAPI_PATH = "/openapi.json"
DOCS_PATH = "/docs"
DOCS_ASSETS = "/docs/assets"
DOCS_IMAGES = "'self' data:"  # swagger-ui.css draws its icons from data: URIs


def health_body(service: Service, now: StatusSnapshot) -> dict[str, Any]:
    """`GET /health`: the pins, limits, workloads, device and readiness; no secrets."""
    settings = service.settings
    limits: dict[str, Any] = {
        "max_rows": settings.max_rows,
        "max_input_tokens": settings.max_input_tokens,
        "max_options": MAX_OPTIONS,
        "max_queue": settings.max_queue,
        "max_body_bytes": settings.max_body_bytes,
        "max_reply_bytes": settings.max_reply_bytes,
        "release_margin_mib": settings.release_margin_mib,
        "answer_codes": service.core.capacity,
        "systemone_max_options": min(SYSTEMONE_MAX_OPTIONS, service.core.capacity),
        "systemone_max_input_tokens": settings.systemone_max_input_tokens,
        "systemone_max_rows": settings.systemone_max_rows,
    }
    if settings.device == "cuda":
        limits["vram_cap_gib"] = settings.vram_cap_gib
    return {
        "status": now.status,
        "ready": now.ready,
        "version": __version__,
        "semif": {"commit": SEMIF_COMMIT, "prompt_version": PROMPT_VERSION},
        "model": service.core.model_info,
        "device": settings.device,
        "dtype": settings.dtype,
        "demo": service.demo,
        "limits": limits,
        "images": {
            "reads_images": service.core.reads_images,
            "max_images": settings.systemone_max_images,
            "max_image_pixels": settings.systemone_max_image_pixels,
            "max_image_bytes": settings.systemone_max_image_bytes,
        },
        "weights": service.weights.health(),
        "calibration": {"workloads": service.calibration.as_dict()},
        "queue": {
            "in_progress": now.in_progress,
            "reading_bodies": now.reading_bodies,
            "engine_pending": now.engine_pending,
        },
        "memory": {
            "reserved_bytes": now.reserved_bytes,
            "baseline_bytes": now.baseline_bytes,
            "releases": now.releases,
        },
        "batching": {
            "max_batch_rows": now.bounds.max_batch_rows,
            "max_batch_tokens": now.bounds.max_batch_tokens,
            "prefill_chunk_tokens": now.prefill_chunk_tokens or 0,
            "forwards": now.batches.forwards,
            "merged_forwards": now.batches.merged_forwards,
        },
        "state_cache": {
            "budget_bytes": now.cache.budget_bytes,
            "bytes": now.cache.bytes,
            "entries": now.cache.entries,
            "hits": now.cache.hits,
            "misses": now.cache.misses,
            "evictions": now.cache.evictions,
            "by_kind": {kind: asdict(stats) for kind, stats in now.cache.by_kind.items()},
            "deferred_prefills": now.deferred_prefills,
        },
    }


def _swagger_assets() -> str:
    """The directory of the installed Swagger UI bundle (served locally: no CDN)."""
    from pathlib import Path

    import swagger_ui

    return str(Path(swagger_ui.__file__).parent / "static")


class _InlineScripts(HTMLParser):
    """Collects the text of every <script> without a `src` in a page."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[str] = []
        self._open: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "script" and "src" not in dict(attrs):
            self._open = []

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self._open.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "script" and self._open is not None:
            self.scripts.append("".join(self._open))
            self._open = None


def script_hashes(html: str) -> str:
    """The CSP sources (`'sha256-...'`) that allow exactly the inline scripts of `html`."""
    parser = _InlineScripts()
    parser.feed(html)
    digests = (base64.b64encode(hashlib.sha256(s.encode()).digest()).decode() for s in parser.scripts)
    return " ".join(f"'sha256-{digest}'" for digest in digests)


def docs_page() -> HTMLResponse:
    """`GET /docs`: FastAPI's Swagger UI page over the bundled assets, with the playground's headers;
    its one inline script (the SwaggerUIBundle call) is allowed by its hash, nothing else inline."""
    page = get_swagger_ui_html(
        openapi_url=OPENAPI_PATH,
        title="semif-serve API",
        swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
        swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
        swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png",
    )
    html = bytes(page.body).decode()
    scripts = f"'self' {script_hashes(html)}"
    return HTMLResponse(html, headers=security_headers(script_src=scripts, img_src=DOCS_IMAGES))


class DocsAssets(StaticFiles):
    """Swagger UI's bundled files, each with the docs page's headers."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers.update(security_headers(img_src=DOCS_IMAGES))
        return response


def publish_schema(api: FastAPI, models: Sequence[type[BaseModel]]) -> None:
    """Generate `/openapi.json` once, with the request bodies the routes parse themselves."""

    def openapi() -> dict[str, Any]:
        if api.openapi_schema is None:
            schema = get_openapi(
                title=api.title, version=api.version, description=api.description, routes=api.routes
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
            api.openapi_schema = schema
        return api.openapi_schema

    api.openapi = openapi  # type: ignore[method-assign]


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
        cast(ASGIApp, api),
        settings.max_queue,
        settings.max_body_bytes,
        settings.body_timeout_seconds,
        Authenticator(service.token),
        protected,
        render,
        body_limit,
    )
    metrics = Metrics()
    metrics.watch(lambda: take_snapshot(service, admission))
    routers = [*(door.router() for door in all_doors), playground_router()]
    for router in routers:
        api.include_router(router)

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

    @api.get(
        "/health",
        summary="Pins, limits, workloads, readiness",
        response_model=None,
        responses={
            200: {"model": HealthBody},
            503: {"model": HealthBody, "description": "starting or draining"},
        },
    )
    async def health() -> JSONResponse:
        body = health_body(service, take_snapshot(service, admission))
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @api.get("/livez", summary="Liveness: the process answers, draining included")
    async def livez() -> JSONResponse:
        # Liveness only: readiness and draining are /health's; a drain must not get the pod restarted.
        return JSONResponse({"status": "alive"})

    @api.get(
        "/metrics",
        summary="Prometheus text",
        response_class=Response,
        responses={
            200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}},
            HTTP_ERRORS["unauthorized"]: {
                "model": ErrorEnvelope,
                "description": "SEMIF_METRICS_PUBLIC=false",
            },
        },
    )
    async def metrics_route() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    publish_schema(api, [model for door in all_doors for model in door.request_models])

    @api.get(OPENAPI_PATH, include_in_schema=False)
    async def openapi_json() -> JSONResponse:
        return JSONResponse(api.openapi(), headers=security_headers())

    page = docs_page()

    @api.get(DOCS_PATH, include_in_schema=False)
    async def docs() -> HTMLResponse:
        return page

    api.mount(DOCS_ASSETS, DocsAssets(directory=_swagger_assets()), name="docs-assets")
    # Metric and log labels: every declared route of the app and its doors; any other path is "other".
    declared = [*api.routes, *(route for router in routers for route in router.routes)]
    routes = {route.path for route in declared if isinstance(route, APIRoute)}

    def id_headers(path: str) -> tuple[bytes, ...]:
        return (REQUEST_ID_HEADER, *door_of(all_doors, path).request_id_headers)

    return RequestContext(admission, metrics, routes, id_headers)
