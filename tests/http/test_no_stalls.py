"""No single request stalls the service: strict framing, bounded work, a free event loop.

Framing over raw sockets against a real uvicorn running the service's own protocol; body rules
through the real app; the engine's encode-once and chunked suffix against plain computations.
"""

from __future__ import annotations

import json

import pytest

from semif_serve.app import create_app
from semif_serve.domain.requests import RowsRequest
from tests.http.test_hardening import AUTH, HardenedServer, assert_envelope, read_response
from tests.support import TOKEN, decision


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
    from semif_serve.domain.types import PromptRow

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
    from semif_serve.domain.types import PromptRow

    codec = engine.codec
    state = "The deployment log says the zones recovered. " * 200
    rows = [PromptRow(f"Question {i}?", ("Yes.", "No.")) for i in range(40)]
    assert codec.splits_after_state  # probed once, before counting
    encoded: list[int] = []
    real = type(codec).encode
    monkeypatch.setattr(
        codec, "encode", lambda text, *limit: encoded.append(len(text)) or real(codec, text, *limit)
    )
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
    import semif_serve.service.core as core

    def never(*args):
        raise AssertionError("rows were built for a request over the row cap")

    monkeypatch.setattr(core, "option_orders", never)
    body = rotations_body(283, 255)  # 72,165 rows
    reply = asgi_post(app, "/v1/systemone", json.dumps(body).encode())
    assert reply.status_code == 413, reply.text
    detail = reply.json()["detail"]
    assert detail["error_type"] == "request_too_large"
    assert "72165 rows" in detail["message"] and "256" in detail["message"]


def test_a_system_one_request_over_the_row_cap_is_refused_before_it_is_validated(app, monkeypatch):
    from semif_serve.doors.systemone.schemas import SystemOneRequest

    def never(*args, **kwargs):
        raise AssertionError("a request over the row cap was validated")

    monkeypatch.setattr(SystemOneRequest, "model_validate", never)
    reply = asgi_post(app, "/v1/systemone", json.dumps(rotations_body(283, 255)).encode())
    assert reply.status_code == 413, reply.text
    assert "72165 rows" in reply.json()["detail"]["message"]


@pytest.mark.parametrize(
    "questions",
    [
        {"a": NOUL},
        {"a": {**NOUL, "x_orderings": "reversal"}, "b": {"type": "score", "criteria": ["lo", "mid", "hi"]}},
        {"c": {"type": "choice", "criteria": {"x": None, "y": "Y", "z": None}, "x_orderings": "all"}},
        {"c": {"type": "choice", "criteria": {f"o{i}": None for i in range(9)}}, "n": NOUL},
    ],
    ids=["noul_default", "reversal_and_score", "choice_all", "choice_shifts_and_noul"],
)
def test_the_early_row_count_is_the_number_of_rows_the_core_plans(service, questions):
    from semif_serve.doors.systemone.api import SystemOneDoor
    from semif_serve.doors.systemone.mapping import asked_question, rows_asked
    from semif_serve.doors.systemone.schemas import parse_request
    from semif_serve.service.core import plan_rows
    from semif_serve.service.methods.semif import core_question

    door = SystemOneDoor(service)
    body = json.dumps({"model": "jev-latest", "state": "s", "questions": questions}).encode()
    parsed = parse_request(body, door.max_options)
    mapped = [core_question(asked_question(qid, q), door.defaults) for qid, q in parsed.questions.items()]
    _, rows = plan_rows(mapped, max_rows=10_000, max_options=255, calibration=service.calibration)
    assert rows_asked(json.loads(body), service.models.base.method, door.defaults) == len(rows)


@pytest.mark.parametrize("orderings", [[None], {"mode": "all"}, 7, "sideways"])
def test_the_early_row_count_leaves_a_malformed_orderings_to_validation_a_422_not_a_500(app, orderings):
    body = {"model": "jev-latest", "state": "s", "questions": {"q": {**NOUL, "x_orderings": orderings}}}
    reply = asgi_post(app, "/v1/systemone", json.dumps(body).encode())
    assert reply.status_code == 422, reply.text
    assert reply.json()["detail"][0]["loc"][:3] == ["body", "questions", "q"]


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
    from semif_serve.service.startup import Service
    from tests.support import make_settings

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
    from semif_serve.domain.types import PromptRow, TooManyTokens

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
    from semif_serve.service.startup import Service
    from tests.support import make_settings

    service = Service.start(make_settings(checkpoint, systemone_max_request_tokens=100), engine=engine)
    body = {"state": "s", "decisions": [decision(id=f"q{i}") for i in range(8)]}
    reply = asgi_post(create_app(service), "/decide/shared", json.dumps(body).encode())
    assert reply.status_code == 200, reply.text


