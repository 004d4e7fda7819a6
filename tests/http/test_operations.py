"""Operations: metrics, request ids and JSON request logs (the SIGTERM drain is in test_hardening)."""

from __future__ import annotations

import json

import httpx

from semif_serve.app import create_app
from semif_serve.service.startup import Service
from tests.support import TOKEN, decision, make_settings, request_log_lines


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample in Prometheus text format (0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == (f"{name}{{{wanted}}}" if labels else name):
            return float(value)
    return 0.0


def test_a_decision_moves_the_request_row_and_forward_counters(client):
    before = client.get("/metrics").text
    assert client.post("/decide", json=decision(orderings="rotations")).status_code == 200
    after = client.get("/metrics").text
    assert (
        metric(after, "semif_requests_total", route="/decide", status="200")
        == metric(before, "semif_requests_total", route="/decide", status="200") + 1
    )
    assert metric(after, "semif_rows_scored_total") == metric(before, "semif_rows_scored_total") + 2
    assert metric(after, "semif_forward_seconds_count") == metric(before, "semif_forward_seconds_count") + 1
    assert metric(after, "semif_prefix_tokens_count") == metric(before, "semif_prefix_tokens_count") + 1
    for name in (
        "semif_requests_in_progress",
        "semif_queue_depth",
        "semif_busy_rejections_total",
        "semif_out_of_memory_total",
        "semif_memory_reserved_bytes",
        "semif_memory_baseline_bytes",
        "semif_memory_releases_total",
        "semif_request_seconds_count",
    ):
        assert name in after


def test_a_refused_request_is_counted_under_its_status(client):
    before = client.get("/metrics").text
    assert client.post("/decide", auth=False, json=decision()).status_code == 401
    after = client.get("/metrics").text
    assert (
        metric(after, "semif_requests_total", route="/decide", status="401")
        == metric(before, "semif_requests_total", route="/decide", status="401") + 1
    )


def test_metrics_can_be_put_behind_the_token(engine, checkpoint):
    import asyncio

    service = Service.start(make_settings(checkpoint, metrics_public=False), engine=engine)
    app = create_app(service)

    async def go(headers):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get("/metrics", headers=headers)

    assert asyncio.run(go({})).status_code == 401
    assert asyncio.run(go({"Authorization": f"Bearer {TOKEN}"})).status_code == 200


def test_a_sane_caller_request_id_is_echoed_and_an_insane_one_replaced(client):
    echoed = client.post("/decide", json=decision(), headers={"X-Request-ID": "caller-42.a:b"})
    assert echoed.headers["x-request-id"] == "caller-42.a:b"
    for bad in ("has space", "x" * 129, "semi;colon"):
        replaced = client.get("/health", headers={"X-Request-ID": bad})
        assert replaced.headers["x-request-id"] != bad
        assert len(replaced.headers["x-request-id"]) == 32
    error = client.post("/decide", json={"id": "x"}, headers={"X-Request-ID": "err-1"})
    assert error.headers["x-request-id"] == "err-1"
    assert error.json()["error"]["request_id"] == "err-1"


def test_every_request_logs_one_json_line_without_the_state_or_the_token(client):
    secret_state = "Zone 7 secret migration notes"
    with request_log_lines() as lines:
        client.post(
            "/decide", json=decision(state=secret_state, workload=None), headers={"X-Request-ID": "log-1"}
        )
        client.post(
            "/decide",
            auth=False,
            json=decision(state=secret_state),
            headers={"Authorization": "Bearer wrong-" + TOKEN, "X-Request-ID": "log-2"},
        )
    first = next(line for line in lines if line.get("request_id") == "log-1")
    assert first["route"] == "/decide" and first["status"] == 200
    assert first["rows"] == 1 and first["input_tokens"] > 0 and first["forward_seconds"] > 0
    assert "duration_ms" in first
    second = next(line for line in lines if line.get("request_id") == "log-2")
    assert second["status"] == 401
    text = json.dumps(lines)
    assert secret_state not in text and TOKEN not in text


def test_livez_stays_200_while_draining_when_health_turns_503(client):
    before = client.get("/livez", auth=False)
    assert (before.status_code, before.json()) == (200, {"status": "alive"})
    client.app.admission.draining = True
    try:
        assert client.get("/health", auth=False).status_code == 503
        during = client.get("/livez", auth=False)
        assert (during.status_code, during.json()) == (200, {"status": "alive"})
    finally:
        client.app.admission.draining = False


def test_a_reply_is_counted_and_logged_before_its_last_byte_leaves(service):
    """A client that has read a reply and then reads /metrics finds it counted: the count is
    taken before the last body message is handed to the server."""
    import asyncio

    app = create_app(service)
    body = json.dumps(decision()).encode()
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/decide",
        "raw_path": b"/decide",
        "query_string": b"",
        "headers": [
            (b"authorization", f"Bearer {TOKEN}".encode()),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8032),
        "scheme": "http",
        "http_version": "1.1",
    }
    seen: list[tuple[float, int]] = []

    def counted() -> float:
        return (
            app.metrics.registry.get_sample_value(
                "semif_requests_total", {"route": "/decide", "status": "200"}
            )
            or 0.0
        )

    given = []

    async def receive():
        if not given:
            given.append(True)
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays connected

    async def send(message):
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            with request_log_lines() as lines:
                pass
            seen.append((counted(), len(lines)))

    before = counted()
    with request_log_lines() as logged:
        asyncio.run(app(scope, receive, send))
    assert seen == [(before + 1, 0)]  # counted when the last byte left
    assert [line["route"] for line in logged] == ["/decide"]  # and logged once
