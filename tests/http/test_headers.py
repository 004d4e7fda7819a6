"""One reading of every header that decides anything: a header that must be single and is repeated
is a 400 in the door's shape before the body is read, and admission and the doors read the same
values (the body limit and the parse come from one Content-Type).

Framing over raw sockets against a real uvicorn running the service's own protocol; the fuzz
through the real app in process, with the JSON decoder and the multipart parser watched.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import semif_serve.doors.native.schemas as native_schemas
import semif_serve.doors.systemone.api as systemone_api
import semif_serve.doors.systemone.schemas as systemone_schemas
from semif_serve.app import Service, create_app
from semif_serve.http.headers import parse_headers
from tests.http.test_hardening import AUTH, assert_envelope, read_response
from tests.support import TOKEN, decision, make_settings

JSON = "application/json"
MULTIPART = "multipart/form-data; boundary=b0undary"
NOUL = {"type": "noul", "instructions": "Was it paid twice?"}
MIB = 1024 * 1024


def systemone_request(state: str = "The invoice was paid twice.") -> dict:
    return {"model": "jev-latest", "state": state, "questions": {"q": NOUL}}


def native_request(state: str = "Health checks passed.") -> dict:
    return {"state": state, "decisions": [decision()]}


BODIES = {"/decide/shared": native_request, "/v1/systemone": systemone_request}


class Parsed:
    """Every body the doors hand to the JSON decoder or the multipart parser, by its size."""

    def __init__(self) -> None:
        self.json: list[int] = []
        self.multipart: list[int] = []

    def install(self, patch: pytest.MonkeyPatch) -> None:
        for module in (native_schemas, systemone_schemas):
            real_json = module.decode_json_object
            patch.setattr(module, "decode_json_object", self._watched(real_json, self.json, 0))
        real_multipart = systemone_api.parse_multipart
        patch.setattr(systemone_api, "parse_multipart", self._watched(real_multipart, self.multipart, 1))

    @staticmethod
    def _watched(real, sizes: list[int], body_at: int):
        def call(*args, **kwargs):
            sizes.append(len(args[body_at]))
            return real(*args, **kwargs)

        return call


@pytest.fixture
def parsed(monkeypatch) -> Parsed:
    watcher = Parsed()
    watcher.install(monkeypatch)
    return watcher


# -- the one reading ------------------------------------------------------------------------------


def test_each_single_header_sent_twice_is_named_and_a_list_header_is_joined():
    raw = [
        (b"Content-Type", JSON.encode()),
        (b"content-type", MULTIPART.encode()),
        (b"X-Request-ID", b"a"),
        (b"x-request-id", b"a"),
        (b"content-encoding", b"gzip"),
        (b"Content-Encoding", b" ZSTD , "),
        (b"authorization", b"Bearer x"),
    ]
    headers = parse_headers(raw)
    assert headers.repeated == ("Content-Type", "X-Request-ID")
    assert headers.content_codings == ("gzip", "zstd")
    assert headers.authorization == b"Bearer x"
    assert parse_headers([(b"authorization", b"Bearer x")] * 2).repeated == ("Authorization",)


def test_identical_content_length_values_collapse_and_different_ones_are_repeated():
    same = parse_headers([(b"content-length", b"12"), (b"content-length", b"12")])
    assert (same.content_length, same.repeated) == (b"12", ())
    different = parse_headers([(b"content-length", b"12"), (b"content-length", b"13")])
    assert different.repeated == ("Content-Length",)


# -- two Content-Types over a real socket ---------------------------------------------------------------


def send_quietly(sock, data: bytes) -> None:
    """Send `data`; the server may close the connection once it has refused the request."""
    try:
        sock.sendall(data)
    except OSError:
        pass


def two_content_types(server, path: str, first: str, last: str, body: bytes):
    """POST `body` under two Content-Type headers from a raw socket; (seconds, status, headers, body)."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: t\r\n{AUTH}Content-Type: {first}\r\nContent-Type: {last}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    started = time.monotonic()
    sock = server.connect(head)
    writer = threading.Thread(target=send_quietly, args=(sock, body), daemon=True)
    writer.start()
    try:
        status, headers, reply = read_response(sock)
    finally:
        sock.close()
        writer.join(10)
    return time.monotonic() - started, status, headers, reply