# -- inflation: bounded per body, off the loop, outside the body deadline ---------------------


def empty_frames(coding: str, count: int) -> bytes:
    """`count` empty gzip members, empty zstd frames, or zstd skippable frames, one after another."""
    import gzip
    import struct

    if coding == "gzip":
        return gzip.compress(b"") * count
    if coding == "zstd-skippable":
        return (struct.pack("<II", 0x184D2A50, 0)) * count
    try:
        from compression import zstd  # type: ignore[import-not-found]
    except ImportError:
        from backports import zstd
    return zstd.compress(b"") * count


@pytest.mark.parametrize("coding", ["gzip", "zstd", "zstd-skippable"])
def test_a_body_of_thousands_of_empty_frames_is_refused_as_corrupt_naming_the_cap(server, coding):
    import httpx

    from semif_serve.http.body_encoding import MAX_MEMBERS

    body = empty_frames(coding, 20_000) + empty_frames(coding.split("-")[0], 1)
    reply = httpx.post(
        f"{server.url}/decide",
        content=body,
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Encoding": coding.split("-")[0]},
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "invalid_compressed_body"
    assert f"more than {MAX_MEMBERS}" in error["message"]


def test_a_body_of_a_few_frames_is_still_one_body(server):
    import gzip

    import httpx

    data = json.dumps(decision()).encode()
    pieces = [gzip.compress(data[i : i + 10]) for i in range(0, len(data), 10)]
    assert len(pieces) < 64
    reply = httpx.post(
        f"{server.url}/decide",
        content=b"".join(pieces),
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Encoding": "gzip"},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text


class Gate:
    """Holds a wrapped call until released (at most `limit` seconds), to show what else runs meanwhile."""

    def __init__(self, real, limit: float = 8.0) -> None:
        import threading

        self.real = real
        self.limit = limit
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, *args, **kwargs):
        self.entered.set()
        self.release.wait(self.limit)
        return self.real(*args, **kwargs)


def health_while_held(server, gate: Gate, path: str, body: bytes, headers: dict) -> tuple[int, int]:
    """POST `body` in the background; once `gate` holds it, GET /health; (health, POST) statuses."""
    import threading

    import httpx

    result: dict = {}
    all_headers = {"Authorization": f"Bearer {TOKEN}", **headers}

    def post():
        result["post"] = httpx.post(f"{server.url}{path}", content=body, headers=all_headers, timeout=60)

    thread = threading.Thread(target=post)
    thread.start()
    try:
        assert gate.entered.wait(20), "the request never reached the held step"
        try:
            health = httpx.get(f"{server.url}/health", timeout=3).status_code
        except httpx.TimeoutException:
            health = 0
    finally:
        gate.release.set()
        thread.join(60)
    return health, result["post"].status_code


def test_health_answers_while_a_body_is_being_inflated(server, monkeypatch):
    import gzip

    from semif_serve.http.body_encoding import BodyDecoder

    gate = Gate(BodyDecoder.decode)
    monkeypatch.setattr(BodyDecoder, "decode", lambda self, data: gate(self, data))
    body = gzip.compress(json.dumps(decision()).encode())
    health, post = health_while_held(server, gate, "/decide", body, {"Content-Encoding": "gzip"})
    assert health == 200  # the loop was free while the body inflated
    assert post == 200


def test_health_answers_while_a_large_body_is_parsed_and_validated(server, monkeypatch):
    import semif_serve.doors.systemone.api as systemone_api

    gate = Gate(systemone_api.parse_request)
    monkeypatch.setattr(systemone_api, "parse_request", gate)
    body = json.dumps(systemone_body(q=NOUL)).encode()
    health, post = health_while_held(server, gate, "/v1/systemone", body, {})
    assert (health, post) == (200, 200)


def test_health_answers_while_rows_are_planned(server, monkeypatch):
    import semif_serve.service.methods.semif as semif

    gate = Gate(semif.plan_rows)
    monkeypatch.setattr(semif, "plan_rows", gate)  # SemIf's method plans the base's rows
    body = json.dumps({"state": "s", "decisions": [decision()]}).encode()
    health, post = health_while_held(server, gate, "/decide/shared", body, {})
    assert (health, post) == (200, 200)


def test_the_body_deadline_counts_the_clients_sending_not_the_servers_inflating(
    engine, checkpoint, monkeypatch
):
    import gzip
    import threading
    import time

    from semif_serve.http.body_encoding import BodyDecoder
    from semif_serve.service.startup import Service
    from tests.support import make_settings

    real = BodyDecoder.decode
    inflating = threading.Event()

    def slow(self, data):
        inflating.set()
        time.sleep(0.4)  # the server's own work, longer than the whole deadline
        return real(self, data)

    monkeypatch.setattr(BodyDecoder, "decode", slow)
    service = Service.start(make_settings(checkpoint, body_timeout_seconds=0.3), engine=engine)
    body = gzip.compress(json.dumps(decision()).encode())
    with HardenedServer(create_app(service)) as running:
        head = (
            f"POST /decide HTTP/1.1\r\nHost: t\r\n{AUTH}Content-Encoding: gzip\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        sock = running.connect(head + body[:10])
        assert inflating.wait(10), "the server never inflated the body's first piece"
        sock.sendall(body[10:])
        status, _, reply = read_response(sock, timeout=30)
    assert status == 200, reply


# -- fairness: rounds take turns a group at a time -----------------------------------------------


def test_a_small_request_arriving_during_a_heavy_one_runs_after_the_forward_in_progress_not_after_all():
    import asyncio

    from semif_serve.engine.batching import Batcher, Bounds, Job
    from tests.engine.test_batching import GatedEngine, run, settle, shape

    engine = GatedEngine()

    async def main():
        batcher = Batcher(engine, Bounds(max_batch_rows=1))
        heavy = asyncio.create_task(batcher.submit(Job("heavy", None, 0, (5,) * 5, "H")))
        await asyncio.to_thread(engine.started.wait, 10)
        tiny = asyncio.create_task(batcher.submit(Job("tiny", None, 0, (3,), "T")))
        await settle()
        engine.release.set()
        results = await asyncio.gather(heavy, tiny)
        await batcher.close()
        return results

    heavy, tiny = run(main())
    assert heavy == [f"H#{i}" for i in range(5)] and tiny == ["T#0"]
    assert shape(engine.groups) == [
        [("heavy", 0, 1)],
        [("tiny", 0, 1)],
        [("heavy", 1, 2)],
        [("heavy", 2, 3)],
        [("heavy", 3, 4)],
        [("heavy", 4, 5)],
    ]


def test_two_heavy_rounds_take_turns_group_by_group():
    import asyncio

    from semif_serve.engine.batching import Batcher, Bounds, Job
    from tests.engine.test_batching import GatedEngine, run, settle, shape

    engine = GatedEngine()

    async def main():
        batcher = Batcher(engine, Bounds(max_batch_rows=1))
        a = asyncio.create_task(batcher.submit(Job("a", None, 0, (5,) * 3, "A")))
        await asyncio.to_thread(engine.started.wait, 10)
        b = asyncio.create_task(batcher.submit(Job("b", None, 0, (5,) * 3, "B")))
        await settle()
        engine.release.set()
        return await asyncio.gather(a, b)

    assert run(main()) == [["A#0", "A#1", "A#2"], ["B#0", "B#1", "B#2"]]
    order = [g[0][0] for g in shape(engine.groups)]
    assert order == ["a", "b", "a", "b", "a", "b"]


# -- memory for long questions: the suffix forward is chunked like the prefill ------------------


def plain_last_logits(engine, ids: list[int]):
    """model(input_ids=the whole prompt): float32 logits of the last position, no cache, no chunks."""
    import torch

    with torch.no_grad():
        return (
            engine.model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1)
            .logits[0, -1]
            .float()
        )


@pytest.mark.parametrize("chunk", [5, 64])
@pytest.mark.parametrize("with_prefix", [True, False], ids=["over-a-state", "no-prefix"])
def test_a_chunked_suffix_forward_equals_a_plain_full_forward_of_each_row(engine, chunk, with_prefix):
    import torch

    from semif_serve.engine.forwards import logits_over, prefill
    from semif_serve.engine.state_cache import StoredState

    codec = engine.codec
    prefix = codec.encode("<|im_start|>user\nThe zones recovered after the release. " * 3)
    suffixes = [
        codec.encode(" Did every zone recover, and how long did the errors last? " * k) for k in (1, 3, 6)
    ] + [codec.encode(" ok")]
    if not with_prefix:
        prefix = []
    cache = StoredState(prefix, prefill(engine.model, prefix)).fork(len(suffixes)) if prefix else None
    got = logits_over(engine.model, cache, len(prefix), suffixes, engine.pad_id, chunk_tokens=chunk)
    assert max(map(len, suffixes)) > chunk  # the widest row spans several chunks
    for row, suffix in zip(got, suffixes, strict=True):
        want = plain_last_logits(engine, prefix + suffix)
        assert torch.allclose(row, want, atol=1e-5, rtol=0), float((row - want).abs().max())


def test_the_engine_never_runs_a_suffix_forward_wider_than_the_chunk(engine, monkeypatch):
    from semif_serve.domain.types import PromptRow
    from semif_serve.engine.state_cache import StateCache

    chunked = engine.with_options(cache=StateCache(0), prefill_chunk_tokens=32)
    widths: list[int] = []
    decoder = chunked.model.get_decoder()
    real = type(decoder).forward

    def recording(self, *args, **kwargs):
        widths.append(kwargs["input_ids"].shape[1])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(decoder), "forward", recording)
    long_question = "Across every zone, did the error rate stay under one percent after the fix? " * 12
    rows = [PromptRow(long_question, ("Yes.", "No.")), PromptRow("Short?", ("Yes.", "No."))]
    readout = chunked.read(RowsRequest.of("The zones recovered.", rows, shared=True, max_input_tokens=4096))
    assert readout.rows[0].input_tokens - readout.timing.prefix_tokens > 100  # a long suffix
    assert widths and max(widths) <= 32  # prefill and suffix alike, never a wider forward
    monkeypatch.undo()
    for got, row in zip(readout.rows, rows, strict=True):
        alone = RowsRequest.of("The zones recovered.", [row], shared=False, max_input_tokens=4096)
        direct = engine.read(alone).rows[0]
        assert max(abs(a - b) for a, b in zip(got.option_logits, direct.option_logits, strict=True)) <= 1e-5


