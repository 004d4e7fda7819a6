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


# -- bounded work: rows counted, tokens budgeted, the state encoded once -------------------------

SYSTEM = (  # SemIf's system turn, written out (not imported) for an independent rendering
    "Apply the supplied criterion to the supplied evidence. Choose exactly one listed option. "
    "Respond with only its uppercase letter, with no explanation or reasoning."
)


def rendered(tokenizer, state, question: str, descriptions, codes) -> str:
    user = json.dumps(
        {
            "evidence": state,
            "criterion": question,
            "options": [{"letter": codes[i], "description": d} for i, d in enumerate(descriptions)],
        },
        ensure_ascii=False,
    )
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )


ODD_STATES = [
    "plain words",
    "ends in a space ",
    'ends in a quote "',
    "Zoë 数字 😀 \u0301combining",
    "it's we'll",
    "\n\t\r",
    {"k": "v", "n": [1, 2.5, None, False]},
    [{"a": "b"}, "c", 3],
    {"": {"": ""}},
    "x" * 3000,
]


@pytest.mark.parametrize("state", ODD_STATES, ids=[f"state{i}" for i in range(len(ODD_STATES))])
def test_prompts_encoded_with_the_state_once_equal_each_prompt_encoded_whole(engine, tokenizer, state):
    from semif_serve.domain import PromptRow

    codec = engine.codec
    rows = [
        PromptRow("Did it pass?", ("Yes.", "No.")),
        PromptRow('\'s \u0301 ünïcode, "quoted" question', (" lead", '"q"', "数字", "x")),
        PromptRow("", ("a", "b", "c")),
    ]
    assert codec.splits_after_state
    prompts = codec.encode_prompts(state, rows, 100_000)
    for prompt, row in zip(prompts, rows, strict=True):
        text = rendered(tokenizer, state, row.question, row.descriptions, codec.codes)
        assert prompt.text == text
        assert prompt.ids == tokenizer.encode(text, add_special_tokens=False)
        assert prompt.head_tokens > 0
        assert (
            codec.state_prefix(state, prompt)
            == tokenizer.encode(
                text[: prompt.user_offset + len(json.dumps({"evidence": state}, ensure_ascii=False)[:-1])]
                + ', "criterion": "',
                add_special_tokens=False,
            )[:-1]
        )


def test_the_state_is_tokenised_once_per_request_not_once_per_row(engine, monkeypatch):
    from semif_serve.domain import PromptRow

    codec = engine.codec
    state = "The deployment log says the zones recovered. " * 200
    rows = [PromptRow(f"Question {i}?", ("Yes.", "No.")) for i in range(40)]
    assert codec.splits_after_state  # probed once, before counting
    encoded: list[int] = []
    real = type(codec).encode
    monkeypatch.setattr(codec, "encode", lambda text: encoded.append(len(text)) or real(codec, text))
    codec.encode_prompts(state, rows, 100_000)
    assert sum(encoded) < 3 * len(state)  # forty rows, the state's text tokenised about once


def rotations_body(questions: int, options: int) -> dict:
    choice = {
        "type": "choice",
        "criteria": {f"o{i}": None for i in range(options)},
        "x_orderings": "rotations",
    }
    return {"model": "jev-latest", "state": "s", "questions": {f"q{i}": choice for i in range(questions)}}


def test_a_request_over_the_row_cap_is_refused_before_any_row_is_built(app, service, monkeypatch):
    import semif_serve.core as core

    def never(*args):
        raise AssertionError("rows were built for a request over the row cap")

    monkeypatch.setattr(core, "option_orders", never)
    body = rotations_body(283, 255)  # 72,165 rows
    reply = asgi_post(app, "/v1/systemone", json.dumps(body).encode())
    assert reply.status_code == 413, reply.text
    detail = reply.json()["detail"]
    assert detail["error_type"] == "request_too_large"
    assert "72165 rows" in detail["message"] and "256" in detail["message"]


def asgi_post(app, path: str, body: bytes):
    import asyncio

    import httpx

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.post(path, content=body, headers={"Authorization": f"Bearer {TOKEN}"})

    return asyncio.run(go())


@pytest.fixture(scope="module")
def small_budget(engine, checkpoint):
    from conftest import make_settings

    from semif_serve.startup import Service

    service = Service.start(make_settings(checkpoint, systemone_max_request_tokens=1500), engine=engine)
    return create_app(service)


def test_a_system_one_request_past_its_token_budget_is_413_naming_the_need(small_budget, monkeypatch):
    # 40 questions of ~60 tokens over a ~100-token state: every row is far under the per-row limit.
    questions = {
        f"q{i}": {"type": "noul", "instructions": f"Is statement number {i} true?"} for i in range(40)
    }
    body = {"model": "jev-latest", "state": "The invoice was paid twice in March.", "questions": questions}
    reply = asgi_post(small_budget, "/v1/systemone", json.dumps(body).encode())
    assert reply.status_code == 413, reply.text
    detail = reply.json()["detail"]
    assert detail["error_type"] == "request_too_large"
    assert "per-request budget of 1500" in detail["message"] and "tokens" in detail["message"]
    few = {**body, "questions": dict(list(questions.items())[:3])}
    assert asgi_post(small_budget, "/v1/systemone", json.dumps(few).encode()).status_code == 200


def test_the_token_budget_stops_encoding_at_the_first_row_past_it(engine):
    from semif_serve.domain import PromptRow, TooManyTokens

    codec = engine.codec
    rows = [PromptRow(f"Is statement number {i} true?", ("Yes.", "No.")) for i in range(200)]
    one = codec.encode_prompts("state", rows[:1], 100_000)[0]
    per_row = len(one.ids) - one.head_tokens
    with pytest.raises(TooManyTokens) as refused:
        codec.encode_prompts("state", rows, 100_000, max_request_tokens=one.head_tokens + 10 * per_row)
    import re

    counted = int(re.search(r"(\d+) of 200 rows counted", refused.value.message)[1])
    assert counted == 11  # refused at the first row past the budget, not after encoding all 200
    assert "at least" in refused.value.message
    assert refused.value.question is None  # the request as a whole, not one question


def test_the_native_door_has_no_request_budget(engine, checkpoint):
    from conftest import make_settings

    from semif_serve.startup import Service

    service = Service.start(make_settings(checkpoint, systemone_max_request_tokens=100), engine=engine)
    body = {"state": "s", "decisions": [decision(id=f"q{i}") for i in range(8)]}
    reply = asgi_post(create_app(service), "/decide/shared", json.dumps(body).encode())
    assert reply.status_code == 200, reply.text
