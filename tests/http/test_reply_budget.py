"""Replies are bounded like requests: each door counts its reply before any engine work, the
count is an upper bound of the bytes really sent (and not a loose one), a request whose reply
would pass SEMIF_MAX_REPLY_BYTES is a 413 naming the need and the budget, and the reply is
serialised off the event loop.

The counts are checked against the replies the real app sends for generated requests over the
tiny Qwen3.5 (their lengths, byte for byte as received); the attack (72 options of 14 KB names,
every one described, in rotations, a few hundred bytes of zstd) over a real uvicorn.
"""

from __future__ import annotations

import json
import threading
import time
import tracemalloc

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from semif_serve.app import create_app
from semif_serve.doors import base
from semif_serve.doors.base import json_reply
from semif_serve.doors.native.api import model_bytes as native_model_bytes
from semif_serve.doors.native.api import result_bytes, shared_reply_bytes
from semif_serve.doors.native.api import to_question as native_question
from semif_serve.doors.native.schemas import DecisionBody, SharedDecisionsBody, parse_body
from semif_serve.doors.systemone.api import SystemOneDoor
from semif_serve.doors.systemone.mapping import asked_questions, timing_block
from semif_serve.doors.systemone.schemas import SystemOneResponse, Usage, parse_request
from semif_serve.doors.systemone.sizes import reply_bytes
from semif_serve.service.methods import Ask
from semif_serve.service.settings import Settings
from semif_serve.service.startup import Service
from tests.doors.test_systemone_boxes import answered
from tests.http.test_body_encoding import zstded
from tests.http.test_hardening import HardenedServer
from tests.http.test_no_stalls import Gate, health_while_held
from tests.support import TOKEN, decision, in_process_client, make_settings

PROPERTY = settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
LOOSEST = 2.0  # the count may pass the real length by this factor at most (numbers are bounded, text exact)
STATE = "The March invoice was charged twice; the customer asked for a refund."

# Text of every kind JSON escapes or widens: quotes, backslashes, controls, accents, emoji (no surrogates).
names = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=16).filter(str.strip)
descriptions = (
    st.none() | st.text(max_size=12) | st.dictionaries(st.text(max_size=4), st.integers(), max_size=2)
)


@pytest.fixture(scope="module")
def calibrated(engine, checkpoint, tmp_path_factory) -> Service:
    """The service with a workload for every answer type (calibrated blocks included)."""
    path = tmp_path_factory.mktemp("calibration") / "calibration.json"
    path.write_text(json.dumps({"grading": {"single": 1.5, "rotations": 2.0}}))
    return Service.start(make_settings(checkpoint, calibration=path), engine=engine)


@pytest.fixture(scope="module")
def client(calibrated):
    return in_process_client(create_app(calibrated))


@pytest.fixture(scope="module")
def door(calibrated) -> SystemOneDoor:
    return SystemOneDoor(calibrated)


def assert_bounds(real: int, counted: int) -> None:
    assert real <= counted <= LOOSEST * real, (real, counted)


def counted(service: Service, door: SystemOneDoor, body: bytes) -> int:
    """The door's count of its reply to `body`, from the plan of the base's method, as it asks it."""
    parsed = parse_request(body, door.max_options)
    served = service.models.base
    ask = Ask(served, parsed.state, asked_questions(parsed.questions), door.limits, defaults=door.defaults)
    kinds = [(qid, q.type) for qid, q in parsed.questions.items()]
    return reply_bytes(served.method, served.method.plan(ask), kinds, door.model_name)


# -- the count is an upper bound of the real reply, and a close one --------------------------------


@st.composite
def systemone_questions(draw) -> dict:
    questions = {}
    for qid in draw(st.lists(names, min_size=1, max_size=3, unique=True)):
        kind = draw(st.sampled_from(["noul", "choice", "score"]))
        question: dict = {"type": kind}
        if kind == "noul":
            question["criteria"] = {"true": draw(descriptions), "false": draw(descriptions)}
            orderings = ["none", "rotations", "reversal"]
        elif kind == "choice":
            options = draw(st.lists(names, min_size=2, max_size=6, unique=True))
            question["criteria"] = {name: draw(descriptions) for name in options}
            orderings = ["none", "rotations", "shifts", "reversal"] + (["all"] if len(options) <= 3 else [])
        else:
            question["criteria"] = draw(st.lists(st.text(min_size=1, max_size=10), min_size=2, max_size=5))
            orderings = ["none", "reversal"]
        question["x_orderings"] = draw(st.sampled_from(orderings))
        if draw(st.booleans()):
            question["x_workload"] = "grading"
        questions[qid] = question
    return questions


