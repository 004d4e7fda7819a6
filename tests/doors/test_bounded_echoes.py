"""Every echo is bounded: an error that quotes a client's value quotes a bounded prefix, on both
doors and `/calibrate`, however the body arrived (a small zstd body can carry a huge name), and
no message carries a repr, a heap address or a path."""

from __future__ import annotations

import base64
import json
import re

import pytest
from backports import zstd

from semif_serve.app import create_app
from tests.support import decision, in_process_client


@pytest.fixture(scope="module")
def vision_client(vision_service):
    return in_process_client(create_app(vision_service))


BIG = "m" * 1_000_000
LIMIT = 4096  # bytes of any of these error replies, whatever the request sent


def systemone(**extra) -> dict:
    return {"model": "jev-latest", "state": "s", "questions": {"q": {"type": "noul"}}, **extra}


# path, body, what the reply must still say (the rule or the value's prefix)
CASES = {
    "systemone model": ("/v1/systemone", systemone(model=BIG), "unknown model 'mmmm"),
    "systemone workload": (
        "/v1/systemone",
        systemone(questions={"q": {"type": "noul", "x_workload": BIG}}),
        "unknown workload 'mmmm",
    ),
    "systemone question type": ("/v1/systemone", systemone(questions={"q": {"type": BIG}}), "tag 'mmmm"),
    "systemone orderings": (
        "/v1/systemone",
        systemone(questions={"q": {"type": "noul", "x_orderings": BIG}}),
        "x_orderings",
    ),
    "native model": ("/decide", decision(model=BIG), "unknown model 'mmmm"),
    "native workload": ("/decide", decision(workload=BIG), "unknown workload 'mmmm"),
    "native option ids": (
        "/decide",
        decision(options=[{"id": BIG[:400_000], "description": d} for d in ("a", "b")]),
        "must be unique; 'mmmm",
    ),
    "calibrate workload": (
        "/calibrate",
        {"workload": BIG, "rows": [{"logits": [1.0, 2.0], "label": 0}]},
        "at most 256 characters",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_huge_name_in_a_small_compressed_body_gets_a_small_error_quoting_its_prefix(client, case):
    path, body, named = CASES[case]
    packed = zstd.compress(json.dumps(body).encode())
    assert len(packed) < 2000  # the attack: a few hundred bytes on the wire
    reply = client.post(path, content=packed, headers={"Content-Encoding": "zstd"})
    assert 400 <= reply.status_code < 500, reply.text[:300]
    assert len(reply.content) <= LIMIT
    assert named in reply.text  # the rule and what broke it are still named


def test_a_broken_image_is_refused_without_a_repr_or_a_heap_address(vision_client):
    from tests.doors.test_systemone_images import PLACEHOLDER, body, image_asset, png

    for data in (png()[:40], b"\x89PNG\r\n\x1a\n" + b"\0" * 60, b"\xff\xd8\xff" + b"\0" * 60):
        fmt = "jpeg" if data.startswith(b"\xff\xd8") else "png"
        reply = vision_client.post("/v1/systemone", json=body(assets={PLACEHOLDER: image_asset(data, fmt)}))
        assert reply.status_code == 422, reply.text
        text = reply.text
        assert not re.search(r"0x[0-9a-f]{6,}|<[_a-zA-Z.]+ object|/tmp/|\.py", text), text


def test_a_calibrate_workload_name_is_bounded_before_it_is_echoed_in_the_report(client):
    from tests.doors.test_calibrate_route import labelled_rows

    rows = labelled_rows(40, seed=3)
    reply = client.post("/calibrate", json={"workload": "w" * 257, "rows": rows})
    assert reply.status_code == 422 and reply.json()["error"]["field"] == "workload"
    assert client.post("/calibrate", json={"workload": "w" * 256, "rows": rows}).status_code == 200


def test_an_image_asset_as_base64_of_a_huge_name_is_still_bounded(vision_client):
    from tests.doors.test_systemone_images import body

    asset = {"type": "image", "format": BIG[:300_000], "data_base64": base64.b64encode(b"x").decode()}
    reply = vision_client.post("/v1/systemone", json=body(assets={"<image:x>": asset}))
    assert 400 <= reply.status_code < 500 and len(reply.content) <= LIMIT
