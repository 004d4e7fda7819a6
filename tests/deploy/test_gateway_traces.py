"""A trace across the gateway: a request carrying a W3C traceparent through the real haproxy
(stacks/semif-k8s/files/haproxy.cfg) reaches a real replica, whose server span continues the
caller's trace under the caller's span (HAProxy 2.6 emits no spans of its own: docs/runbook.md).
Skips where haproxy is not installed, except in CI.
"""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk", reason="opentelemetry-sdk (the otel extra, a dev dependency)")
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from semif_serve.http.tracing import RequestTracing  # noqa: E402
from tests.deploy.test_gateway import (  # noqa: E402
    AUTH,
    HAPROXY,
    REPLICA_HEADER,
    Gateway,
    Replica,
    ready_servers,
    wait_until,
)
from tests.support import decision  # noqa: E402

CALLERS = [(f"{i:032x}", f"{i + 1:016x}") for i in range(0x1A2B3C, 0x1A2B3C + 6)]


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def traced_gateway(service, exporter, tmp_path_factory):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    replicas = [Replica(service) for _ in range(2)]
    for replica in replicas:
        replica.app.tracing = RequestTracing(provider)
        replica.start()
    try:
        with Gateway(
            [r.port for r in replicas], tmp_path_factory.mktemp("gateway"), haproxy=HAPROXY
        ) as gateway:
            wait_until(lambda: len(ready_servers(gateway)) == 2)
            yield gateway
    finally:
        for replica in replicas:
            replica.stop()


def server_spans(exporter: InMemorySpanExporter) -> list:
    return [span for span in exporter.get_finished_spans() if span.name == "POST /decide"]


def test_the_replica_s_spans_continue_the_caller_s_trace_through_the_gateway(traced_gateway, exporter):
    exporter.clear()
    answered_by = set()
    for i, (trace_id, span_id) in enumerate(CALLERS):
        headers = {**AUTH, "traceparent": f"00-{trace_id}-{span_id}-01", "tracestate": f"caller=r{i}"}
        body = decision(state=f"Gateway trace check {i}: zone {i} is healthy.")
        reply = httpx.post(f"{traced_gateway.url}/decide", json=body, headers=headers, timeout=60)
        assert reply.status_code == 200, reply.text
        answered_by.add(reply.headers[REPLICA_HEADER])
    # A replica writes its spans once the response is sent: wait for the last one.
    wait_until(lambda: len(server_spans(exporter)) == len(CALLERS))
    servers = sorted(server_spans(exporter), key=lambda span: span.start_time)
    assert len(answered_by) == 2, "the states spread over both replicas"
    for span, (trace_id, span_id) in zip(servers, CALLERS, strict=True):
        assert format(span.context.trace_id, "032x") == trace_id
        assert span.parent is not None and format(span.parent.span_id, "016x") == span_id
        assert span.parent.is_remote
    for span, i in zip(servers, range(len(CALLERS)), strict=True):
        assert span.context.trace_state.get("caller") == f"r{i}", "the gateway passed tracestate on"
    children = [
        s
        for s in exporter.get_finished_spans()
        if s.parent and s.parent.span_id in {x.context.span_id for x in servers}
    ]
    assert {s.name for s in children} >= {"admission", "body", "queue wait", "prefill", "forwards", "readout"}
