"""The operations routes: `GET /health` (its body a model, serialised once), `/livez` and `/metrics`."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from semif_serve import SEMIF_COMMIT, __version__
from semif_serve.domain.prompt import PROMPT_VERSION
from semif_serve.doors.base import json_reply
from semif_serve.doors.native.schemas import MAX_OPTIONS, ModelInfo
from semif_serve.doors.systemone.schemas import MAX_OPTIONS as SYSTEMONE_MAX_OPTIONS
from semif_serve.http.admission import Admission
from semif_serve.http.errors import HTTP_ERRORS, ErrorEnvelope
from semif_serve.http.observability import Metrics
from semif_serve.service.startup import Service
from semif_serve.service.status import StatusSnapshot, take_snapshot

# The /health limits read as they are from the settings (the rest are the loaded model's).
SETTINGS_LIMITS = (
    "max_rows",
    "max_input_tokens",
    "max_queue",
    "max_body_bytes",
    "max_reply_bytes",
    "release_margin_mib",
    "systemone_max_input_tokens",
    "systemone_max_rows",
)


class SemIfPins(BaseModel):
    """`/health.semif`: the SemIf commit the method follows and the prompt's version."""

    commit: str
    prompt_version: str


class HealthLimits(BaseModel):
    """`/health.limits`: the operator's bounds, the answer codes, System One's own bounds."""

    max_rows: int
    max_input_tokens: int
    max_options: int
    max_queue: int
    max_body_bytes: int
    max_reply_bytes: int
    release_margin_mib: int
    answer_codes: int
    systemone_max_options: int
    systemone_max_input_tokens: int
    systemone_max_rows: int
    vram_cap_gib: float | None = None  # on cuda only


class HealthImages(BaseModel):
    """`/health.images`: whether the model reads images, and the bounds on a request's images."""

    reads_images: bool
    max_images: int
    max_image_pixels: int
    max_image_bytes: int


class WeightsBody(BaseModel):
    """`/health.weights`: whether the weights were checked against a manifest, and how long it took."""

    verified: bool
    manifest: str | None
    files: int
    seconds: float


class CalibrationBody(BaseModel):
    """`/health.calibration`: each workload's temperatures by mode."""

    workloads: dict[str, dict[str, float]]


class QueueBody(BaseModel):
    """`/health.queue`: requests in progress, bodies being read, rows waiting for the engine."""

    in_progress: int
    reading_bodies: int
    engine_pending: int


class MemoryBody(BaseModel):
    """`/health.memory`: device memory reserved and at baseline (null off cuda), releases so far."""

    reserved_bytes: int | None
    baseline_bytes: int | None
    releases: int


class BatchingBody(BaseModel):
    """`/health.batching`: the bounds on one forward, the prefill chunk, and the forwards so far."""

    max_batch_rows: int
    max_batch_tokens: int
    max_forward_tokens: int
    max_gather_seconds: float
    prefill_chunk_tokens: int
    forwards: int
    merged_forwards: int


class StateCacheBody(BaseModel):
    """`/health.state_cache`: the budget, the totals, and per tier (`state`, `question`)."""

    budget_bytes: int
    bytes: int
    entries: int
    hits: int
    misses: int
    evictions: int
    by_kind: dict[str, dict[str, int]]  # {kind: {hits, misses, entries, bytes}}


class HealthBody(BaseModel):
    """`GET /health`: pins, limits, workloads, queue, memory and readiness; no secrets."""

    status: str
    ready: bool
    version: str
    semif: SemIfPins
    model: ModelInfo
    device: str
    dtype: str
    demo: bool
    limits: HealthLimits
    images: HealthImages
    weights: WeightsBody
    calibration: CalibrationBody
    queue: QueueBody
    memory: MemoryBody
    batching: BatchingBody
    state_cache: StateCacheBody


def health_body(service: Service, now: StatusSnapshot) -> HealthBody:
    """`GET /health`: the pins, limits, workloads, device and readiness; no secrets."""
    settings = service.settings
    limits = HealthLimits.model_validate(
        {name: getattr(settings, name) for name in SETTINGS_LIMITS}
        | {
            "max_options": MAX_OPTIONS,
            "answer_codes": service.engine.capacity,
            "systemone_max_options": min(SYSTEMONE_MAX_OPTIONS, service.engine.capacity),
        }
    )
    if settings.device == "cuda":
        limits.vram_cap_gib = settings.vram_cap_gib
    return HealthBody(
        status=now.status,
        ready=now.ready,
        version=__version__,
        semif=SemIfPins(commit=SEMIF_COMMIT, prompt_version=PROMPT_VERSION),
        model=ModelInfo.model_validate(service.engine.model_info),
        device=settings.device,
        dtype=service.engine.identity.dtype,  # the dtype the settings resolved and the engine loaded
        demo=service.demo,
        limits=limits,
        images=HealthImages(
            reads_images=service.engine.reads_images,
            max_images=settings.systemone_max_images,
            max_image_pixels=settings.systemone_max_image_pixels,
            max_image_bytes=settings.systemone_max_image_bytes,
        ),
        weights=WeightsBody.model_validate(service.weights.health()),
        calibration=CalibrationBody(workloads=service.calibration.as_dict()),
        queue=QueueBody(
            in_progress=now.in_progress, reading_bodies=now.reading_bodies, engine_pending=now.engine_pending
        ),
        memory=MemoryBody(
            reserved_bytes=now.reserved_bytes, baseline_bytes=now.baseline_bytes, releases=now.releases
        ),
        batching=BatchingBody(
            max_batch_rows=now.bounds.max_batch_rows,
            max_batch_tokens=now.bounds.max_batch_tokens,
            max_forward_tokens=now.bounds.max_forward_tokens,
            max_gather_seconds=now.bounds.max_gather_seconds,
            prefill_chunk_tokens=now.prefill_chunk_tokens or 0,
            forwards=now.batches.forwards,
            merged_forwards=now.batches.merged_forwards,
        ),
        # CacheStats' own fields by name (its `refused` is the metrics', not /health's).
        state_cache=StateCacheBody.model_validate(asdict(now.cache)),
    )


def ops_router(service: Service, admission: Admission, metrics: Metrics) -> APIRouter:
    """`GET /health`, `GET /livez` and `GET /metrics`."""
    router = APIRouter()

    @router.get(
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
        return json_reply(body, 200 if body.ready else 503)

    @router.get("/livez", summary="Liveness: the process answers, draining included")
    async def livez() -> JSONResponse:
        # Liveness only: readiness and draining are /health's; a drain must not get the pod restarted.
        return JSONResponse({"status": "alive"})

    metrics_responses: dict[int | str, dict[str, Any]] = {
        200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}},
        HTTP_ERRORS["unauthorized"]: {"model": ErrorEnvelope, "description": "SEMIF_METRICS_PUBLIC=false"},
    }

    @router.get("/metrics", summary="Prometheus text", response_class=Response, responses=metrics_responses)
    async def metrics_route() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return router
