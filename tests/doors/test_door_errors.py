"""Refusals made by admission, before any route runs (401, 408, 413, 415, 400, 429, 503, 404), are
answered in the shape of the door that owns the path: the native envelope on `/decide*`, TypeSafe's
`{"detail": {"error_type", "message"}}` on `/v1/*`, with `retry-after-ms` beside `retry-after`
there; every body is compact JSON."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket

import httpx
import pytest

from harness.server import LoopbackServer
from semif_serve.app import create_app
from semif_serve.service.startup import Service
from tests.http.test_admission import Exchange, scope, while_every_slot_is_taken
from tests.support import TOKEN, decision, make_settings
from tests.support.batch import assert_close

AUTH = {"Authorization": f"Bearer {TOKEN}"}
LIMIT = 4000


def systemone_body() -> dict:
    return {
        "model": "jev-latest",
        "state": "Health checks passed in all three zones.",
        "questions": {"ok": {"type": "noul", "instructions": "Did the deployment succeed?"}},
    }


BODIES = {"/decide": decision, "/v1/systemone": systemone_body}


def refusal(path: str, response: httpx.Response) -> str:
    """The code or error_type of a refusal, after checking the body is exactly the door's shape."""
    compact = json.dumps(response.json(), separators=(",", ":"), ensure_ascii=False).encode()
    assert response.content == compact
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    if path.startswith("/v1/"):
        assert list(body) == ["detail"]
        assert set(body["detail"]) == {"error_type", "message"}
        assert body["detail"]["message"]
        return body["detail"]["error_type"]
    assert list(body) == ["error"]
    assert {"code", "message", "field", "request_id"} <= set(body["error"])
    return body["error"]["code"]


@pytest.fixture(scope="module")
def server(engine, checkpoint):
    service = Service.start(make_settings(checkpoint, max_body_bytes=LIMIT), engine=engine)
    with LoopbackServer(create_app(service)) as running:
        yield running


def post(server, path: str, content: bytes, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60)


PLAIN = {"Content-Type": "application/json"}
# name -> (headers, body for a path, status, native code, TypeSafe error_type)
CASES = {
    "missing token": (
        PLAIN,
        lambda p: json.dumps(BODIES[p]()).encode(),
        401,
        "unauthorized",
        "authentication_error",
    ),
    "wrong token": (
        {**PLAIN, "Authorization": "Bearer not-it"},
        lambda p: json.dumps(BODIES[p]()).encode(),
        401,
        "unauthorized",
        "authentication_error",
    ),
    "body over the limit": (
        {**PLAIN, **AUTH},
        lambda p: b" " * (LIMIT + 1),
        413,
        "body_too_large",
        "request_too_large",
    ),
    "body inflating past the limit": (
        {**PLAIN, **AUTH, "Content-Encoding": "gzip"},
        lambda p: gzip.compress(b" " * 10 * LIMIT),
        413,
        "body_too_large",
        "request_too_large",
    ),
    "unsupported coding": (
        {**PLAIN, **AUTH, "Content-Encoding": "br"},
        lambda p: b"\x0b\x01\x80{}\x03",
        415,
        "unsupported_content_encoding",
        "api_usage_error",
    ),
    "corrupt gzip": (
        {**PLAIN, **AUTH, "Content-Encoding": "gzip"},
        lambda p: gzip.compress(json.dumps(BODIES[p]()).encode())[:-5],
        400,
        "invalid_compressed_body",
        "api_usage_error",
    ),
}


@pytest.mark.parametrize("path", ["/decide", "/v1/systemone"])
@pytest.mark.parametrize("case", list(CASES))
def test_an_admission_refusal_is_in_the_shape_of_the_door_that_owns_the_path(server, path, case):
    headers, body, status, native_code, error_type = CASES[case]
    response = post(server, path, body(path), headers)
    assert response.status_code == status, response.text
    assert refusal(path, response) == (error_type if path.startswith("/v1/") else native_code)
    if status == 401:
        assert response.headers["www-authenticate"] == "Bearer"
    assert TOKEN not in response.text