@PROPERTY
@given(questions=systemone_questions())
def test_system_one_counts_at_least_every_byte_it_sends_and_at_most_twice_as_many(
    client, calibrated, door, questions
):
    body = json.dumps({"model": "jev-latest", "state": STATE, "questions": questions}).encode()
    reply = client.post("/v1/systemone", content=body)
    assert reply.status_code == 200, reply.text
    assert_bounds(len(reply.content), counted(calibrated, door, body))


def largest_legitimate_choice(name_chars: int) -> dict:
    """The largest reply a request may legitimately ask: a choice of 255 described options (the
    most any request may have) in rotations (255 readings, within the row cap of 256)."""
    criteria = {f"{i:03d}" + "n" * (name_chars - 3): f"Option {i}." for i in range(255)}
    return {"pick": {"type": "choice", "criteria": criteria, "x_orderings": "rotations"}}


def test_the_default_reply_budget_is_sized_to_the_largest_legitimate_reply(calibrated, door):
    budget = Settings.model_fields["max_reply_bytes"].default
    counts = {}
    for chars in (16, 64):
        questions = largest_legitimate_choice(chars)
        body = json.dumps({"model": "jev-latest", "state": STATE, "questions": questions}).encode()
        counts[chars] = counted(calibrated, door, body)
    assert counts[64] <= budget <= 1.5 * counts[64]  # names of 64 characters fit, with a margin, no more


@pytest.mark.parametrize("orderings", ["none", "reversal"])
def test_a_box_answer_is_counted_as_its_four_edges_with_every_position(calibrated, door, orderings):
    questions = {"where 'box'": {"type": "box", "x_orderings": orderings, "x_workload": "grading"}}
    answers, _, decided = answered(calibrated, door, questions)
    sent = json_reply(
        SystemOneResponse(
            model=door.model_name,
            answers=answers,
            usage=Usage(input_tokens=1, output_tokens=0),
            x_timing=timing_block(decided),
        )
    )
    body = json.dumps({"model": "m", "state": "s", "questions": questions}).encode()
    assert_bounds(len(sent.body), counted(calibrated, door, body))


@st.composite
def native_decisions(draw) -> list[dict]:
    decisions = []
    for did in draw(st.lists(names, min_size=1, max_size=3, unique=True)):
        ids = draw(st.lists(names, min_size=2, max_size=6, unique=True))
        options = [{"id": i, "description": draw(st.text(max_size=10))} for i in ids]
        orderings = draw(st.sampled_from([None, "rotations"] + (["all"] if len(ids) <= 3 else [])))
        workload = draw(st.sampled_from([None, "grading"]))
        decisions.append(decision(id=did, options=options, orderings=orderings, workload=workload))
    return decisions


@PROPERTY
@given(decisions=native_decisions())
def test_the_native_door_counts_at_least_every_byte_it_sends_and_at_most_twice_as_many(
    client, calibrated, decisions
):
    identity = native_model_bytes(calibrated.engine.model_info)
    one = json.dumps(decisions[0]).encode()
    reply = client.post("/decide", content=one)
    assert reply.status_code == 200, reply.text
    question = native_question(parse_body(DecisionBody, one))
    assert_bounds(len(reply.content), result_bytes(question, identity, timed=True))

    shared = json.dumps({"state": STATE, "decisions": decisions}).encode()
    reply = client.post("/decide/shared", content=shared)
    assert reply.status_code == 200, reply.text
    questions = [native_question(d) for d in parse_body(SharedDecisionsBody, shared).decisions]
    assert_bounds(len(reply.content), shared_reply_bytes(questions, calibrated.engine.model_info))


# -- a reply over the budget is refused before any engine work -------------------------------------


