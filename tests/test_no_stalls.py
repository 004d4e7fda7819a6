"""No single request stalls the service: strict framing, bounded work, a free event loop.

Framing over raw sockets against a real uvicorn running the service's own protocol; body rules
through the real app; the engine's encode-once and chunked suffix against plain computations.
"""

from __future__ import annotations

import json

import pytest
from conftest import TOKEN, decision
from test_hardening import AUTH, HardenedServer, assert_envelope, read_response

from semif_serve.app import create_app


@pytest.fixture(scope="module")
def app(service):
    return create_app(service)


@pytest.fixture(scope="module")
def server(app):
    with HardenedServer(app) as running:
        yield running


def closed(sock) -> bool:
    """Whether the server closed the connection (nothing more will come)."""
    sock.settimeout(5)
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


# -- strict framing ------------------------------------------------------------------------------


def test_content_length_with_transfer_encoding_is_400_and_the_request_behind_it_is_never_served(server):
    smuggled = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"
    head = (
        f"POST /decide HTTP/1.1\r\nHost: t\r\n{AUTH}Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    sock = server.connect(head + b"0\r\n\r\n" + smuggled)
    status, headers, body = read_response(sock)
    error = assert_envelope(status, headers, body, 400, "invalid_http_request")
    assert "Content-Length and Transfer-Encoding" in error["message"]
    assert headers["connection"] == "close"
    assert closed(sock)  # the pipelined GET got no answer


@pytest.mark.parametrize(
    "head",
    [
        b"GET /health HTTP/1.1\nHost: t\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: t\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: t\r\nX-A: 1\n\n",
        b"GET /health HTTP/1.1\nHost: t\n\n",
    ],
    ids=["request-line", "header-line", "last-lines", "every-line"],
)
def test_a_bare_lf_in_the_request_head_is_400_and_the_connection_closed(server, head):
    sock = server.connect(head)
    status, headers, body = read_response(sock)
    error = assert_envelope(status, headers, body, 400, "invalid_http_request")
    assert "bare LF" in error["message"]
    assert closed(sock)


def test_a_bare_lf_in_a_pipelined_second_request_is_refused_after_the_first_is_answered(server):
    sock = server.connect(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\nGET /health HTTP/1.1\nHost: t\n\n")
    sock.settimeout(10)
    data = b""
    while data.count(b"HTTP/1.1 ") < 2 or not data.endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    assert data.startswith(b"HTTP/1.1 200")
    assert b"HTTP/1.1 400" in data and b"bare LF" in data


def test_lf_bytes_inside_a_body_are_not_the_head(server):
    body = json.dumps(decision(), indent=1).encode()  # newlines in the body are fine
    assert b"\n" in body
    head = f"POST /decide HTTP/1.1\r\nHost: t\r\n{AUTH}Content-Length: {len(body)}\r\n\r\n".encode()
    status, _, reply = read_response(server.connect(head + body))
    assert status == 200, reply


# -- codings and duplicate keys ------------------------------------------------------------------


def systemone_body(**questions) -> dict:
    return {"model": "jev-latest", "state": "The invoice was paid twice.", "questions": questions}


NOUL = {"type": "noul", "instructions": "Was it paid twice?"}


@pytest.mark.parametrize("coding", ["identity, gzip", "gzip, identity", "identity, identity"])
def test_identity_in_a_stack_of_codings_is_415_on_both_doors(server, coding):
    import gzip

    import httpx

    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Encoding": coding}
    native = httpx.post(
        f"{server.url}/decide", content=gzip.compress(json.dumps(decision()).encode()), headers=headers
    )
    assert native.status_code == 415, native.text
    assert native.json()["error"]["code"] == "unsupported_content_encoding"
    assert native.headers["accept-encoding"] == "gzip, zstd"
    body = gzip.compress(json.dumps(systemone_body(q=NOUL)).encode())
    systemone = httpx.post(f"{server.url}/v1/systemone", content=body, headers=headers)
    assert systemone.status_code == 415, systemone.text
    assert systemone.json()["detail"]["error_type"] == "api_usage_error"


def raw_post(server, path: str, body: bytes):
    import httpx

    return httpx.post(f"{server.url}{path}", content=body, headers={"Authorization": f"Bearer {TOKEN}"})


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (
            b'{"state": "s", "decisions": [{"id": "a", "question": "q?", "question": "r?", '
            b'"options": [{"id": "y", "description": "Y"}, {"id": "n", "description": "N"}]}]}',
            "decisions[0].question",
        ),
        (
            b'{"state": {"zone": 1, "zone": 2}, "decisions": [{"id": "a", "question": "q?", '
            b'"options": [{"id": "y", "description": "Y"}, {"id": "n", "description": "N"}]}]}',
            "state.zone",
        ),
        (
            b'{"id": "a", "id": "b", "state": "s", "question": "q?", '
            b'"options": [{"id": "y", "description": "Y"}, {"id": "n", "description": "N"}]}',
            "id",
        ),
    ],
    ids=["decision-field", "inside-the-state", "top-level"],
)
def test_a_duplicate_key_on_the_native_door_is_422_naming_the_key(server, body, field):
    path = "/decide" if field == "id" else "/decide/shared"
    reply = raw_post(server, path, body)
    assert reply.status_code == 422, reply.text
    error = reply.json()["error"]
    assert (error["code"], error["field"]) == ("validation_error", field)
    assert "more than once" in error["message"]


@pytest.mark.parametrize(
    ("fragment", "where"),
    [
        (b'"questions": {"q": NOUL, "q": NOUL}', "questions.q"),
        (
            b'"questions": {"q": {"type": "choice", '
            b'"criteria": {"billing": "B", "tech": "T", "billing": "C"}}}',
            "questions.q.criteria.billing",
        ),
        (
            b'"questions": {"q": {"type": "noul", "criteria": {"true": "Y", "true": "N"}}}',
            "questions.q.criteria.true",
        ),
    ],
    ids=["questions", "choice-names", "noul-criteria"],
)
def test_a_duplicate_key_on_system_one_is_422_in_its_shape_naming_the_key(server, fragment, where):
    body = (
        b'{"model": "jev-latest", "state": "s", '
        + fragment.replace(b"NOUL", json.dumps(NOUL).encode())
        + b"}"
    )
    reply = raw_post(server, "/v1/systemone", body)
    assert reply.status_code == 422, reply.text
    (item,) = reply.json()["detail"]
    assert item["loc"] == ["body"] and item["type"] == "value_error"
    assert where in item["msg"] and "more than once" in item["msg"]
