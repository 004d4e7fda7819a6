"""The HTTP app: routes, bearer auth and the one error envelope; admission wraps it.

`Service` is everything a running process holds: settings, engine, worker, calibration.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import SEMIF_COMMIT, __version__
from .admission import Admission
from .admission import error_response as admission_error_response
from .auth import Authenticator
from .calibration import CalibrationTable, load_calibration
from .decisions import build_result, plan_rows
from .engine import BatchScore, Row, TorchEngine
from .errors import ServiceError, internal
from .memory import MIB, ReleasePolicy
from .observability import Metrics, RequestContext
from .prompt import MAX_OPTIONS, PROMPT_VERSION
from .requests import Decision, SharedDecisions, parse_body
from .settings import Settings
from .worker import EngineWorker

log = logging.getLogger("semif_serve.app")

WARM_UP_STATE = {"service": "semif-serve", "check": "warm-up"}
WARM_UP_ROWS = (
    Row("Is this a warm-up request?", ("Yes.", "No."), "warm-up"),
    Row("Which option is listed first?", ("The first.", "The second.", "The third."), "warm-up"),
)


@dataclass
class Service:
    """A loaded, warmed-up service: what the routes need."""

    settings: Settings
    engine: TorchEngine
    worker: EngineWorker
    calibration: CalibrationTable
    token: str
    ready: bool = False
    extra_health: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(cls, settings: Settings, engine: TorchEngine | None = None) -> Service:
        """Validate the token and calibration, load the engine, warm it up and mark the baseline.

        Raises ConfigurationError, CalibrationFileError, CheckpointError or ServiceError;
        the caller exits non-zero on any of them (startup fails closed).
        """
        token = settings.token()
        calibration = load_calibration(settings.calibration)
        if engine is None:
            engine = TorchEngine.load(settings)
        policy = ReleasePolicy(engine.memory, settings.release_margin_mib * MIB)
        service = cls(settings, engine, EngineWorker(policy), calibration, token)
        service.warm_up()
        return service

    def warm_up(self) -> None:
        """Score a real decision on both paths, then record the memory baseline."""
        self.worker.run_now(lambda: self.engine.score(WARM_UP_STATE, WARM_UP_ROWS[:1], shared=False))
        self.worker.run_now(lambda: self.engine.score(WARM_UP_STATE, WARM_UP_ROWS, shared=True))
        baseline = self.worker.policy.mark_baseline()
        cap = self.engine.memory.cap_bytes()
        if cap is not None and self.settings.split_batches:
            self.engine.headroom_bytes = cap - baseline
        self.ready = True

    async def decide(self, body: bytes, record: dict[str, Any]) -> dict[str, Any]:
        """`POST /decide`: one decision; orderings run as one shared batch."""
        decision = parse_body(Decision, body)
        planned, rows = plan_rows([decision], [""], self.settings.max_rows, self.calibration)
        batch = await self.worker.run(lambda: self.engine.score(decision.state, rows, shared=len(rows) > 1))
        record.update(request_record([decision.workload], batch))
        result = build_result(planned[0], batch, self.engine.model_info, self.calibration)
        if batch.shared:
            result["timing"] = batch.timing
        return result

    async def decide_shared(self, body: bytes, record: dict[str, Any]) -> dict[str, Any]:
        """`POST /decide/shared`: every decision (and ordering) over one state in one batch."""
        request = parse_body(SharedDecisions, body)
        fields = [f"decisions[{i}]" for i in range(len(request.decisions))]
        planned, rows = plan_rows(request.decisions, fields, self.settings.max_rows, self.calibration)
        batch = await self.worker.run(lambda: self.engine.score(request.state, rows, shared=True))
        record.update(request_record([d.workload for d in request.decisions], batch))
        results = [build_result(p, batch, self.engine.model_info, self.calibration) for p in planned]
        return {"results": results, "timing": batch.timing}

    def health(self, admission: Admission | None) -> dict[str, Any]:
        """The pins, limits, workloads, device and readiness; no secrets."""
        settings = self.settings
        policy = self.worker.policy
        draining = bool(admission and admission.draining)
        limits = {
            "max_rows": settings.max_rows,
            "max_input_tokens": settings.max_input_tokens,
            "max_options": MAX_OPTIONS,
            "max_queue": settings.max_queue,
            "max_body_bytes": settings.max_body_bytes,
            "release_margin_mib": settings.release_margin_mib,
        }
        if settings.device == "cuda":
            limits["vram_cap_gib"] = settings.vram_cap_gib
        body = {
            "status": "draining" if draining else ("ok" if self.ready else "starting"),
            "ready": self.ready and not draining,
            "version": __version__,
            "semif": {"commit": SEMIF_COMMIT, "prompt_version": PROMPT_VERSION},
            "model": self.engine.model_info,
            "device": settings.device,
            "dtype": settings.dtype,
            "demo": settings.demo or "demo" in self.engine.model_info,
            "limits": limits,
            "calibration": {"workloads": self.calibration.as_dict()},
            "queue": {
                "in_progress": admission.in_progress if admission else 0,
                "reading_bodies": admission.reading_bodies if admission else 0,
                "engine_pending": self.worker.pending,
            },
            "memory": {
                "reserved_bytes": policy.memory.reserved_bytes(),
                "baseline_bytes": policy.baseline_bytes,
                "releases": policy.releases,
            },
        }
        body.update(self.extra_health)
        return body


def request_record(workloads: list[str | None], batch: BatchScore) -> dict[str, Any]:
    """What the request log line and the metrics keep of a scored request (no text, no token)."""
    record: dict[str, Any] = {
        "rows": len(batch.rows),
        "input_tokens": sum(r.input_tokens for r in batch.rows),
        "forward_seconds": round(batch.forward_seconds, 6),
        "engine_seconds": round(batch.total_seconds, 6),
    }
    if batch.timing:
        record["prefix_tokens"] = batch.timing["prefix_tokens"]
        record["forward_batches"] = batch.timing["forward_batches"]
    named = sorted({w for w in workloads if w})
    if named:
        record["workloads"] = named
    return record


def error_response(error: ServiceError, request: Request | None = None) -> JSONResponse:
    """The envelope as a response, with the error's headers and the request id."""
    request_id = getattr(request.state, "request_id", None) if request is not None else None
    return admission_error_response(error, request_id)


HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def create_app(service: Service) -> RequestContext:
    """The ASGI app: request context (ids, logs, metrics) -> admission control -> FastAPI routes.

    The returned app exposes `.admission` and `.metrics`.
    """
    api = FastAPI(
        title="semif-serve",
        version=__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,
    )
    settings = service.settings
    protected = {"/decide", "/decide/shared"} | (set() if settings.metrics_public else {"/metrics"})
    admission = Admission(
        api,
        settings.max_queue,
        settings.max_body_bytes,
        settings.body_timeout_seconds,
        Authenticator(service.token),
        protected,
    )
    metrics = Metrics()
    metrics.watch(service, admission)
    outer = RequestContext(admission, metrics)

    @api.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
        return error_response(exc, request)

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = HTTP_CODES.get(exc.status_code, "http_error")
        message = {
            404: f"no route {request.url.path}",
            405: f"{request.method} is not allowed on {request.url.path}",
        }
        error = ServiceError(
            exc.status_code,
            code,
            message.get(exc.status_code, str(exc.detail)),
            headers=dict(exc.headers or {}),
        )
        return error_response(error, request)

    @api.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected failure: %s", type(exc).__name__)
        return error_response(internal(), request)

    async def answer(
        request: Request, handler: Callable[[bytes, dict[str, Any]], Awaitable[dict[str, Any]]]
    ) -> JSONResponse:
        body = await request.body()
        record = request.state.log if hasattr(request.state, "log") else {}
        try:
            return JSONResponse(await handler(body, record))
        except ServiceError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failure building the reply is a 500 envelope
            log.error("failed to build the response: %s", type(exc).__name__)
            raise internal() from None

    @api.post("/decide")
    async def decide(request: Request) -> JSONResponse:
        return await answer(request, service.decide)

    @api.post("/decide/shared")
    async def decide_shared(request: Request) -> JSONResponse:
        return await answer(request, service.decide_shared)

    @api.get("/health")
    async def health() -> JSONResponse:
        body = service.health(admission)
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @api.get("/metrics")
    async def metrics_route() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return outer