# -- fairness on the engine: a long prefill runs in steps between which others run ------------

LONG_STATE = "The zones recovered after the release, then the errors stopped for good. " * 30


def test_a_long_state_is_prefilled_in_steps_that_give_the_numbers_of_one_prefill(engine):
    from semif_serve.domain.types import PromptRow
    from semif_serve.engine.batching import UNFINISHED, Group
    from semif_serve.engine.runner import _whole
    from semif_serve.engine.state_cache import StateCache

    rows = [PromptRow("Did it recover?", ("Yes.", "No.")), PromptRow("Were there errors?", ("Yes.", "No."))]
    stepping = engine.with_options(cache=StateCache(64 << 20), prefill_chunk_tokens=16)
    prepared = stepping.prepare(RowsRequest.of(LONG_STATE, rows, shared=True, max_input_tokens=4096))
    job = prepared.job(0)
    group = Group(job.prefix_key, job.prefix_tokens, (_whole(job),))
    steps = 0
    while (scored := stepping.run_group(group)) is UNFINISHED:
        steps += 1
    assert steps >= len(prepared.prefix) // 16 - 1  # 16-token chunks, one per step
    readout = stepping.readout(prepared, scored[0])
    assert readout.timing.prefill == "fresh"
    kept = 2 if prepared.state_tokens < len(prepared.prefix) else 1  # the state prefix, the whole prefix
    assert stepping.cache.stats().entries == kept  # and no step's slice left behind
    whole = engine.with_options(cache=StateCache(0), prefill_chunk_tokens=None).read(
        RowsRequest.of(LONG_STATE, rows, shared=True, max_input_tokens=4096)
    )
    for got, want in zip(readout.rows, whole.rows, strict=True):
        assert max(abs(a - b) for a, b in zip(got.option_logits, want.option_logits, strict=True)) <= 1e-5


