"""Hostile connections: a client without a token, or on a path that reads no body, takes no
slot and holds no connection (it is answered at once, its body unread, and the connection is
closed after the answer, whatever it sends next); a folded header is refused. Over real
sockets against a real uvicorn."""

from __future__ import annotations

import time

import httpx
import pytest

from semif_serve.app import Service, create_app
from tests.http.test_hardening import HardenedServer, assert_envelope, read_response, wait_until
from tests.support import TOKEN, decision, make_settings


@pytest.fixture(scope="module")
def four_slots(engine, checkpoint):
    service = Service.start(make_settings(checkpoint, max_queue=4, body_timeout_seconds=30), engine=engine)
    return create_app(service)


@pytest.fixture(scope="module")
def server(four_slots):
    with HardenedServer(four_slots) as running:
        yield running


def head(method: str, path: str, extra: str = "") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: t\r\n{extra}\r\n".encode()


def closed_within(sock, seconds: float) -> bool:
    """Whether the server closes `sock` within `seconds` (reading whatever it still sends)."""
    sock.settimeout(seconds)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if sock.recv(65536) == b"":
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return False


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("POST", "/nope", 404, "not_found"),
        ("POST", "/health", 405, "method_not_allowed"),
        ("POST", "/livez", 405, "method_not_allowed"),
        ("POST", "/playground", 405, "method_not_allowed"),
    ],
)
def test_a_post_that_no_route_reads_is_answered_at_once_without_its_body_or_a_slot(
    server, four_slots, method, path, status, code
):
    started = time.monotonic()
    sock = server.connect(head(method, path, "Content-Length: 1000000\r\n") + b"{")
    got, headers, body = read_response(sock)
    assert time.monotonic() - started < 3  # not after the 30 s body deadline
    assert got == status, body
    assert four_slots.admission.in_progress == 0
    assert closed_within(sock, 3)


def test_clients_without_a_token_cannot_make_an_authenticated_request_get_429(server, four_slots):
    hostile = []
    for path in ("/nope", "/health", "/livez", "/playground", "/decide", "/v1/systemone") * 2:
        sock = server.connect(head("POST", path, "Content-Length: 1000000\r\n") + b"{")
        hostile.append(sock)
    for sock in hostile:
        read_response(sock)  # each answered (401, 404 or 405) while its body is still owed
    assert four_slots.admission.in_progress == 0
    ok = httpx.post(f"{server.url}/decide", json=decision(), headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200
    for sock in hostile:
        sock.close()


@pytest.mark.parametrize(
    "framing",
    ["Content-Length: 1000000\r\n", "Transfer-Encoding: chunked\r\n"],
    ids=["content-length", "chunked"],
)
@pytest.mark.parametrize("path", ["/livez", "/health"])
def test_a_connection_whose_body_was_left_unread_closes_after_the_reply_whatever_comes_next(
    server, framing, path
):
    socks = [server.connect(head("GET", path, framing)) for _ in range(20)]
    for sock in socks:
        status, _, _ = read_response(sock)
        assert status == 200
        try:
            sock.sendall(b"5")  # one more byte of the body, then nothing
        except (BrokenPipeError, ConnectionResetError):
            pass  # already closed: what the test wants
    for sock in socks:
        assert closed_within(sock, 5)


def test_a_refused_post_whose_body_is_still_owed_closes_its_connection_and_says_so(server):
    sock = server.connect(head("POST", "/decide", "Content-Length: 1000000\r\n") + b"{")
    status, headers, body = read_response(sock)
    assert_envelope(status, headers, body, 401, "unauthorized")
    # Said in the head: a keep-alive client must not send its next request on this connection.
    assert headers.get("connection") == "close", headers
    sock.sendall(b'"id": ')
    assert closed_within(sock, 5)


def test_a_keep_alive_client_whose_post_was_refused_unread_sends_its_next_request_on_a_new_connection(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for _ in range(5):  # the next POST had raced the server's close: "Server disconnected"
            refused = client.post(
                "/decide", content=b"{" * 2_000_000, headers={"Authorization": f"Bearer {TOKEN}"}
            )
            assert refused.status_code == 413 and refused.headers["connection"] == "close"
            answered = client.post("/decide", json=decision(), headers={"Authorization": f"Bearer {TOKEN}"})
            assert answered.status_code == 200, answered.text
            assert "close" not in answered.headers.get("connection", "")


def refusal_of_a_body_sent_late(server) -> tuple[int, bytes, bool]:
    """An unauthenticated POST whose body the client sends once the refusal has arrived, before
    reading it (as a client that writes its whole request first does): the refusal's status and
    body as the client reads them, and whether the connection then ended."""
    import select

    sock = server.connect(head("POST", "/decide", "Content-Length: 400000\r\n"))
    try:
        assert select.select([sock], [], [], 10)[0], "no refusal within 10 s"
        for _ in range(20):  # as a client writes its body, piece by piece (a reset fails a write)
            sock.sendall(b"{" * 10_000)
            select.select([], [], [], 0.01)  # pacing the writes, not waiting for anything
        status, headers, body = read_response(sock)
        return status, body, closed_within(sock, 5)
    finally:
        sock.close()


def test_a_refusal_sent_before_the_body_is_read_reaches_the_client_whole_every_time(server):
    # Closing a socket with unread bytes sends a reset, which can destroy the reply in flight.
    for _ in range(5):  # a close with unread bytes failed the first of them, every time
        status, body, ended = refusal_of_a_body_sent_late(server)
        assert status == 401, body
        assert b'"code":"unauthorized"' in body
        assert ended


def test_a_kept_alive_connection_still_serves_its_next_request(server):
    with httpx.Client(base_url=server.url) as client:
        first = client.get("/livez")
        second = client.post("/decide", json=decision(), headers={"Authorization": f"Bearer {TOKEN}"})
        third = client.get("/livez")
    assert (first.status_code, second.status_code, third.status_code) == (200, 200, 200)


def test_the_slots_are_back_after_every_hostile_connection(four_slots):
    assert wait_until(lambda: four_slots.admission.in_progress == 0)


@pytest.mark.parametrize("fold", [b"\r\n ", b"\r\n\t"], ids=["space", "tab"])
def test_a_folded_authorization_header_is_refused_not_read_as_one_line(server, fold):
    sock = server.connect(
        b"POST /decide HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer"
        + fold
        + TOKEN.encode()
        + b"\r\nContent-Length: 2\r\n\r\n{}"
    )
    status, headers, body = read_response(sock)
    error = assert_envelope(status, headers, body, 400, "invalid_http_request")
    assert "folded" in error["message"]
    assert closed_within(sock, 5)
