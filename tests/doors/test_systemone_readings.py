"""What System One's reply says beyond TypeSafe's fields: each ordering's reading (`x_semif.readings`)
and how the batch ran (`x_timing`), which the playground page shows."""

from __future__ import annotations

import math
import uuid

import pytest

from semif_serve.app import create_app
from tests.doors.test_systemone import ask, assert_close, choice, native


@pytest.fixture(scope="module")
def app(service):
    return create_app(service)


def test_each_reading_is_the_question_asked_once_in_that_order(app):
    question = choice(6)
    answer = ask(app, {"q": question})["answers"]["q"]
    readings = answer["x_semif"]["readings"]
    assert len(readings) == answer["x_semif"]["rows"] == 4
    assert readings[0]["order"] == list(question["criteria"])
    for reading in readings:
        reordered = {**question, "criteria": {name: question["criteria"][name] for name in reading["order"]}}
        alone = ask(app, {"q": native(reordered)})["answers"]["q"]["probabilities"]
        assert list(reading["probabilities"]) == reading["order"]
        assert_close(list(reading["probabilities"].values()), list(alone.values()))


def test_the_answer_is_the_log_mean_of_its_readings_logits_and_agreement_counts_their_tops(app):
    question = {"type": "noul", "instructions": "Is the customer asking for money back?"}
    answer = ask(app, {"n": question})["answers"]["n"]
    readings = answer["x_semif"]["readings"]
    assert [r["order"] for r in readings] == [["true", "false"], ["false", "true"]]
    # Two options: a reading's log-odds is its logit difference, so the log-mean is the mean log-odds.
    log_odds = [math.log(r["probabilities"]["true"] / r["probabilities"]["false"]) for r in readings]
    assert answer["noul"] == pytest.approx(1 / (1 + math.exp(-sum(log_odds) / 2)), abs=1e-6)
    top = "true" if answer["noul"] >= 0.5 else "false"
    tops = [max(r["probabilities"], key=r["probabilities"].get) for r in readings]
    assert answer["x_semif"]["agreement"] == tops.count(top) / len(tops)


def test_a_question_asked_once_has_one_reading_its_native_probabilities(app):
    question = native(choice(3))
    answer = ask(app, {"q": question})["answers"]["q"]
    (reading,) = answer["x_semif"]["readings"]
    logits = answer["x_semif"]["option_logits"]
    exps = {name: math.exp(v - max(logits.values())) for name, v in logits.items()}
    assert_close(list(reading["probabilities"].values()), [e / sum(exps.values()) for e in exps.values()])
    assert reading["probabilities"] == answer["probabilities"]


def test_x_timing_says_a_short_state_ran_plain_and_a_long_ones_follow_up_came_from_the_cache(service):
    import asyncio

    import httpx

    from tests.support import TOKEN

    short = f"Ticket {uuid.uuid4().hex}: the invoice was paid twice."
    state = short + " The customer wrote again about it." * 300  # past keep_state_tokens: kept

    async def both() -> tuple[dict, dict]:
        transport = httpx.ASGITransport(app=create_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            auth = {"Authorization": f"Bearer {TOKEN}"}

            async def one(question: dict, about: str = state) -> dict:
                body = {"model": "jev-latest", "state": about, "questions": {"q": question}}
                reply = await c.post("/v1/systemone", json=body, headers=auth)
                assert reply.status_code == 200, reply.text
                return reply.json()

            plain = await one(native(choice(3)), short)
            first = await one(native(choice(3)))  # its own pass ends at the state and keeps it
            return plain, first, await one(native(choice(4, "z")))

    plain, first, again = asyncio.run(both())
    assert plain["x_timing"]["prefill"] == "none"  # SemIf's plain forward: no state prefilled
    assert first["x_timing"]["prefill"] == "fresh"
    assert again["x_timing"]["prefill"] == "cached"
    for reply in (plain, first, again):
        timing = reply["x_timing"]
        assert reply["usage"]["input_tokens"] == timing["prefix_tokens"] + timing["true_suffix_tokens"]
        assert 0 < timing["forward_seconds"] <= timing["total_seconds"]
