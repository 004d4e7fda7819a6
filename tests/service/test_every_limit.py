"""Every request limit of System One holds the same way on every kind of served model, lev's
candidate head (Mode B) included: the largest request a limit admits is answered, and the same
request under a limit one row, one token or one byte smaller is refused with 413 before any
forward, leaving nothing held. A request's size comes from outside the code under test: its rows
from the reply's own account of its readings (SemIf's `x_semif.rows`; lev's orders, plus one row
per candidate its head read), its tokens from `usage.input_tokens` (checked against the tokenizer
for Mode B in tests/doors/test_systemone_lev.py; SemIf's question is asked in one ordering there,
since its usage counts a prefix shared past the state once, where the budget counts the state
once), its bytes from the reply itself."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from semif_serve.app import create_app
from tests.http.test_operations import metric
from tests.service.test_every_model import talk
from tests.support.served_models import SERVED, Served, serving, systemone_body, write_models_file

# A lev release whose label cap (2) sends a question of more options to its candidate head.
MODE_B = Served("lev-mode-b", "lev-capped", "lev", adapter=True)
KINDS = (*SERVED, MODE_B)
OPTIONS = ("billing", "tech", "sales", "legal")
# Each limit's setting, and the words its refusal uses to give the size it counted.
LIMITS = {
    "rows": "systemone_max_rows",
    "tokens": "systemone_max_request_tokens",
    "reply bytes": "max_reply_bytes",
}
STATES = itertools.count(1000)


@pytest.fixture(scope="module")
def models(checkpoint, tmp_path_factory):
    """Every served kind, and the release again under a label cap of 2."""
    path = write_models_file(checkpoint, tmp_path_factory.mktemp("every-limit"))
    path.write_text(path.read_text() + '[models.lev-capped]\nrelease = "plain"\nmax_label_options = 2\n')
    return path


@pytest.fixture(scope="module")
def service(engine, checkpoint, models):
    """One service over every kind; each limit is set on an app of its own over it."""
    with serving(engine, checkpoint, models) as started:
        yield started


def under(service, setting: str, value: int):
    """The real app over `service` with one limit set to `value` (the loaded models shared)."""
    settings = service.settings.model_copy(update={setting: value})
    return create_app(dataclasses.replace(service, settings=settings))


def body(served: Served, limit: str) -> dict:
    """A four-option choice about a new state (each state the same number of tokens: four digits;
    a noul where the model answers no choice)."""
    state = f"Ticket {next(STATES):04d}: the refund was charged twice and the customer wants a lawyer."
    question = {"type": "choice", "criteria": dict.fromkeys(OPTIONS)}
    if not served.asks("choice"):
        question = {"type": "noul", "instructions": "Does the customer want a lawyer?"}
    if limit == "tokens" and served.method == "semif":
        question["x_orderings"] = "none"
    return systemone_body(served, state, {"who": question})


def rows_of(answer: dict) -> int:
    """The forward rows a reply says its answer read."""
    if "x_semif" in answer:
        return answer["x_semif"]["rows"]
    if "x_yes_no" in answer:  # the third method's
        return answer["x_yes_no"]["rows"]
    lev = answer["x_lev"]
    return lev["orders"] + (len(OPTIONS) if lev["mode"] == "B" else 0)


def sent(app, served: Served, limit: str) -> tuple[int, dict]:
    """A request answered under `app`: the reply's status and body, with its bytes."""

    async def script(c):
        return await c.post("/v1/systemone", json=body(served, limit))

    reply = talk(app, script)
    assert reply.status_code == 200, reply.text
    return len(reply.content), reply.json()


def size(measured: tuple[int, dict], limit: str) -> int:
    """The request's size under `limit`, from its reply."""
    length, reply = measured
    if limit == "rows":
        return rows_of(reply["answers"]["who"])
    if limit == "tokens":
        return reply["usage"]["input_tokens"]
    return length


def refused_before_any_forward(app, served: Served, limit: str):
    """The request under `app`: its reply, whether a forward ran for it, and the queue after."""

    async def script(c):
        before = (await c.get("/metrics")).text
        reply = await c.post("/v1/systemone", json=body(served, limit))
        after = (await c.get("/metrics")).text
        queue = (await c.get("/health")).json()["queue"]
        return reply, metric(after, "semif_forwards_total") - metric(before, "semif_forwards_total"), queue

    return talk(app, script)


@pytest.mark.parametrize("limit", list(LIMITS))
@pytest.mark.parametrize("served", KINDS, ids=[kind.id for kind in KINDS])
def test_the_largest_request_a_limit_admits_is_answered_and_one_past_it_refused_before_any_forward(
    service, served, limit
):
    setting = LIMITS[limit]
    measured = sent(create_app(service), served, limit)
    need = size(measured, limit)
    if limit == "reply bytes":  # the budget counts a bound before the reply exists: learn it from a refusal
        reply, forwards, _ = refused_before_any_forward(under(service, setting, need - 1), served, limit)
        assert reply.status_code == 413, reply.text
        need = int(reply.json()["detail"]["message"].split("up to ")[1].split(" bytes")[0])
        assert need >= measured[0] and forwards == 0
    at_limit = sent(under(service, setting, need), served, limit)
    assert size(at_limit, limit) <= need
    reply, forwards, queue = refused_before_any_forward(under(service, setting, need - 1), served, limit)
    assert reply.status_code == 413, reply.text
    detail = reply.json()["detail"]
    assert detail["error_type"] == "request_too_large"
    assert str(need) in detail["message"] and str(need - 1) in detail["message"]
    assert forwards == 0
    assert queue == {"in_progress": 0, "reading_bodies": 0, "engine_pending": 0}


def test_a_mode_b_request_of_many_candidates_is_refused_at_the_row_cap_not_answered(service):
    # The hostile request of issue 49, scaled down: choices of many options, each read by the head.
    many = {f"q{i}": {"type": "choice", "criteria": {f"team {k}": None for k in range(40)}} for i in range(8)}

    async def script(c):
        return await c.post("/v1/systemone", json=systemone_body(MODE_B, "Who handles it?", many))

    reply = talk(under(service, "systemone_max_rows", 256), script)
    assert reply.status_code == 413, reply.text
    assert "328 rows" in reply.json()["detail"]["message"]  # 8 head rows and 8 x 40 candidates