def timed_get(url: str) -> float:
    started = time.monotonic()
    assert httpx.get(url, timeout=10).status_code == 200
    return time.monotonic() - started


@pytest.mark.parametrize(
    "order", [(JSON, MULTIPART), (MULTIPART, JSON)], ids=["json-first", "multipart-first"]
)
@pytest.mark.parametrize("path", sorted(BODIES))
def test_two_content_types_with_a_multi_megabyte_json_body_are_400_before_it_is_parsed(
    server, parsed, path, order
):
    body = json.dumps(BODIES[path]("word " * (3 * MIB // 5))).encode()
    assert len(body) > 3 * MIB
    attacks: list = []
    attackers = [
        threading.Thread(target=lambda: attacks.append(two_content_types(server, path, *order, body)))
        for _ in range(4)
    ]
    for attacker in attackers:
        attacker.start()
    health = timed_get(f"{server.url}/health")
    started = time.monotonic()
    tiny = httpx.post(
        f"{server.url}/decide", json=decision(), headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30
    )
    tiny_seconds = time.monotonic() - started
    for attacker in attackers:
        attacker.join(30)
    assert len(attacks) == 4
    for seconds, status, headers, reply in attacks:
        assert status == 400, reply[:300]
        assert seconds < 1.0
        if path == "/v1/systemone":
            detail = json.loads(reply)["detail"]
            assert detail["error_type"] == "api_usage_error"
            assert "Content-Type" in detail["message"] and "at most one" in detail["message"]
        else:
            error = assert_envelope(status, headers, reply, 400, "duplicate_header")
            assert error["field"] == "Content-Type"
    assert len(parsed.json) == 1 and parsed.json[0] < 1000  # only the tiny request's body was parsed
    assert parsed.multipart == []
    assert health < 1.0
    assert tiny.status_code == 200 and tiny_seconds < 5.0


# -- each other single header repeated, on both doors ------------------------------------------------


def raw_exchange(server, head: str, body: bytes):
    sock = server.connect(head.encode() + body)
    try:
        return read_response(sock)
    finally:
        sock.close()


REPEATED = {
    "Content-Type": f"Content-Type: {JSON}\r\nContent-Type: {JSON}\r\n",
    "Authorization": AUTH + AUTH,
    "X-Request-ID": "X-Request-ID: first\r\nX-Request-ID: second\r\n",
    "X-SemIf-State-Key": f"X-SemIf-State-Key: {'a' * 64}\r\nX-SemIf-State-Key: {'b' * 64}\r\n",
}


@pytest.mark.parametrize("header", sorted(REPEATED))
@pytest.mark.parametrize("path", sorted(BODIES))
def test_a_repeated_single_header_is_400_in_the_doors_shape_naming_it(server, parsed, path, header):
    body = json.dumps(BODIES[path]()).encode()
    auth = "" if header == "Authorization" else AUTH
    head = f"POST {path} HTTP/1.1\r\nHost: t\r\n{auth}{REPEATED[header]}Content-Length: {len(body)}\r\n\r\n"
    status, headers, reply = raw_exchange(server, head, body)
    assert status == 400, reply
    assert headers["x-request-id"] not in ("first", "second")  # neither of two ids is the request's
    assert TOKEN not in reply.decode()
    if path == "/v1/systemone":
        detail = json.loads(reply)["detail"]
        assert detail["error_type"] == "api_usage_error" and header in detail["message"]
        assert headers["x-typesafe-request-id"] == headers["x-request-id"]
    else:
        assert assert_envelope(status, headers, reply, 400, "duplicate_header")["field"] == header
    assert parsed.json == []


@pytest.mark.parametrize("path", sorted(BODIES))
def test_content_length_twice_is_one_value_when_equal_and_refused_when_not(server, path):
    body = json.dumps(BODIES[path]()).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: t\r\n{AUTH}Content-Length: {len(body)}\r\n"
    twice = head + "Content-Length: {}\r\n\r\n"
    status, _, reply = raw_exchange(server, twice.format(len(body)), body)
    assert status == 200, reply
    status, headers, reply = raw_exchange(server, twice.format(len(body) + 1), body)
    assert status == 400, reply  # h11 refuses two different values before the app sees them
    assert headers["connection"] == "close"


def test_content_length_values_that_disagree_past_the_http_parser_are_duplicate_header(app):
    body = json.dumps(native_request()).encode()
    reply = asgi_post(app, "/decide/shared", body, [(b"content-length", b"1"), (b"content-length", b"2")])
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "duplicate_header"
    assert reply.json()["error"]["field"] == "Content-Length"


def test_a_repeated_header_on_an_open_route_is_refused_too(server):
    reply = httpx.get(f"{server.url}/health", headers=[("X-Request-ID", "a"), ("X-Request-ID", "b")])
    assert reply.status_code == 400
    assert reply.json()["error"]["field"] == "X-Request-ID"


# -- the fuzz -------------------------------------------------------------------------------------------


def asgi_post(app, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> httpx.Response:
    """POST through the real app in process with exactly `headers` (repeats kept) beside the token."""

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fuzz") as client:
            sent = [(b"authorization", f"Bearer {TOKEN}".encode()), *headers]
            return await client.post(path, content=body, headers=sent)

    return asyncio.run(go())


JSON_LIMIT = 4096
IMAGE_BYTES = 16384


@pytest.fixture(scope="module")
def small_limits(engine, checkpoint):
    """A service whose JSON body limit (4 KiB) is far under its multipart limit (20 KiB)."""
    settings = make_settings(checkpoint, max_body_bytes=JSON_LIMIT, systemone_max_image_bytes=IMAGE_BYTES)
    return create_app(Service.start(settings, engine=engine))


CONTENT_TYPES = [JSON, MULTIPART, "multipart/form-data", "text/plain", "MULTIPART/FORM-DATA; boundary=x", ""]
HEADER_NAMES = ["content-type", "Content-Type", "x-request-id", "content-length", "content-encoding"]
header_lists = st.lists(
    st.tuples(
        st.sampled_from(HEADER_NAMES), st.sampled_from(CONTENT_TYPES + ["gzip", "identity", "7", "id-1"])
    ),
    max_size=5,
)
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(
    path=st.sampled_from(sorted(BODIES)),
    headers=header_lists,
    size=st.sampled_from([100, JSON_LIMIT + 500, JSON_LIMIT + IMAGE_BYTES - 500]),
)
def test_repeated_and_conflicting_headers_never_get_a_5xx_nor_a_body_parsed_past_its_types_limit(
    small_limits, parsed, path, headers, size
):
    parsed.json.clear()
    parsed.multipart.clear()
    request = BODIES[path]()
    request["state"] += " " * max(0, size - len(json.dumps(request)))
    body = json.dumps(request).encode()
    sent = [(name.encode(), value.encode()) for name, value in headers if name != "content-length"]
    reply = asgi_post(small_limits, path, body, sent)
    assert reply.status_code < 500, reply.text
    assert small_limits.admission.in_progress == 0
    assert all(length <= JSON_LIMIT for length in parsed.json)  # JSON only ever under the JSON limit
    assert all(length <= JSON_LIMIT + IMAGE_BYTES for length in parsed.multipart)
    if parse_headers(sent).repeated:
        assert reply.status_code == 400 and parsed.json == parsed.multipart == []


@pytest.mark.parametrize("path", sorted(BODIES))
def test_two_content_encoding_headers_join_into_a_stack_that_is_415_before_the_body(server, parsed, path):
    body = gzip.compress(json.dumps(BODIES[path]()).encode())
    codings = "Content-Encoding: gzip\r\nContent-Encoding: gzip\r\n"
    head = f"POST {path} HTTP/1.1\r\nHost: t\r\n{AUTH}{codings}Content-Length: {len(body)}\r\n\r\n"
    status, headers, reply = raw_exchange(server, head, body)
    assert status == 415, reply
    assert headers["accept-encoding"] == "gzip, zstd"
    assert parsed.json == []