def test_a_tiny_request_is_answered_while_a_long_prefill_is_still_running(engine):
    import asyncio

    from semif_serve.domain.types import PromptRow
    from semif_serve.engine.memory import HostMemory, ReleasePolicy
    from semif_serve.engine.state_cache import StateCache
    from semif_serve.engine.worker import EngineWorker
    from tests.support.scoring import score

    stepping = engine.with_options(cache=StateCache(64 << 20), prefill_chunk_tokens=16)
    finished: list[str] = []
    starts: list[str] = []
    real = stepping.run_groups

    def recording(groups):
        starts.extend(group.parts[0].job.id for group in groups)
        return real(groups)

    stepping.run_groups = recording  # type: ignore[method-assign]
    worker = EngineWorker(stepping, ReleasePolicy(HostMemory(), 1 << 30))

    async def ask(name: str, state: str) -> None:
        await score(
            worker,
            RowsRequest.of(
                state, [PromptRow("Did it recover?", ("Yes.", "No."))], shared=True, max_input_tokens=4096
            ),
        )
        finished.append(name)

    async def main():
        heavy = asyncio.create_task(ask("heavy", LONG_STATE))
        while not starts:
            await asyncio.sleep(0.01)
        await ask("tiny", "Short state.")
        await heavy

    try:
        asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        worker.shutdown()
    assert finished == ["tiny", "heavy"]