@pytest.fixture(scope="module")
def small_budget(engine, checkpoint):
    """A service whose replies may be 20 kB: a few described options in rotations pass it."""
    service = Service.start(make_settings(checkpoint, max_reply_bytes=20_000), engine=engine)
    return in_process_client(create_app(service))


def no_engine(monkeypatch) -> None:
    from semif_serve.engine.worker import EngineWorker

    def refuse(*args, **kwargs):
        raise AssertionError("the engine was asked")

    monkeypatch.setattr(EngineWorker, "score_job", refuse)  # every method's rows reach the engine as jobs


def wide_options(count: int, name_length: int) -> dict[str, str]:
    return {f"{i:03d}" + "n" * (name_length - 3): "A short description." for i in range(count)}


def test_a_system_one_reply_over_the_budget_is_413_naming_the_need_and_the_budget(small_budget, monkeypatch):
    no_engine(monkeypatch)
    question = {"type": "choice", "criteria": wide_options(24, 60), "x_orderings": "rotations"}
    body = {"model": "jev-latest", "state": STATE, "questions": {"pick": question}}
    reply = small_budget.post("/v1/systemone", json=body)
    assert reply.status_code == 413, reply.text
    detail = reply.json()["detail"]
    assert detail["error_type"] == "request_too_large"
    need = int(detail["message"].split("up to ")[1].split(" bytes")[0])
    assert need > 20_000
    assert "over the reply budget of 20000 bytes" in detail["message"]


def test_a_native_reply_over_the_budget_is_413_reply_too_large_naming_the_field(small_budget, monkeypatch):
    no_engine(monkeypatch)
    options = [{"id": name, "description": "d"} for name in wide_options(16, 60)]
    one = small_budget.post("/decide", json=decision(options=options, orderings="rotations"))
    assert one.status_code == 413, one.text
    error = one.json()["error"]
    assert (error["code"], error["field"]) == ("reply_too_large", "options")
    assert "over the reply budget of 20000 bytes" in error["message"]
    shared = small_budget.post(
        "/decide/shared",
        json={"state": STATE, "decisions": [decision(options=options, orderings="rotations")]},
    )
    assert shared.status_code == 413, shared.text
    assert (shared.json()["error"]["code"], shared.json()["error"]["field"]) == (
        "reply_too_large",
        "decisions",
    )


def test_a_reply_within_the_budget_is_answered(small_budget):
    options = [{"id": name, "description": "d"} for name in wide_options(4, 8)]
    reply = small_budget.post("/decide", json=decision(options=options, orderings="rotations"))
    assert reply.status_code == 200, reply.text
    assert len(reply.content) <= 20_000


# -- the reply is serialised off the event loop, and the attack is refused fast --------------------


@pytest.fixture(scope="module")
def server(service):
    with HardenedServer(create_app(service)) as running:
        yield running


def test_health_answers_while_a_reply_is_serialised(server, monkeypatch):
    gate = Gate(json_reply)
    monkeypatch.setattr(base, "json_reply", gate)
    body = json.dumps({"state": STATE, "decisions": [decision(orderings="rotations")]}).encode()
    health, post = health_while_held(server, gate, "/decide/shared", body, {})
    assert (health, post) == (200, 200)


def amplifying_body() -> bytes:
    """72 options of 14 KB names, each described (a name then costs no token), in rotations:
    unbounded, 72 readings of 72 names twice each, some 145 MB of reply."""
    criteria = {f"{i:02d}" + "x" * 13_998: f"Option {i}." for i in range(72)}
    question = {"type": "choice", "criteria": criteria, "x_orderings": "rotations"}
    return json.dumps({"model": "jev-latest", "state": STATE, "questions": {"pick": question}}).encode()


ZSTD = {"Authorization": f"Bearer {TOKEN}", "Content-Encoding": "zstd"}


def assert_refused_naming_the_need(reply: httpx.Response) -> None:
    assert reply.status_code == 413, reply.text
    detail = reply.json()["detail"]
    assert detail["error_type"] == "request_too_large"
    need = int(detail["message"].split("up to ")[1].split(" bytes")[0])
    assert need > 100 * 2**20  # the need named: ~140 MiB
    assert f"reply budget of {Settings.model_fields['max_reply_bytes'].default} bytes" in detail["message"]


