"""OpenTelemetry traces of requests: off unless the standard `OTEL_*` variables ask for them.

`tracing_from_env` reads `OTEL_SDK_DISABLED` and `OTEL_TRACES_EXPORTER` (only `otlp`: OTLP over
HTTP, protobuf; unset or `none`: no traces, unlike the SDK's own default); everything else
(`OTEL_EXPORTER_OTLP_*`, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`,
`OTEL_BSP_*`) the SDK reads itself. The SDK is the optional `otel` extra, imported only here and
only when traces are on.

One server span per request, continuing an incoming W3C `traceparent`, with children laid out
from times already measured: `admission` and `body` from when admission first read the body and
when its last byte came, the engine's stages (`encode`, `queue wait`, `prefill`, `forwards`) from
the durations the engine measured (`service.core.EngineStages`, back to back up to the moment
the outcome reached the door), and `readout` from there to the response's start. The engine
itself knows nothing of OTel. Spans carry names, sizes and ids: never a header's value, the
token, or any text of the request.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from starlette.types import Message, Receive, Scope

from semif_serve import __version__
from semif_serve.domain.types import ConfigurationError
from semif_serve.service.records import RequestRecord

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger("semif_serve.tracing")

# The only request headers a trace reads: W3C trace context.
TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})
# Routes polled by machines, left untraced like the request log leaves them unlogged.
UNTRACED_ROUTES = frozenset({"/metrics", "/livez"})


def tracing_from_env(environ: Mapping[str, str] = os.environ) -> RequestTracing | None:
    """Request tracing over an OTLP/HTTP exporter when `OTEL_TRACES_EXPORTER=otlp` (and not
    `OTEL_SDK_DISABLED=true`); None otherwise. Raises ConfigurationError for another exporter
    name, or when the `otel` extra is not installed."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = {name.strip().lower() for name in environ.get("OTEL_TRACES_EXPORTER", "").split(",")}
    names -= {"", "none"}
    if not names:
        return None
    if names != {"otlp"}:
        raise ConfigurationError(
            f"OTEL_TRACES_EXPORTER: {','.join(sorted(names))} is not supported; use otlp (or none)"
        )
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise ConfigurationError(
            "OTEL_TRACES_EXPORTER=otlp needs the otel extra: pip install 'semif-serve[otel]'"
        ) from exc
    attributes = {"service.version": __version__}
    if not environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = "semif-serve"
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    log.info("tracing on: OTLP over HTTP")
    return RequestTracing(provider)


class RequestTracing:
    """Starts one `RequestTrace` per request, on a tracer of `provider`."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("semif_serve", __version__)
        self.propagator = TraceContextTextMapPropagator()

    def begin(self, scope: Scope) -> RequestTrace:
        """The trace of the request `scope` opens, from now."""
        carrier = {
            name.lower().decode("latin-1"): value.decode("latin-1")
            for name, value in scope.get("headers", [])
            if name.lower() in TRACE_HEADERS
        }
        return RequestTrace(self, carrier)


class RequestTrace:
    """One request's times as it runs; its spans are written when it ends."""

    def __init__(self, tracing: RequestTracing, carrier: dict[str, str]) -> None:
        self.tracing = tracing
        self.carrier = carrier
        self.started_ns = time.time_ns()
        self.started = time.perf_counter()
        self.first_read: float | None = None  # admission let the request through to its body
        self.body_read: float | None = None  # the body's last byte arrived
        self.responded: float | None = None  # the response started

    def watch(self, receive: Receive) -> Receive:
        """`receive`, noting when the body starts being read and when its last byte came."""

        async def watched() -> Message:
            if self.first_read is None:
                self.first_read = time.perf_counter()
            message = await receive()
            if (
                self.body_read is None
                and message["type"] == "http.request"
                and not message.get("more_body", False)
            ):
                self.body_read = time.perf_counter()
            return message

        return watched

    def respond(self) -> None:
        """Note that the response starts now."""
        if self.responded is None:
            self.responded = time.perf_counter()

    def _ns(self, moment: float) -> int:
        """A `time.perf_counter()` moment as the epoch nanoseconds OTel records."""
        return self.started_ns + int((moment - self.started) * 1e9)

    def end(
        self, method: str, route: str, status: int, request_id: str, record: RequestRecord | None
    ) -> None:
        """Write the request's spans, ending now (never raises: a trace must not fail a request)."""
        if route in UNTRACED_ROUTES:
            return
        try:
            self._write(method, route, status, request_id, record, time.perf_counter())
        except Exception:  # tracing is best effort: never fail the request for it
            log.exception("could not record the request's trace")

    def _write(
        self,
        method: str,
        route: str,
        status: int,
        request_id: str,
        record: RequestRecord | None,
        ended: float,
    ) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        tracer = self.tracing.tracer
        attributes: dict[str, Any] = {
            "http.request.method": method,
            "http.route": route,
            "semif.request_id": request_id,
        }
        if status:
            attributes["http.response.status_code"] = status
        if record is not None:
            attributes |= {"semif.rows": record.rows, "semif.input_tokens": record.input_tokens}
            if record.model:
                attributes["semif.model"] = record.model
            if record.images:
                attributes["semif.images"] = record.images
        server = tracer.start_span(
            f"{method} {route}",
            context=self.tracing.propagator.extract(self.carrier),
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=self.started_ns,
        )
        if status >= 500 or not status:
            server.set_status(Status(StatusCode.ERROR))
        inside = trace.set_span_in_context(server)

        def child(name: str, begin: float, finish: float, **extra: Any) -> None:
            span = tracer.start_span(
                name,
                context=inside,
                attributes={"semif.request_id": request_id, **extra},
                start_time=self._ns(begin),
            )
            span.end(end_time=self._ns(max(finish, begin)))

        responded = self.responded if self.responded is not None else ended
        if method == "POST":
            child("admission", self.started, self.first_read if self.first_read is not None else responded)
        if self.first_read is not None and self.body_read is not None:
            child("body", self.first_read, self.body_read)
        if record is not None and record.stages is not None:
            stages = record.stages
            moment = stages.finished - (
                stages.encode_seconds + stages.wait_seconds + stages.prefill_seconds + stages.forward_seconds
            )
            for name, seconds, extra in (
                ("encode", stages.encode_seconds, {}),
                ("queue wait", stages.wait_seconds, {}),
                ("prefill", stages.prefill_seconds, {"semif.prefill": record.prefill or "none"}),
                ("forwards", stages.forward_seconds, {"semif.forward_batches": record.forward_batches or 1}),
            ):
                child(name, moment, moment + seconds, **extra)
                moment += seconds
            child("readout", stages.finished, responded)
        server.end(end_time=self._ns(ended))
