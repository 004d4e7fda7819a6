"""OpenTelemetry traces of requests (http/tracing.py) through the real app: with the SDK's own
in-memory exporter, and with its OTLP/HTTP exporter sending to a receiver on loopback whose
protobuf is decoded with opentelemetry-proto. A traceparent is continued; the engine's stages are
children of the request's span, inside it, in order; no span carries the token or any text.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk", reason="opentelemetry-sdk (the otel extra, a dev dependency)")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind  # noqa: E402

from semif_serve.app import create_app  # noqa: E402
from semif_serve.domain.types import ConfigurationError  # noqa: E402
from semif_serve.http.tracing import RequestTracing, tracing_from_env  # noqa: E402
from tests.support import TOKEN, decision, in_process_client, request_log_lines  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN}-01"
STATE = "The canary in zone seven failed its checks twice."
QUESTION = "Did the secret rollout succeed?"
ENGINE_STAGES = ["encode", "queue wait", "prefill", "forwards", "readout"]


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def traced(service, exporter):
    """An in-process client of the real app, tracing into `exporter`."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = create_app(service)
    app.tracing = RequestTracing(provider)
    return in_process_client(app)


def by_name(spans) -> dict[str, ReadableSpan]:
    named = {span.name: span for span in spans}
    assert len(named) == len(spans), [span.name for span in spans]
    return named


def test_traces_are_off_unless_the_otel_variables_ask_for_them():
    assert tracing_from_env({}) is None
    assert tracing_from_env({"OTEL_TRACES_EXPORTER": "none"}) is None
    assert tracing_from_env({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}) is None
    tracing = tracing_from_env({"OTEL_TRACES_EXPORTER": "otlp"})
    assert isinstance(tracing, RequestTracing)
    tracing.provider.shutdown()
    with pytest.raises(ConfigurationError, match="OTEL_TRACES_EXPORTER: zipkin"):
        tracing_from_env({"OTEL_TRACES_EXPORTER": "zipkin"})


def test_a_decision_is_one_server_span_under_the_callers_with_its_stages_in_order(traced, exporter):
    with request_log_lines() as lines:
        reply = traced.post(
            "/decide", json=decision(state=STATE, question=QUESTION), headers={"traceparent": TRACEPARENT}
        )
    assert reply.status_code == 200
    spans = by_name(exporter.get_finished_spans())
    server = spans.pop("POST /decide")
    assert server.kind is SpanKind.SERVER
    assert format(server.context.trace_id, "032x") == TRACE_ID
    assert server.parent is not None and format(server.parent.span_id, "016x") == CALLER_SPAN
    assert server.attributes["semif.request_id"] == reply.headers["x-request-id"]
    assert server.attributes["http.route"] == "/decide"
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["semif.rows"] == 1
    assert list(spans) == ["admission", "body", *ENGINE_STAGES]
    for span in spans.values():
        assert span.parent is not None and span.parent.span_id == server.context.span_id
        assert span.context.trace_id == server.context.trace_id
        assert server.start_time <= span.start_time <= span.end_time <= server.end_time, span.name
        assert span.attributes["semif.request_id"] == reply.headers["x-request-id"]
    ordered = list(spans.values())
    for before, after in zip(ordered, ordered[1:], strict=False):
        assert before.end_time <= after.start_time + 1_000, (before.name, after.name)  # 1 µs of rounding
    # The request log line holds the same request's numbers, measured apart from the spans.
    (line,) = [entry for entry in lines if entry.get("route") == "/decide"]
    assert abs((server.end_time - server.start_time) / 1e6 - line["duration_ms"]) < 5
    waited = spans["queue wait"]
    assert abs((waited.end_time - waited.start_time) / 1e9 - line["wait_seconds"]) < 1e-5