def test_the_models_route_refuses_a_missing_token_in_typesafes_shape(server):
    response = httpx.get(f"{server.url}/v1/models")
    assert response.status_code == 401
    assert refusal("/v1/models", response) == "authentication_error"


@pytest.mark.parametrize("path", ["/decide", "/v1/systemone"])
def test_both_doors_answer_the_same_valid_body_after_a_gzip_round_trip(server, path):
    body = json.dumps(BODIES[path]()).encode()
    plain = post(server, path, body, {**PLAIN, **AUTH})
    packed = post(server, path, gzip.compress(body), {**PLAIN, **AUTH, "Content-Encoding": "gzip"})
    assert (plain.status_code, packed.status_code) == (200, 200), packed.text
    if path.startswith("/v1/"):  # its default orderings share a state: the repeat reads the stored one
        assert_close(packed.json()["answers"], plain.json()["answers"])


def test_a_percent_encoded_systemone_path_is_404_in_typesafes_shape(server):
    response = httpx.post(f"{server.url}/v1/system%6Fne", json=systemone_body(), headers=AUTH)
    assert response.status_code == 404
    assert refusal("/v1/", response) == "not_found"


@pytest.fixture
def two_slots(engine, checkpoint):
    return create_app(Service.start(make_settings(checkpoint, max_queue=2), engine=engine))


def as_response(exchange: Exchange) -> httpx.Response:
    body = b"".join(m.get("body", b"") for m in exchange.messages if m["type"] == "http.response.body")
    return httpx.Response(exchange.status, headers=exchange.headers, content=body)


@pytest.mark.parametrize("path", ["/decide", "/v1/systemone"])
def test_busy_is_429_in_the_doors_shape_and_systemone_adds_retry_after_ms(two_slots, path):
    refused = as_response(while_every_slot_is_taken(two_slots, path=path, body=b"{}"))
    assert refused.status_code == 429
    assert refusal(path, refused) == ("rate_limit_error" if path.startswith("/v1/") else "busy")
    seconds = int(refused.headers["retry-after"])
    if path.startswith("/v1/"):
        assert int(refused.headers["retry-after-ms"]) == seconds * 1000
    else:
        assert "retry-after-ms" not in refused.headers


@pytest.mark.parametrize("path", ["/decide", "/v1/systemone"])
def test_draining_is_503_in_the_doors_shape_with_retry_after(two_slots, path):
    two_slots.admission.draining = True
    exchange = Exchange([json.dumps(BODIES[path]()).encode()])
    asyncio.run(two_slots(scope(path=path), exchange.receive, exchange.send))
    refused = as_response(exchange)
    assert refused.status_code == 503
    assert refusal(path, refused) == ("overloaded_error" if path.startswith("/v1/") else "draining")
    seconds = int(refused.headers["retry-after"])
    assert ("retry-after-ms" in refused.headers) == path.startswith("/v1/")
    if path.startswith("/v1/"):
        assert int(refused.headers["retry-after-ms"]) == seconds * 1000


@pytest.mark.parametrize("path", ["/decide", "/v1/systemone"])
def test_a_body_that_stops_arriving_is_408_in_the_doors_shape(engine, checkpoint, path):
    service = Service.start(make_settings(checkpoint, body_timeout_seconds=0.5), engine=engine)
    app = create_app(service)
    with LoopbackServer(app) as running:
        port = int(running.url.rsplit(":", 1)[1])
        head = (
            f"POST {path} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 100\r\n\r\n"
        )
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(head.encode() + b'{"state": ')
            sock.settimeout(10)
            raw = b""
            while chunk := sock.recv(65536):
                raw += chunk
    head_text, _, body = raw.partition(b"\r\n\r\n")
    assert head_text.startswith(b"HTTP/1.1 408")
    headers = dict(
        line.split(": ", 1) for line in head_text.decode("latin-1").lower().split("\r\n")[1:] if ": " in line
    )
    response = httpx.Response(408, headers=headers, content=body)
    assert refusal(path, response) == ("timeout_error" if path.startswith("/v1/") else "body_timeout")
    assert app.admission.in_progress == 0
