"""Request ids, one JSON log line per request, and Prometheus metrics.

`RequestContext` is the outermost ASGI layer: it names every request, stamps
`X-Request-ID` on every response, and on completion logs and counts what the route
recorded in `scope["state"]["log"]` (rows, tokens, timings, workload: never the state
text, never the token).
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .admission import Admission, Receive, Scope, Send
from .status import StatusSnapshot

log = logging.getLogger("semif_serve.request")

SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
ROUTES = {"/decide", "/decide/shared", "/health", "/metrics", "/openapi.json", "/docs"}
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
TOKEN_BUCKETS = (0, 64, 128, 256, 512, 1024, 2048, 4096)


class StatusCollector(Collector):
    """Reads one status snapshot at scrape time: the same numbers /health reports."""

    def __init__(self, snapshot: Callable[[], StatusSnapshot]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        now = self.snapshot()
        yield GaugeMetricFamily(
            "semif_requests_in_progress", "POST requests admitted and not finished", value=now.in_progress
        )
        yield GaugeMetricFamily(
            "semif_queue_depth", "engine jobs waiting or running", value=now.engine_pending
        )
        yield GaugeMetricFamily(
            "semif_ready", "1 when the engine is warm and not draining", value=float(now.ready)
        )
        yield CounterMetricFamily(
            "semif_busy_rejections", "POSTs refused with 429 busy", value=now.busy_rejections
        )
        yield CounterMetricFamily(
            "semif_out_of_memory", "requests that ran out of device memory", value=now.out_of_memory_events
        )
        yield CounterMetricFamily(
            "semif_memory_releases", "times cached device memory was released", value=now.releases
        )
        yield GaugeMetricFamily(
            "semif_memory_reserved_bytes", "memory reserved by the allocator", value=now.reserved_bytes
        )
        yield GaugeMetricFamily(
            "semif_memory_baseline_bytes", "reserved memory after warm-up", value=now.baseline_bytes or 0
        )


class Metrics:
    """The service's Prometheus registry (its own, so tests and processes never share counters)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "semif_requests", "requests by route and status", ["route", "status"], registry=self.registry
        )
        self.rows = Counter(
            "semif_rows_scored", "rows (decisions x orderings) scored", registry=self.registry
        )
        self.seconds = Histogram(
            "semif_request_seconds",
            "end-to-end seconds by route",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.forward = Histogram(
            "semif_forward_seconds",
            "engine forward seconds per request",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prefix = Histogram(
            "semif_prefix_tokens",
            "shared state prefix tokens per request",
            buckets=TOKEN_BUCKETS,
            registry=self.registry,
        )

    def watch(self, snapshot: Callable[[], StatusSnapshot]) -> None:
        """Report the live status, read through `snapshot` at every scrape."""
        self.registry.register(StatusCollector(snapshot))

    def observe(self, route: str, status: int, seconds: float, fields: dict[str, Any]) -> None:
        """Count one answered request and what its route recorded."""
        self.requests.labels(route, str(status)).inc()
        self.seconds.labels(route).observe(seconds)
        if "rows" in fields:
            self.rows.inc(fields["rows"])
        if "forward_seconds" in fields:
            self.forward.observe(fields["forward_seconds"])
        if "prefix_tokens" in fields:
            self.prefix.observe(fields["prefix_tokens"])


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    """The caller's X-Request-ID when it is sane (<= 128 of [A-Za-z0-9._:-]), else a new one."""
    for name, value in headers:
        if name == b"x-request-id":
            text = value.decode("latin-1")
            if SANE_REQUEST_ID.fullmatch(text):
                return text
    return uuid.uuid4().hex


class RequestContext:
    """Names each request, stamps X-Request-ID, and logs and counts it once it is answered."""

    def __init__(self, app: Admission, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    @property
    def admission(self) -> Admission:
        """The admission layer this context wraps (its queue and drain state)."""
        return self.app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id = request_id_from(scope["headers"])
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["log"] = {}
        status = 0

        async def stamped(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, stamped)
        finally:
            seconds = time.perf_counter() - started
            path = scope["path"]
            route = path if path in ROUTES else "other"
            fields = state.get("log", {})
            self.metrics.observe(route, status, seconds, fields)
            if route != "/metrics" and not (route == "/health" and status == 200):
                log.info(
                    "request",
                    extra={
                        "request_id": request_id,
                        "method": scope["method"],
                        "route": route,
                        "status": status or None,
                        "duration_ms": round(seconds * 1000, 3),
                        **fields,
                    },
                )
