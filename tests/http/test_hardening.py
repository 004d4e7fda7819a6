"""Hardening: no client, slow or malformed, holds a slot, gets a 5xx, or gets an answer outside the envelope.

Socket behaviour is tested over real sockets against a real uvicorn running the service's own
HTTP protocol (server_config); body rules through the real app in process.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from harness.server import LOOPBACK, ServiceProcess
from semif_serve.app import Service, create_app
from semif_serve.http.auth import Authenticator, presented_token
from semif_serve.http.errors import ServiceError
from semif_serve.http.json_body import MAX_DEPTH, MAX_INT_DIGITS, BodyError, decode_json_object
from semif_serve.http.server import server_config
from semif_serve.tools.demo import DEMO_REVISION
from tests.support import TOKEN, decision, make_settings
from tests.support.polling import wait_until

AUTH = f"Authorization: Bearer {TOKEN}\r\n"


class HardenedServer:
    """A real uvicorn on loopback with the service's protocol (envelope 400s, header deadline)."""

    def __init__(self, app, header_timeout_seconds: float = 10.0) -> None:
        config = server_config(app, LOOPBACK, 0, header_timeout_seconds, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.port = 0

    def __enter__(self) -> HardenedServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def connect(self, head: bytes) -> socket.socket:
        """A raw connection that has sent `head` and nothing more."""
        sock = socket.create_connection((LOOPBACK, self.port))
        sock.sendall(head)
        return sock


def read_response(sock: socket.socket, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of the one response on `sock`, read until the server closes."""
    sock.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        length = [line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
        if sep and length and len(body) >= int(length[0].split(b":")[1]):
            break
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def post_head(path: str = "/decide", length: int = 1000, auth: str = AUTH, host: str = "t") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Length: {length}\r\n\r\n".encode()


def assert_envelope(status: int, headers: dict, body: bytes, want_status: int, code: str) -> dict:
    assert status == want_status, body
    assert headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert error["code"] == code
    assert error["request_id"] == headers["x-request-id"]
    assert TOKEN not in body.decode("utf-8", "replace")
    return error


@pytest.fixture
def two_slots(engine, checkpoint):
    service = Service.start(make_settings(checkpoint, max_queue=2, body_timeout_seconds=30), engine=engine)
    return create_app(service)


# 1. Slots: authentication first, a body deadline, a header deadline.


def test_idle_unauthenticated_connections_never_take_a_slot(two_slots):
    with HardenedServer(two_slots) as server:
        idle = [server.connect(post_head(auth="")) for _ in range(6)]
        wrong = [server.connect(post_head(auth="Authorization: Bearer wrong\r\n")) for _ in range(6)]
        for sock in idle + wrong:
            status, headers, body = read_response(sock)
            assert_envelope(status, headers, body, 401, "unauthorized")
            sock.close()
        assert two_slots.admission.in_progress == 0
        ok = httpx.post(f"{server.url}/decide", json=decision(), headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200


def test_without_a_valid_token_401_comes_before_429_and_413(two_slots):
    with HardenedServer(two_slots) as server:
        holders = [server.connect(post_head()) for _ in range(2)]
        assert wait_until(lambda: two_slots.admission.in_progress == 2)
        for head in (post_head(auth=""), post_head(auth="", length=10**9)):
            status, headers, body = read_response(server.connect(head))
            assert_envelope(status, headers, body, 401, "unauthorized")
        status, headers, body = read_response(server.connect(post_head()))
        assert_envelope(status, headers, body, 429, "busy")
        for sock in holders:
            sock.close()


def test_health_counts_the_slots_held_by_bodies_still_arriving(two_slots):
    with HardenedServer(two_slots) as server:
        holders = [server.connect(post_head() + b'{"id": ') for _ in range(2)]
        assert wait_until(lambda: two_slots.admission.in_progress == 2)
        health = httpx.get(f"{server.url}/health").json()
        assert health["queue"]["reading_bodies"] == 2
        assert health["queue"]["in_progress"] == 2
        for sock in holders:
            sock.close()
        assert wait_until(lambda: two_slots.admission.in_progress == 0)
        assert httpx.get(f"{server.url}/health").json()["queue"]["reading_bodies"] == 0


def test_a_body_that_does_not_arrive_in_time_gets_408_and_frees_its_slot(engine, checkpoint):
    service = Service.start(make_settings(checkpoint, max_queue=1, body_timeout_seconds=0.5), engine=engine)
    app = create_app(service)
    with HardenedServer(app) as server:
        started = time.monotonic()
        sock = server.connect(post_head() + b'{"id": "q1"')
        status, headers, body = read_response(sock)
        assert time.monotonic() - started < 5
        error = assert_envelope(status, headers, body, 408, "body_timeout")
        assert "0.5 seconds" in error["message"]
        assert sock.recv(1) == b""  # the connection is closed
        assert wait_until(lambda: app.admission.in_progress == 0)
        ok = httpx.post(f"{server.url}/decide", json=decision(), headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200


def test_headers_that_stop_arriving_get_408_and_the_connection_is_closed(two_slots):
    with HardenedServer(two_slots, header_timeout_seconds=0.5) as server:
        sock = server.connect(b"POST /decide HTTP/1.1\r\nHost: t\r\n")
        status, headers, body = read_response(sock)
        assert_envelope(status, headers, body, 408, "header_timeout")
        assert sock.recv(1) == b""


def test_a_connection_that_sends_nothing_is_closed_without_an_answer(two_slots):
    with HardenedServer(two_slots, header_timeout_seconds=0.5) as server:
        sock = server.connect(b"")
        sock.settimeout(5)
        assert sock.recv(1) == b""


def test_a_kept_alive_connection_gets_a_new_header_deadline_after_each_response(two_slots):
    with HardenedServer(two_slots, header_timeout_seconds=0.5) as server:
        sock = server.connect(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        status, _, _ = read_response(sock)
        assert status == 200
        time.sleep(0.3)  # the client's own idling, within the deadline: it waits for nothing
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")  # started within the deadline, never finished
        status, headers, body = read_response(sock)
        assert_envelope(status, headers, body, 408, "header_timeout")


# 5. The HTTP layer's own refusals are in the envelope.


@pytest.mark.parametrize(
    "header",
    [
        b"Content-Length: +12",
        b"Content-Length: 0x10",
        "Content-Length: \uff11\uff12".encode(),
        b"Content-Length: 1 2",
        b"X-Padding: " + b"a" * 100_000,
        b"Bad Header: x",
    ],
    ids=["plus", "hex", "fullwidth-digits", "space", "100kb-header", "space-in-name"],
)
def test_a_request_the_http_parser_refuses_is_answered_in_the_envelope(two_slots, header):
    with HardenedServer(two_slots) as server:
        sock = server.connect(b"POST /decide HTTP/1.1\r\nHost: t\r\n" + header + b"\r\n\r\n{}")
        status, headers, body = read_response(sock)
        error = assert_envelope(status, headers, body, 400, "invalid_http_request")
        assert error["field"] is None
        assert headers["connection"] == "close"


# 6. Paths are matched as sent.


@pytest.mark.parametrize("path", ["/decide/", "/decide/shared/", "/decide%2Fshared", "/decid%65", "/health/"])
def test_a_path_that_is_not_exactly_a_route_is_404_never_a_redirect(two_slots, path):
    with HardenedServer(two_slots) as server:
        sock = server.connect(post_head(path=path, length=2, host="evil.example") + b"{}")
        status, headers, body = read_response(sock)
        assert_envelope(status, headers, body, 404, "not_found")
        assert "location" not in headers


# 7. Strict bearer parsing.


@pytest.mark.parametrize(
    "value",
    [f"Bearer {TOKEN}", f"bearer {TOKEN}", f"BEARER {TOKEN}  ", f"Bearer {TOKEN}\t \t"],
)
def test_exactly_bearer_space_token_and_trailing_ascii_blanks_are_accepted(value):
    assert presented_token(value.encode()) == TOKEN.encode()


@pytest.mark.parametrize(
    "value",
    [
        f"Bearer  {TOKEN}".encode(),
        f"Bearer\t{TOKEN}".encode(),
        f" Bearer {TOKEN}".encode(),
        f"Bearer {TOKEN}\u00a0".encode(),
        f"Bearer {TOKEN}\u0085".encode(),
        f"Bearer {TOKEN}".encode() + b"\xa0",
        f"Bearer {TOKEN}\x00".encode(),
        f"Bearer {TOKEN}\x0b".encode(),
        f"Bearer {TOKEN}\n".encode(),
        f"Bearer {TOKEN} x".encode(),
        f"Basic {TOKEN}".encode(),
        b"Bearer ",
        b"Bearer",
        b"",
    ],
)
def test_anything_but_exactly_one_bearer_token_is_401(value):
    with pytest.raises(ServiceError) as refused:
        Authenticator(TOKEN).check(value)
    assert refused.value.status == 401 and refused.value.code == "unauthorized"
    assert TOKEN not in refused.value.message


@pytest.mark.parametrize(
    "auth",
    [
        f"Authorization: Bearer {TOKEN}\xa0\r\n".encode("latin-1"),
        f"Authorization: Bearer {TOKEN}\u0085\r\n".encode(),
        f"Authorization: Bearer {TOKEN}\x01\r\n".encode(),
        f"Authorization: Bearer {TOKEN[:-1]}\r\n".encode(),
    ],
    ids=["nbsp", "nel", "control-character", "wrong"],
)
def test_a_lenient_or_wrong_token_over_http_is_401_without_echoing_it(two_slots, auth):
    with HardenedServer(two_slots) as server:
        body = json.dumps(decision()).encode()
        head = (
            b"POST /decide HTTP/1.1\r\nHost: t\r\n" + auth + f"Content-Length: {len(body)}\r\n\r\n".encode()
        )
        status, headers, reply = read_response(server.connect(head + body))
        error = assert_envelope(status, headers, reply, 401, "unauthorized")
        assert error["field"] == "Authorization"
        assert headers["www-authenticate"] == "Bearer"


def test_private_metrics_use_the_same_strict_check(engine, checkpoint):
    service = Service.start(make_settings(checkpoint, metrics_public=False), engine=engine)
    app = create_app(service)
    with HardenedServer(app) as server:
        lenient = f"GET /metrics HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {TOKEN}\u00a0\r\n\r\n"
        status, headers, body = read_response(server.connect(lenient.encode()))
        assert_envelope(status, headers, body, 401, "unauthorized")
        strict = f"GET /metrics HTTP/1.1\r\nHost: t\r\nAuthorization: bearer {TOKEN} \t\r\n\r\n"
        sock = server.connect(strict.encode())
        sock.settimeout(10)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")


# 2 and 3. Bodies: surrogates, huge integers, depth.


def test_a_lone_surrogate_escape_is_422_naming_the_field_before_the_model_runs(client, service, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the engine ran on a body that should have been refused")

    monkeypatch.setattr(service, "decide", never)  # every door's one way to a method and the engine
    cases = {
        "id": b'"q\\ud800"',
        "question": b'"why\\udfff"',
    }
    for field, value in cases.items():
        body = json.dumps(decision(**{field: "PLACEHOLDER"})).encode().replace(b'"PLACEHOLDER"', value)
        response = client.post("/decide", content=body)
        assert response.status_code == 422, response.text
        assert response.json()["error"] == {
            "code": "validation_error",
            "message": response.json()["error"]["message"],
            "field": field,
            "request_id": response.headers["x-request-id"],
        }
        assert "surrogate" in response.json()["error"]["message"]
    nested = json.dumps(decision(options=[{"id": "a", "description": "x"}, {"id": "b", "description": "S"}]))
    body = nested.replace('"S"', '"\\ud83d"').encode()
    response = client.post("/decide", content=body)
    assert response.json()["error"]["field"] == "options[1].description"
    shared = {"state": {"log": ["ok", "PLACEHOLDER"]}, "decisions": [decision()]}
    body = json.dumps(shared).encode().replace(b'"PLACEHOLDER"', b'"\\udc00"')
    response = client.post("/decide/shared", content=body)
    assert response.status_code == 422
    assert response.json()["error"]["field"] == "state.log[1]"


def test_a_surrogate_pair_escape_is_a_real_character_and_accepted(client):
    body = json.dumps(decision(question="PLACEHOLDER")).encode()
    body = body.replace(b'"PLACEHOLDER"', b'"Did it go \\ud83d\\ude00?"')
    assert client.post("/decide", content=body).status_code == 200


def test_raw_surrogate_bytes_are_400_invalid_json(client):
    body = json.dumps(decision(id="PLACEHOLDER")).encode().replace(b"PLACEHOLDER", b"q\xed\xa0\x80")
    response = client.post("/decide", content=body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"
    assert "UTF-8" in response.json()["error"]["message"]


def test_an_integer_over_4300_digits_is_422_even_in_an_ignored_field(client):
    huge = "9" * (MAX_INT_DIGITS + 1)
    for route, payload in (
        ("/decide", decision(label="PLACEHOLDER")),
        ("/decide/shared", {"state": "s", "decisions": [decision(label="PLACEHOLDER")]}),
    ):
        body = json.dumps(payload).encode().replace(b'"PLACEHOLDER"', b"-" + huge.encode())
        response = client.post(route, content=body)
        assert response.status_code == 422, response.text
        field = "label" if route == "/decide" else "decisions[0].label"
        assert response.json()["error"]["field"] == field
    exactly = json.dumps(decision(label="PLACEHOLDER")).encode()
    exactly = exactly.replace(b'"PLACEHOLDER"', b"9" * MAX_INT_DIGITS)
    assert client.post("/decide", content=exactly).status_code == 200


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 100_000])
def test_nesting_past_the_depth_limit_is_400_invalid_json(client, depth):
    body = json.dumps(decision(label="PLACEHOLDER")).encode()
    body = body.replace(b'"PLACEHOLDER"', b"[" * depth + b"]" * depth)
    response = client.post("/decide", content=body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"
    assert "nests deeper" in response.json()["error"]["message"]


def test_the_decoder_accepts_nesting_exactly_at_the_limit_and_returns_the_object():
    inner = "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1)
    assert decode_json_object(f'{{"a": {inner}}}'.encode())["a"] == json.loads(inner)
    with pytest.raises(BodyError) as refused:
        decode_json_object(f'{{"a": [{inner}]}}'.encode())
    assert refused.value.code == "invalid_json"


def test_the_decoder_names_a_surrogate_key_by_its_container():
    with pytest.raises(BodyError) as refused:
        decode_json_object(b'{"state": {"\\ud800": 1}}')
    assert (refused.value.code, refused.value.field) == ("validation_error", "state")


# Error bodies: one serialisation.


def test_admission_errors_and_route_errors_are_serialised_byte_for_byte_alike(engine, checkpoint):
    service = Service.start(make_settings(checkpoint, max_body_bytes=100), engine=engine)
    app = create_app(service)
    with HardenedServer(app) as server:
        auth = {"Authorization": f"Bearer {TOKEN}", "X-Request-ID": "same-id"}
        too_large = httpx.post(f"{server.url}/decide", content=b"x" * 101, headers=auth)
        invalid = httpx.post(f"{server.url}/decide", content=b'{"id": 1}', headers=auth)
    assert (too_large.status_code, invalid.status_code) == (413, 422)
    for response in (too_large, invalid):
        compact = json.dumps(json.loads(response.content), separators=(",", ":"), ensure_ascii=False)
        assert response.content == compact.encode()
        assert response.headers["content-length"] == str(len(response.content))
    assert too_large.content.startswith(b'{"error":{"code":"body_too_large","message":')
    assert invalid.content.startswith(b'{"error":{"code":"validation_error","message":')


# 4. Shutdown, with a real process and real signals.

DRAIN_GRACE = 6.0  # long enough to finish the in-flight request on a busy CPU, short enough to wait out


def serving(checkpoint, tmp_path, grace: float) -> ServiceProcess:
    settings = {"device": "cpu", "shutdown_grace_seconds": grace, "body_timeout_seconds": 60}
    return ServiceProcess(checkpoint, DEMO_REVISION, settings, tmp_path, startup_timeout=300)


def stuck_post(port: int, token: str) -> socket.socket:
    """A POST whose body never finishes: it holds its slot until the body deadline."""
    sock = socket.create_connection((LOOPBACK, port))
    sock.sendall(post_head(auth=f"Authorization: Bearer {token}\r\n") + b'{"id":')
    return sock


def in_progress(service: ServiceProcess) -> int:
    """The requests holding a slot now, as /health counts them."""
    return httpx.get(f"{service.url}/health", timeout=10).json()["queue"]["in_progress"]


def has_logged(service: ServiceProcess, prefix: str) -> bool:
    """Whether a whole JSON line of the process's log has a message starting with `prefix` yet."""
    text = service.log_path.read_text()
    whole = text[: text.rfind("\n") + 1].splitlines()  # the last line may be half written
    messages = [json.loads(line).get("message", "") for line in whole if line.startswith("{")]
    return any(message.startswith(prefix) for message in messages)


@dataclass
class Drain:
    """What one service process showed from SIGTERM to its exit (see `drained`)."""

    health: httpx.Response
    refused: httpx.Response
    finished_status: int
    cancelled: tuple[int, dict[str, str], bytes]
    cancelled_after: float
    exit_code: int
    log: str


@pytest.fixture(scope="module")
def drained(checkpoint, tmp_path_factory) -> Drain:
    """One real process, two requests open at SIGTERM: one whose body then arrives, one whose never does.

    A single startup serves both drain tests (each real startup loads the model and tokenizer).
    """
    body = json.dumps(decision()).encode()
    with serving(checkpoint, tmp_path_factory.mktemp("drain"), grace=DRAIN_GRACE) as service:
        auth = f"Authorization: Bearer {service.token}\r\n"
        in_flight = socket.create_connection((LOOPBACK, service.port))
        in_flight.sendall(post_head(length=len(body), auth=auth) + body[:10])
        stuck = stuck_post(service.port, service.token)
        wait_until(lambda: in_progress(service) == 2, what="both requests holding their slots")
        signalled = time.monotonic()
        service.process.send_signal(signal.SIGTERM)
        wait_until(lambda: has_logged(service, "draining"), what="the drain's log line")
        health = httpx.get(f"{service.url}/health", timeout=10)
        refused = httpx.post(
            f"{service.url}/decide", json=decision(), headers={"Authorization": f"Bearer {service.token}"}
        )
        in_flight.sendall(body[10:])
        finished, _, _ = read_response(in_flight, timeout=DRAIN_GRACE)
        cancelled = read_response(stuck, timeout=DRAIN_GRACE + 10)
        cancelled_after = time.monotonic() - signalled
        exit_code = service.process.wait(timeout=30)
        in_flight.close()
        stuck.close()
        return Drain(
            health=health,
            refused=refused,
            finished_status=finished,
            cancelled=cancelled,
            cancelled_after=cancelled_after,
            exit_code=exit_code,
            log=service.log_path.read_text(),
        )


def test_sigterm_drains_finishes_the_request_in_flight_and_exits(drained: Drain):
    assert drained.health.status_code == 503 and drained.health.json()["status"] == "draining"
    assert drained.refused.status_code == 503 and drained.refused.json()["error"]["code"] == "draining"
    assert drained.finished_status == 200
    assert drained.exit_code == 0


def test_shutdown_takes_one_grace_period_in_total_and_logs_the_cancelled_request(drained: Drain):
    assert drained.cancelled_after < DRAIN_GRACE + 1.0, drained.cancelled_after
    assert_envelope(*drained.cancelled, 503, "draining")
    lines = [json.loads(line) for line in drained.log.splitlines() if line.startswith("{")]
    assert logged(lines, "request cancelled")
    assert "Exception in ASGI application" not in drained.log
    # Before the fix the server waited for the drain, then for uvicorn's own grace again.
    served = stamp(logged(lines, "Finished server process")) - stamp(logged(lines, "draining"))
    assert served < DRAIN_GRACE + 1.0, served


def logged(lines: list[dict], prefix: str) -> dict:
    """The first JSON log line whose message starts with `prefix`."""
    return next(line for line in lines if line.get("message", "").startswith(prefix))


def stamp(line: dict) -> float:
    """Seconds of a JSON log line's timestamp."""
    clock = line["ts"].rstrip("Z").split("T")[1]
    hours, minutes, seconds = clock.split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def test_a_second_signal_exits_at_once(checkpoint, tmp_path):
    with serving(checkpoint, tmp_path, grace=60) as service:
        sock = stuck_post(service.port, service.token)
        wait_until(lambda: in_progress(service) == 1, what="the stuck request holding its slot")
        service.process.send_signal(signal.SIGTERM)
        wait_until(lambda: has_logged(service, "draining"), what="the drain's log line")
        assert service.process.poll() is None  # draining, waiting for the stuck request
        service.process.send_signal(signal.SIGINT)
        service.process.wait(timeout=60)
        log = service.log_path.read_text()
        sock.close()
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    served = stamp(logged(lines, "Finished server process")) - stamp(logged(lines, "second signal"))
    assert served < 1.0, served  # before the fix: the whole grace period again
    assert logged(lines, "request cancelled")
    assert "Exception in" not in log