def test_without_a_traceparent_the_request_starts_its_own_trace(traced, exporter):
    assert traced.post("/decide", json=decision(), headers={"traceparent": "00-garbage"}).status_code == 200
    server = by_name(exporter.get_finished_spans())["POST /decide"]
    assert server.parent is None


def test_a_refused_request_has_admission_only_and_metrics_scrapes_no_span(traced, exporter):
    assert traced.post("/decide", json=decision(), auth=False).status_code == 401
    assert traced.get("/metrics").status_code == 200
    spans = by_name(exporter.get_finished_spans())
    assert sorted(spans) == ["POST /decide", "admission"]
    assert spans["POST /decide"].attributes["http.response.status_code"] == 401
    assert spans["admission"].parent.span_id == spans["POST /decide"].context.span_id


def spans_text(spans) -> str:
    return "\n".join(span.to_json() for span in spans)


def test_no_span_carries_the_token_a_header_or_any_text_of_the_request(traced, exporter):
    shared = {"state": STATE, "decisions": [decision(id="a", question=QUESTION), decision(id="b")]}
    headers = {"traceparent": TRACEPARENT, "tracestate": "vendor=opaque", "X-Custom": "private-value"}
    assert traced.post("/decide/shared", json=shared, headers=headers).status_code == 200
    assert (
        traced.post(
            "/decide", json=decision(state=STATE), headers={"Authorization": "Bearer wrong-token"}
        ).status_code
        == 401
    )
    text = spans_text(exporter.get_finished_spans())
    assert "POST /decide/shared" in text
    for secret in (TOKEN, "wrong-token", STATE, QUESTION, "It succeeded.", "private-value", "Bearer"):
        assert secret not in text, secret


class Receiver:
    """A tiny OTLP/HTTP receiver on loopback: keeps each POST /v1/traces body."""

    def __init__(self) -> None:
        bodies: list[bytes] = []
        self.bodies = bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                length = int(self.headers["Content-Length"])
                if self.path == "/v1/traces" and self.headers["Content-Type"] == "application/x-protobuf":
                    bodies.append(self.rfile.read(length))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def spans(self) -> list:
        found = []
        for body in self.bodies:
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            for resource_spans in request.resource_spans:
                service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    found.extend((service, span) for span in scope_spans.spans)
        return found


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    running = Receiver()
    running.thread.start()
    yield running
    running.server.shutdown()


def test_the_otlp_exporter_sends_the_spans_to_a_collector_on_loopback(service, receiver, monkeypatch):
    from tests.http.test_hardening import HardenedServer

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    tracing = tracing_from_env({"OTEL_TRACES_EXPORTER": "otlp"})
    assert tracing is not None
    app = create_app(service)
    app.tracing = tracing
    with HardenedServer(app) as server:
        reply = httpx.post(
            f"{server.url}/decide",
            json=decision(state=STATE, question=QUESTION),
            headers={"Authorization": f"Bearer {TOKEN}", "traceparent": TRACEPARENT},
            timeout=60,
        )
    assert reply.status_code == 200
    assert tracing.provider.force_flush(10_000)
    tracing.provider.shutdown()
    spans = {span.name: (service_attributes, span) for service_attributes, span in receiver.spans()}
    assert set(spans) == {"POST /decide", "admission", "body", *ENGINE_STAGES}
    resource, server_span = spans["POST /decide"]
    assert resource["service.name"] == "semif-serve"
    assert server_span.trace_id.hex() == TRACE_ID and server_span.parent_span_id.hex() == CALLER_SPAN
    attributes = {a.key: a.value for a in server_span.attributes}
    assert attributes["semif.request_id"].string_value == reply.headers["x-request-id"]
    for name in ("admission", "body", *ENGINE_STAGES):
        assert spans[name][1].parent_span_id == server_span.span_id, name
    raw = b"".join(receiver.bodies)
    for secret in (TOKEN, STATE, QUESTION):
        assert secret.encode() not in raw, secret
    assert json.dumps(reply.json())  # the answer itself came back whole
