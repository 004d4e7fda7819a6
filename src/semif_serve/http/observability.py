"""Request ids, one JSON log line per request, and Prometheus metrics.

`RequestContext` is the outermost ASGI layer: it names every request, stamps
`X-Request-ID` on every response, and on completion logs and counts what the route
recorded in `scope["state"]["record"]` (a `RequestRecord`: rows, tokens, timings, workloads;
never the state text, never the token).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import Receive, Scope, Send

from semif_serve import __version__
from semif_serve.http.admission import Admission
from semif_serve.http.headers import SINGLE_HEADERS, RequestHeaders, headers_of
from semif_serve.http.tracing import RequestTracing
from semif_serve.service.records import RequestRecord
from semif_serve.service.startup import Service
from semif_serve.service.status import StatusSnapshot

log = logging.getLogger("semif_serve.request")

REQUEST_ID_HEADER = b"x-request-id"
SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
TOKEN_BUCKETS = (0, 64, 128, 256, 512, 1024, 2048, 4096)
# Waits of milliseconds count (a tiny request waits one engine step at most).
WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)


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
            "semif_memory_baseline_bytes",
            "reserved memory after warm-up plus the state cache budget",
            value=now.baseline_bytes or 0,
        )
        yield GaugeMetricFamily(
            "semif_memory_release_margin_bytes",
            "reserved memory above the baseline past which a request's end releases cached memory",
            value=now.release_margin_bytes,
        )
        if now.cap_bytes is not None:  # a device with a hard cap (cuda); the CPU has none
            yield GaugeMetricFamily(
                "semif_memory_cap_bytes", "the device memory cap (SEMIF_VRAM_CAP_GIB)", value=now.cap_bytes
            )
        yield from _batch_metrics(now)
        yield from _cache_metrics(now)


# The forward-shape histograms (engine.forward_shapes), named `semif_per_forward_<name>`.
FORWARD_SHAPES = {
    "rows": "rows per forward",
    "requests": "requests per forward (packed together whatever their states)",
    "sequences": "sequences per forward (each packed without padding)",
    "padding_share": "share of a forward's computed tokens that was padding",
    "lanes": "lanes a forward's shares ran in at once (1: one forward on all its threads)",
}


def _batch_metrics(now: StatusSnapshot) -> Iterator[Metric]:
    b = now.batches
    yield CounterMetricFamily("semif_forwards", "engine forwards run by the batcher", value=b.forwards)
    yield CounterMetricFamily(
        "semif_merged_forwards", "forwards that carried more than one request", value=b.merged_forwards
    )
    yield CounterMetricFamily("semif_forward_rows", "rows run in the batcher's forwards", value=b.rows)
    yield CounterMetricFamily(
        "semif_forward_true_tokens", "real suffix tokens in the batcher's forwards", value=b.true_tokens
    )
    yield CounterMetricFamily(
        "semif_forward_padded_tokens",
        "suffix tokens incl. padding (rows x widest row) in the batcher's forwards",
        value=b.padded_tokens,
    )
    yield GaugeMetricFamily(
        "semif_rows_per_forward",
        "mean rows per forward so far",
        value=b.rows / b.forwards if b.forwards else 0,
    )
    yield GaugeMetricFamily(
        "semif_padded_token_share",
        "share of padding in the forwards' suffix tokens so far",
        value=1 - b.true_tokens / b.padded_tokens if b.padded_tokens else 0,
    )
    for name, help_text in FORWARD_SHAPES.items():
        shape = now.shapes.get(name)
        if shape is not None:
            yield HistogramMetricFamily(
                f"semif_per_forward_{name}", help_text, buckets=shape.cumulative(), sum_value=shape.total
            )
    yield CounterMetricFamily(
        "semif_isolated_retries",
        "requests rerun alone after their merged forward failed",
        value=b.isolated_retries,
    )
    yield CounterMetricFamily(
        "semif_cancelled_dropped",
        "requests dropped before their forward (caller gone)",
        value=b.cancelled_dropped,
    )
    yield CounterMetricFamily(
        "semif_gathers",
        "turns that waited for the next requests of the clients just answered",
        value=b.gathers,
    )
    yield CounterMetricFamily(
        "semif_gather_seconds", "time those turns waited, in all", value=b.gather_seconds
    )
    yield CounterMetricFamily(
        "semif_gathered_requests", "requests that arrived while a turn waited for them", value=b.gathered
    )


def _cache_metrics(now: StatusSnapshot) -> Iterator[Metric]:
    c = now.cache
    yield CounterMetricFamily("semif_state_cache_hits", "state prefixes found in the cache", value=c.hits)
    yield CounterMetricFamily(
        "semif_state_cache_misses", "state prefixes not in the cache (each one prefilled)", value=c.misses
    )
    yield CounterMetricFamily(
        "semif_state_cache_evictions", "states evicted least-recently-used", value=c.evictions
    )
    yield CounterMetricFamily(
        "semif_state_cache_refused", "states larger than the whole budget, never stored", value=c.refused
    )
    yield GaugeMetricFamily("semif_state_cache_bytes", "bytes of stored states", value=c.bytes)
    yield GaugeMetricFamily(
        "semif_state_cache_budget_bytes", "the state cache's byte budget", value=c.budget_bytes
    )
    yield GaugeMetricFamily("semif_state_cache_entries", "stored states", value=c.entries)
    hits = CounterMetricFamily(
        "semif_state_cache_kind_hits", "lookups found, by kind (state or question prefix)", labels=["kind"]
    )
    misses = CounterMetricFamily(
        "semif_state_cache_kind_misses", "lookups not found, by kind (state or question)", labels=["kind"]
    )
    entries = GaugeMetricFamily("semif_state_cache_kind_entries", "stored prefixes, by kind", labels=["kind"])
    for kind, stats in c.by_kind.items():
        hits.add_metric([kind], stats.hits)
        misses.add_metric([kind], stats.misses)
        entries.add_metric([kind], stats.entries)
    yield hits
    yield misses
    yield entries


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
            "end-to-end seconds by route and status",
            # status: so the latency objective can leave out what the service refused unasked (401)
            ["route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.forward = Histogram(
            "semif_forward_seconds",
            "engine forward seconds per request",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.images = Counter(
            "semif_images_read", "images shown to the model in answered requests", registry=self.registry
        )
        self.by_model = Counter(
            "semif_model_requests",
            "answered decision requests by the model that read them (the base: `(base)`, never a model name)",
            ["model"],
            registry=self.registry,
        )
        # A request's wait for the engine before its first forward (behind other requests' work).
        self.wait = Histogram(
            "semif_engine_wait_seconds",
            "seconds a request waited for the engine before its first forward (behind other requests' work)",
            buckets=WAIT_BUCKETS,
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

    def identify(self, service: Service) -> None:
        """`semif_build_info`: what this replica serves, as labels on a gauge of 1, so replicas
        that differ in model or calibration show up as distinct label sets."""
        info = Gauge(
            "semif_build_info",
            "what this process serves: version, model source and revision, dtype, calibration digest",
            list(build_labels(service)),
            registry=self.registry,
        )
        info.labels(**build_labels(service)).set(1)

    def observe(self, route: str, status: int, seconds: float, record: RequestRecord | None) -> None:
        """Count one answered request and what its route recorded."""
        self.requests.labels(route, str(status)).inc()
        self.seconds.labels(route, str(status)).observe(seconds)
        if record is None:
            return
        self.rows.inc(record.rows)
        self.by_model.labels(record.adapter or "(base)").inc()
        self.forward.observe(record.forward_seconds)
        self.wait.observe(record.wait_seconds)
        if record.prefix_tokens is not None:
            self.prefix.observe(record.prefix_tokens)
        if record.images:
            self.images.inc(record.images)


def calibration_digest(workloads: dict[str, dict[str, float]]) -> str:
    """The first 16 hex digits of the SHA-256 of the calibration table as canonical JSON (sorted
    keys, no spaces): the same temperatures give the same digest whatever the file's layout."""
    canonical = json.dumps(workloads, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def build_labels(service: Service) -> dict[str, str]:
    """`semif_build_info`'s labels: no path, no token, only names and digests."""
    identity = service.engine.identity
    return {
        "version": __version__,
        "source": identity.source,
        "revision": identity.revision,
        "dtype": identity.dtype,
        "calibration": calibration_digest(service.calibration.as_dict()),
    }


def request_id_from(headers: RequestHeaders) -> str:
    """The caller's one X-Request-ID when it is sane (<= 128 of [A-Za-z0-9._:-]), else a new one
    (two of them get a new one too: admission refuses the request, naming the header)."""
    if headers.request_id is not None and SINGLE_HEADERS[REQUEST_ID_HEADER] not in headers.repeated:
        text = headers.request_id.decode("latin-1")
        if SANE_REQUEST_ID.fullmatch(text):
            return text
    return uuid.uuid4().hex


class RequestContext:
    """Names each request, stamps X-Request-ID, and logs and counts it once: just before the last
    byte of its response is sent (so a count read after a reply includes it), or when it ends
    without one."""

    def __init__(
        self,
        app: Admission,
        metrics: Metrics,
        routes: Collection[str],
        id_headers: Callable[[str], Sequence[bytes]] = lambda path: (REQUEST_ID_HEADER,),
        tracing: RequestTracing | None = None,
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = frozenset(routes)  # metric and log labels; any other path is "other"
        self.id_headers = id_headers  # the headers a path's responses carry the request id in
        self.tracing = tracing  # OpenTelemetry spans per request (None: off)

    @property
    def admission(self) -> Admission:
        """The admission layer this context wraps (its queue and drain state)."""
        return self.app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id = request_id_from(headers_of(scope))
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["record"] = None
        status = 0
        counted = False
        trace = self.tracing.begin(scope) if self.tracing is not None else None
        if trace is not None:
            receive = trace.watch(receive)

        def count() -> None:
            # Once per request: before its last byte is sent, so a client that read the reply sees it.
            nonlocal counted
            if counted:
                return
            counted = True
            seconds = time.perf_counter() - started
            path = scope["path"]
            route = path if path in self.routes else "other"
            record: RequestRecord | None = state.get("record")
            self.metrics.observe(route, status, seconds, record)
            if trace is not None:
                trace.end(scope["method"], route, status, request_id, record)
            fields = record.log_fields() if record is not None else {}
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

        async def stamped(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if trace is not None:
                    trace.respond()
                names = self.id_headers(scope["path"])
                headers = [h for h in message.get("headers", []) if h[0].lower() not in names]
                stamps = [(name, request_id.encode()) for name in names]
                message = {**message, "headers": [*headers, *stamps]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                count()
            await send(message)

        try:
            await self.app(scope, receive, stamped)
        finally:
            count()  # a request that ended without a whole response