def test_the_reply_amplification_attack_is_refused_fast_while_health_answers(server):
    plain = amplifying_body()
    body = zstded(plain)
    assert len(body) < 1000 < 1_000_000 < len(plain) < 1_048_576
    replies: list[httpx.Response] = []

    def attack() -> None:
        replies.append(httpx.post(f"{server.url}/v1/systemone", content=body, headers=ZSTD, timeout=30))

    attackers = [threading.Thread(target=attack) for _ in range(2)]
    started = time.monotonic()
    for attacker in attackers:
        attacker.start()
    health = []
    while any(a.is_alive() for a in attackers):
        begun = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=1).status_code == 200
        health.append(time.monotonic() - begun)
    for attacker in attackers:
        attacker.join()
    assert time.monotonic() - started < 10  # generous: 1 MB bodies inflated, parsed and counted
    assert health and max(health) < 1.0
    assert len(replies) == 2
    for reply in replies:
        assert_refused_naming_the_need(reply)


def test_a_long_reply_is_gzip_compressed_on_the_wire_for_a_client_that_accepts_it(server):
    questions = {"pick": {"type": "choice", "criteria": {f"{i:02d}" + "n" * 60: None for i in range(24)}}}
    questions["pick"]["x_orderings"] = "rotations"
    body = json.dumps({"model": "jev-latest", "state": STATE, "questions": questions})
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        plain = client.post("/v1/systemone", content=body, headers={**auth, "Accept-Encoding": "identity"})
        packed = client.post("/v1/systemone", content=body, headers={**auth, "Accept-Encoding": "gzip"})
        small = client.get("/livez", headers={"Accept-Encoding": "gzip"})
    assert plain.status_code == packed.status_code == 200
    assert "content-encoding" not in plain.headers and packed.headers["content-encoding"] == "gzip"
    wire = int(packed.headers["content-length"])
    assert wire * 5 < len(plain.content)  # the repeated names cost little on the wire
    unpacked = json.loads(packed.content)["answers"]["pick"]  # httpx inflated it, as any client would
    assert unpacked["probabilities"] == pytest.approx(plain.json()["answers"]["pick"]["probabilities"])
    assert "content-encoding" not in small.headers  # a short reply goes as it is


def test_the_reply_amplification_attack_leaves_memory_flat(server):
    body = zstded(amplifying_body())
    tracemalloc.start()
    try:
        reply = httpx.post(f"{server.url}/v1/systemone", content=body, headers=ZSTD, timeout=30)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert_refused_naming_the_need(reply)
    assert peak < 64 * 2**20  # the reply would have been ~145 MB of text, several times that as objects


def missing_images_body(key_length: int, placeholders: int) -> dict:
    """One state key of `key_length` characters holding `placeholders` images that have no asset:
    each is its own error, and each error's loc repeats the key."""
    return {
        "model": "jev-latest",
        "state": {"K" * key_length: "<image:a>" * placeholders},
        "questions": {"q": {"type": "noul"}},
    }


def bad_criteria_body(id_length: int, criteria: int) -> dict:
    """One question of an `id_length`-character id whose `criteria` criteria are each invalid."""
    choice = {"type": "choice", "criteria": {f"c{i}": 1 for i in range(criteria)}}
    return {"model": "jev-latest", "state": "s", "questions": {"q" * id_length: choice}}


@pytest.mark.parametrize(
    "body", [missing_images_body(20_000, 1_000), bad_criteria_body(10_000, 200)], ids=["images", "criteria"]
)
def test_a_422_stays_small_however_many_errors_a_small_body_makes(client, body):
    raw = json.dumps(body).encode()
    reply = client.post("/v1/systemone", content=raw, headers={"Content-Type": "application/json"})
    assert reply.status_code == 422
    detail = reply.json()["detail"]
    assert len(reply.content) < 64 * 1024 < 10 * len(raw)  # before: 20 MB and 6 MB replies
    assert detail[-1]["msg"].startswith("and ") and detail[-1]["msg"].endswith("more errors, not listed")
    assert all(len(str(part)) < 300 for item in detail for part in item["loc"])
    assert any("characters)" in str(part) for item in detail for part in item["loc"])  # the cut is said
