"""Compressed request bodies: gzip and zstd decide like plain JSON; the body limit holds for the
inflated size as it streams (a bomb is refused without being inflated); anything else is 415 or 400.
Compressed replies: gzip only where Accept-Encoding's q-values prefer it (RFC 9110 12.5.3).

Over a real uvicorn on loopback where sockets and memory matter; the decoder itself against
the standard library's one-shot decompressors.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import socket
import zlib

import httpx
import pytest

from harness.server import LoopbackServer, read_rss, reset_peak_rss
from semif_serve.app import create_app
from semif_serve.http.body_encoding import (
    STEP_BYTES,
    BodyDecoder,
    CorruptBody,
    accepted_codings,
    reply_gzip_accepted,
    requested_coding,
)
from semif_serve.http.headers import parse_headers
from semif_serve.service.startup import Service
from tests.http.test_admission import Exchange, scope
from tests.http.test_hardening import read_response, wait_until
from tests.support import TOKEN, decision, make_settings
from tests.support.batch import assert_close

try:
    from compression import zstd  # type: ignore[import-not-found]
except ImportError:
    from backports import zstd

AUTH = {"Authorization": f"Bearer {TOKEN}"}
GIB = 1 << 30
MIB = 1 << 20


def gzipped(data: bytes) -> bytes:
    return gzip.compress(data)


def zstded(data: bytes) -> bytes:
    return zstd.compress(data)


COMPRESSORS = {"gzip": gzipped, "zstd": zstded}


def zeros_compressed(coding: str, size: int) -> bytes:
    """`size` zero bytes compressed, built a MiB at a time (the inflated body never exists here)."""
    if coding == "zstd":
        compressor = zstd.ZstdCompressor(level=1)
        return b"".join(compressor.compress(bytes(MIB)) for _ in range(size // MIB)) + compressor.flush()
    deflater = zlib.compressobj(9, zlib.DEFLATED, 31)
    return b"".join(deflater.compress(bytes(MIB)) for _ in range(size // MIB)) + deflater.flush()


def stable(result: dict) -> dict:
    """A decision result without its wall-clock timings."""
    return {k: v for k, v in result.items() if k not in ("forward_seconds", "total_seconds", "timing")}


@pytest.fixture(scope="module")
def server(engine, checkpoint):
    # A lone row runs SemIf's plain forward every time: a repeated body's answer is then bit-identical,
    # not the cached state's (equal within 1e-5), so a compressed /decide is compared exactly.
    service = Service.start(make_settings(checkpoint, direct_path="plain"), engine=engine)
    with LoopbackServer(create_app(service)) as running:
        yield running


@pytest.fixture(scope="module")
def small_limit(engine, checkpoint):
    service = Service.start(make_settings(checkpoint, max_body_bytes=4000), engine=engine)
    with LoopbackServer(create_app(service)) as running:
        yield running


# ----------------------------------------------------------------------- the decoder


@pytest.mark.parametrize("coding", ["gzip", "zstd"])
def test_the_decoder_fed_one_byte_at_a_time_gives_what_the_one_shot_decompressor_gives(coding):
    data = os.urandom(3000) + bytes(200_000) + b"tail"
    compressed = COMPRESSORS[coding](data)
    decoder = BodyDecoder(coding)
    out = b"".join(piece for i in range(len(compressed)) for piece in decoder.decode(compressed[i : i + 1]))
    decoder.finish()
    reference = gzip.decompress(compressed) if coding == "gzip" else zstd.decompress(compressed)
    assert out == reference == data


@pytest.mark.parametrize("coding", ["gzip", "zstd"])
def test_the_decoder_never_hands_over_more_than_one_step_at_a_time(coding):
    decoder = BodyDecoder(coding)
    pieces = list(decoder.decode(zeros_compressed(coding, 4 * MIB)))
    decoder.finish()
    assert max(map(len, pieces)) <= STEP_BYTES
    assert sum(map(len, pieces)) == 4 * MIB


@pytest.mark.parametrize("coding", ["gzip", "zstd"])
def test_members_and_frames_one_after_another_are_one_body(coding):
    compress = COMPRESSORS[coding]
    decoder = BodyDecoder(coding)
    out = b"".join(decoder.decode(compress(b'{"a": ') + compress(b"1}")))
    decoder.finish()
    assert out == b'{"a": 1}'


@pytest.mark.parametrize("coding", ["gzip", "zstd"])
@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda c: c[: len(c) // 2], id="truncated"),
        pytest.param(lambda c: c + b"garbage!", id="trailing-garbage"),
        pytest.param(lambda c: b"", id="empty"),
        pytest.param(lambda c: b"not compressed at all", id="plain-text"),
    ],
)
def test_damaged_data_is_refused_as_corrupt(coding, damage):
    decoder = BodyDecoder(coding)
    with pytest.raises(CorruptBody):
        for _ in decoder.decode(damage(COMPRESSORS[coding](json.dumps(decision()).encode()))):
            pass
        decoder.finish()


@pytest.mark.parametrize(
    ("headers", "coding"),
    [
        ([], None),
        ([(b"content-encoding", b"identity")], None),
        ([(b"content-encoding", b"GZip")], "gzip"),
        ([(b"Content-Encoding", b" zstd ")], "zstd"),
        ([(b"content-encoding", b"x-gzip")], "x-gzip"),
    ],
)
def test_the_coding_is_read_from_the_headers_case_insensitively(headers, coding):
    assert requested_coding(parse_headers(headers).content_codings) == coding


@pytest.mark.parametrize(
    "value",
    [
        b"br",
        b"deflate",
        b"compress",
        b"gzip, zstd",
        b"zstd, zstd",
        b"zstd;q=1",
        b"identity, zstd",
        b"gzip, identity",
    ],
)
def test_an_unknown_or_stacked_coding_is_refused_by_name(value):
    with pytest.raises(ValueError, match=value.decode().split(",")[0]):
        requested_coding(parse_headers([(b"content-encoding", value)]).content_codings)


def test_two_content_encoding_headers_are_a_stack():
    with pytest.raises(ValueError):
        requested_coding(parse_headers([(b"content-encoding", b"gzip")] * 2).content_codings)


# ----------------------------------------------------------------------- over HTTP


@pytest.mark.parametrize("coding", ["gzip", "zstd"])
def test_a_compressed_decide_gets_the_same_answer_as_the_plain_body(server, coding):
    body = json.dumps(decision()).encode()
    plain = httpx.post(f"{server.url}/decide", content=body, headers=AUTH, timeout=60)
    packed = httpx.post(
        f"{server.url}/decide",
        content=COMPRESSORS[coding](body),
        headers={**AUTH, "Content-Encoding": coding},
        timeout=60,
    )
    assert (plain.status_code, packed.status_code) == (200, 200), packed.text
    assert stable(packed.json()) == stable(plain.json())


@pytest.mark.parametrize("coding", ["gzip", "zstd"])
def test_a_compressed_shared_decision_gets_the_same_answers_as_the_plain_body(server, coding):
    body = json.dumps(
        {
            "state": "The build is red on main.",
            "decisions": [decision(id="a"), decision(id="b", question="Ship?")],
        }
    ).encode()
    plain = httpx.post(f"{server.url}/decide/shared", content=body, headers=AUTH, timeout=60)
    packed = httpx.post(
        f"{server.url}/decide/shared",
        content=COMPRESSORS[coding](body),
        headers={**AUTH, "Content-Encoding": coding},
        timeout=60,
    )
    assert (plain.status_code, packed.status_code) == (200, 200), packed.text
    # Its decisions share the state: the repeat reads the stored state (equal within 1e-5, not in bits).
    assert_close([stable(r) for r in packed.json()["results"]], [stable(r) for r in plain.json()["results"]])


def test_an_identity_coding_is_a_plain_body(server):
    reply = httpx.post(
        f"{server.url}/decide", json=decision(), headers={**AUTH, "Content-Encoding": "identity"}, timeout=60
    )
    assert reply.status_code == 200


@pytest.mark.parametrize("coding", ["br", "deflate", "gzip, zstd"])
def test_an_unsupported_coding_is_415_naming_the_ones_accepted(server, coding):
    reply = httpx.post(
        f"{server.url}/decide",
        content=gzipped(json.dumps(decision()).encode()),
        headers={**AUTH, "Content-Encoding": coding},
    )
    assert reply.status_code == 415
    error = reply.json()["error"]
    assert (error["code"], error["field"]) == ("unsupported_content_encoding", "Content-Encoding")
    assert "gzip, zstd" in error["message"]
    assert reply.headers["accept-encoding"] == "gzip, zstd"


def test_an_unsupported_coding_is_refused_before_its_body_is_read_or_a_slot_is_taken(service):
    app = create_app(service)
    exchange = Exchange([b"\x28\xb5\x2f\xfd"])
    asyncio.run(app(scope([(b"content-encoding", b"br")]), exchange.receive, exchange.send))
    assert exchange.status == 415
    assert exchange.reads == 0
    assert app.admission.refused == 0 and app.admission.in_progress == 0


def test_without_a_token_an_unsupported_coding_is_still_401(server):
    reply = httpx.post(f"{server.url}/decide", content=b"x", headers={"Content-Encoding": "br"})
    assert reply.status_code == 401


@pytest.mark.parametrize("coding", ["gzip", "zstd"])
def test_corrupt_compressed_data_is_400_naming_the_encoding(server, coding):
    whole = COMPRESSORS[coding](json.dumps(decision()).encode())
    for damaged in (whole[:-6], b"\x00" * 40, whole + b"junk"):
        reply = httpx.post(
            f"{server.url}/decide", content=damaged, headers={**AUTH, "Content-Encoding": coding}
        )
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert (error["code"], error["field"]) == ("invalid_compressed_body", "Content-Encoding")
        assert coding in error["message"]


@pytest.mark.parametrize("coding", ["gzip", "zstd"])
def test_a_body_that_inflates_past_the_limit_is_413_though_it_arrives_small(small_limit, coding):
    body = json.dumps(decision(state="x" * 5000)).encode()
    packed = COMPRESSORS[coding](body)
    assert len(packed) < 4000 < len(body)
    reply = httpx.post(
        f"{small_limit.url}/decide", content=packed, headers={**AUTH, "Content-Encoding": coding}
    )
    assert reply.status_code == 413
    error = reply.json()["error"]
    assert error["code"] == "body_too_large"
    assert "decompressed" in error["message"] and "4000" in error["message"]


@pytest.mark.parametrize("coding", ["gzip", "zstd"])
def test_a_body_that_inflates_to_exactly_the_limit_is_accepted(small_limit, coding):
    body = json.dumps(decision()).encode()
    body += b" " * (4000 - len(body))
    reply = httpx.post(
        f"{small_limit.url}/decide",
        content=COMPRESSORS[coding](body),
        headers={**AUTH, "Content-Encoding": coding},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text


@pytest.fixture(scope="module")
def zstd_bomb() -> bytes:
    return zeros_compressed("zstd", GIB)


def test_a_zstd_bomb_of_a_gibibyte_is_413_without_being_inflated(server, zstd_bomb):
    assert len(zstd_bomb) < 64 * 1024
    pid = os.getpid()
    peak_resettable = reset_peak_rss(pid)
    before = read_rss(pid)
    reply = httpx.post(
        f"{server.url}/decide", content=zstd_bomb, headers={**AUTH, "Content-Encoding": "zstd"}, timeout=30
    )
    after = read_rss(pid)
    assert reply.status_code == 413
    assert reply.json()["error"]["code"] == "body_too_large"
    grown = (after["VmHWM"] if peak_resettable else after["VmRSS"]) - before["VmRSS"]
    assert grown < 64 * MIB, f"RSS grew by {grown / MIB:.0f} MiB"


def test_a_gzip_bomb_is_413_and_the_next_request_is_answered(server):
    bomb = zeros_compressed("gzip", 64 * MIB)
    reply = httpx.post(f"{server.url}/decide", content=bomb, headers={**AUTH, "Content-Encoding": "gzip"})
    assert reply.status_code == 413
    assert httpx.post(f"{server.url}/decide", json=decision(), headers=AUTH, timeout=60).status_code == 200


def test_a_compressed_body_that_stops_arriving_still_gets_408(engine, checkpoint):
    service = Service.start(make_settings(checkpoint, body_timeout_seconds=0.5), engine=engine)
    app = create_app(service)
    packed = zstded(json.dumps(decision()).encode())
    with LoopbackServer(app) as running:
        port = int(running.url.rsplit(":", 1)[1])
        head = (
            f"POST /decide HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Encoding: zstd\r\nContent-Length: {len(packed)}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(head + packed[:10])
            status, _, body = read_response(sock)
        assert status == 408
        assert json.loads(body)["error"]["code"] == "body_timeout"
        # The slot is freed just after the last byte is sent: give the server's loop that moment.
        assert wait_until(lambda: app.admission.in_progress == 0, 2.0)


# ----------------------------------------------------------------------- Accept-Encoding: the reply's coding

# A choice among many options: its reply is over the 1 KiB from which replies are compressed.
LONG_REPLY = decision(
    options=[{"id": f"option-{i:02d}", "description": f"The deployment is in state {i}."} for i in range(16)]
)


@pytest.mark.parametrize(
    ("accept", "gzip"),
    [
        ("gzip", True),
        ("gzip;q=0", False),
        ("identity", False),
        ("gzip;q=0.5, identity;q=1", False),  # identity preferred
        ("identity;q=0.5, gzip", True),
        ("gzip, identity", True),  # a tie: the smaller reply
        ("gzip;q=0.001", True),
        ("GZip ; Q=1.000", True),
        ("x-gzip", True),
        ("*", True),
        ("*;q=0", False),
        ("gzip;q=0, *", False),  # gzip named, so `*` does not cover it
        ("gzip;q=0.5, *", False),  # `*` covers identity, at 1
        ("br, deflate, zstd", False),
        ("gzip;q=2", False),  # not a qvalue: the entry accepts nothing
        ("gzip;q=0.5000", False),  # at most three decimals
        ("gzip;q=", False),
        ("", False),
    ],
)
def test_gzip_is_chosen_by_q_value_as_rfc_9110_says(accept, gzip):
    assert reply_gzip_accepted([accept]) is gzip


def test_no_accept_encoding_asks_for_no_compression():
    assert reply_gzip_accepted([]) is False


def test_a_coding_named_twice_keeps_its_refusal_across_headers():
    assert accepted_codings(["gzip, deflate", "gzip;q=0"]) == {"gzip": 0.0, "deflate": 1.0}
    assert reply_gzip_accepted(["gzip, deflate", "gzip;q=0"]) is False


@pytest.mark.parametrize(
    ("accept", "compressed"),
    [
        ("gzip", True),
        ("gzip;q=0", False),
        ("identity", False),
        ("gzip;q=0.5, identity;q=1", False),
        ("identity;q=0.5, gzip;q=0.8", True),
        ("*", True),
        ("gzip;q=0, *", False),
        ("deflate, br", False),
    ],
)
def test_a_long_reply_is_gzip_compressed_only_where_accept_encoding_prefers_it(server, accept, compressed):
    reply = httpx.post(
        f"{server.url}/decide", json=LONG_REPLY, headers={**AUTH, "Accept-Encoding": accept}, timeout=60
    )
    assert reply.status_code == 200, reply.text
    assert len(reply.content) >= 1024  # long enough that only Accept-Encoding decides
    assert reply.headers.get("content-encoding") == ("gzip" if compressed else None)
    assert "accept-encoding" in reply.headers["vary"].lower()  # a cache keeps the two apart
    # httpx inflates a gzipped reply as any client would: the same answer either way.
    assert reply.json()["option_ids"] == [o["id"] for o in LONG_REPLY["options"]]


def test_a_refusal_in_a_second_accept_encoding_header_holds_over_the_app(server):
    headers = httpx.Headers([*AUTH.items(), ("Accept-Encoding", "gzip"), ("Accept-Encoding", "gzip;q=0")])
    reply = httpx.post(f"{server.url}/decide", json=LONG_REPLY, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    assert "content-encoding" not in reply.headers
