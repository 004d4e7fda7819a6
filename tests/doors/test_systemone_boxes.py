"""Box questions through the System One door's mapping and the real decision core on the tiny
Qwen3.5: a box is asked as four edge questions in the request's one batch, and its answer equals
the pair rule written out with numpy over plain forwards of the edge prompts, softmax by hand.

Here the edge questions are asked over a text state through the same functions the door's
request path calls (`asked_questions`, `Service.decide`, `answers_of`); about a real image, over
HTTP and through the SDK, in test_systemone_vision.py."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from semif_serve.app import create_app
from semif_serve.doors.systemone.api import SystemOneDoor
from semif_serve.doors.systemone.mapping import answers_of, asked_questions, timing_block, usage_of
from semif_serve.doors.systemone.schemas import SystemOneResponse, parse_request
from semif_serve.service.methods import Ask
from semif_serve.service.methods.semif import core_questions, evaluated_tokens
from semif_serve.service.startup import Service
from tests.doors.test_systemone import STATE, answer_codes_by_hand, assert_close, call, plain_forward
from tests.support import make_settings

EDGES = ("top", "bottom", "left", "right")
GRID = np.array([i / 20 for i in range(21)])  # the documented positions, written out
TOL = 1e-5


@pytest.fixture(scope="module")
def codes(tokenizer):
    return answer_codes_by_hand(tokenizer)


@pytest.fixture(scope="module")
def door(service):
    return SystemOneDoor(service)


def answered(service, door, questions: dict, state=STATE):
    """The door's mapping of `questions`, asked of the base in one call under the door's limits
    and defaults: the answers, each question's core questions, and the method's outcome."""
    parsed = parse_request(
        json.dumps({"model": "jev-latest", "state": state, "questions": questions}).encode(), 255
    )
    questions_asked = asked_questions(parsed.questions)
    asked = [core_questions(q, door.defaults) for q in questions_asked]
    served = service.models.base
    ask = Ask(served, state, questions_asked, door.limits, defaults=door.defaults)
    decided = asyncio.run(service.decide(ask))
    return answers_of(list(parsed.questions), decided.answers, served.method), asked, decided


def by_hand(logits: list[float]) -> np.ndarray:
    exps = np.exp(np.asarray(logits) - max(logits))
    return exps / exps.sum()


def pair_by_brute_force(p: np.ndarray, q: np.ndarray) -> tuple[float, float, np.ndarray, np.ndarray]:
    joint = np.triu(np.outer(p, q), k=1)
    joint /= joint.sum()
    low, high = joint.sum(axis=1), joint.sum(axis=0)
    return float(low @ GRID), float(high @ GRID), low, high


def score_confidence_by_hand(marginal: np.ndarray) -> float:
    """TypeSafe's score confidence: 1 - sum_i p_i |i - k| / D, k the mode, D = mean |i - (n-1)/2|."""
    n = len(marginal)
    k = int(np.argmax(marginal))
    spread = np.mean(np.abs(np.arange(n) - (n - 1) / 2))
    return min(1.0, max(0.0, 1 - float(np.sum(marginal * np.abs(np.arange(n) - k))) / spread))


def expected_box(edge_probabilities: dict[str, np.ndarray]) -> tuple[dict[str, float], float]:
    top, bottom, top_m, bottom_m = pair_by_brute_force(
        edge_probabilities["top"], edge_probabilities["bottom"]
    )
    left, right, left_m, right_m = pair_by_brute_force(
        edge_probabilities["left"], edge_probabilities["right"]
    )
    confidence = min(score_confidence_by_hand(m) for m in (top_m, bottom_m, left_m, right_m))
    return {"top": top, "bottom": bottom, "left": left, "right": right}, confidence


BOX = {"type": "box", "instructions": "the red square"}
NOUL = {"type": "noul", "instructions": "Was the customer charged twice?"}
CHOICE = {
    "type": "choice",
    "instructions": "Which queue should take this ticket?",
    "criteria": {"billing": "Billing handles it.", "tech": None, "sales": "Sales handles it."},
}


def test_a_box_beside_other_questions_equals_the_pair_rule_over_plain_forwards_of_its_edges(
    service, door, engine, tokenizer, codes
):
    answers, asked, decided = answered(service, door, {"n": NOUL, "where": BOX, "c": CHOICE})
    edges = asked[1]
    assert len(edges) == 4 and decided.outcome.timing is not None  # one shared batch for every row
    assert edges[0].text == (
        "Locate in the image: the red square\n"
        "How far down from the top of the image is the top edge of the smallest box around it "
        "(its highest point)? Each option is a percentage of the image's height, from 0% (its top) "
        "to 100% (its bottom)."
    )
    probabilities = {}
    for edge, question in zip(EDGES, edges, strict=True):
        descriptions = [o.description for o in question.options]
        logits, _, sha = plain_forward(engine, tokenizer, codes, STATE, question.text, descriptions)
        probabilities[edge] = by_hand(logits)
        reading = answers["where"].x_edges[edge]
        assert_close(list(reading.probabilities.values()), list(probabilities[edge]), TOL)
        assert list(reading.probabilities) == [f"{x:.2f}" for x in GRID]
        assert reading.x_semif.prompt_sha256 == sha and reading.x_semif.rows == 1
    box, confidence = expected_box(probabilities)
    got = answers["where"]
    assert got.type == "box"
    assert_close([getattr(got.box, e) for e in EDGES], [box[e] for e in EDGES], TOL)
    assert got.confidence == pytest.approx(confidence, abs=TOL)
    assert got.box.top < got.box.bottom and got.box.left < got.box.right
    # The questions around the box get the answers they get without it.
    alone, _, _ = answered(service, door, {"n": NOUL, "c": CHOICE})
    assert answers["n"].noul == pytest.approx(alone["n"].noul, abs=TOL)
    assert_close(list(answers["c"].probabilities.values()), list(alone["c"].probabilities.values()), TOL)


def test_each_edge_asked_in_reversal_is_the_log_mean_of_both_orders_plain_forwards(
    service, door, engine, tokenizer, codes
):
    answers, asked, _ = answered(service, door, {"where": {**BOX, "x_orderings": "reversal"}})
    probabilities = {}
    for edge, question in zip(EDGES, asked[0], strict=True):
        descriptions = [o.description for o in question.options]
        forward, _, _ = plain_forward(engine, tokenizer, codes, STATE, question.text, descriptions)
        backward, _, _ = plain_forward(engine, tokenizer, codes, STATE, question.text, descriptions[::-1])
        probabilities[edge] = by_hand(list((np.asarray(forward) + np.asarray(backward[::-1])) / 2))
        reading = answers["where"].x_edges[edge]
        assert reading.x_semif.rows == 2 and reading.x_semif.orderings == "reversal"
        assert_close(list(reading.probabilities.values()), list(probabilities[edge]), TOL)
    box, confidence = expected_box(probabilities)
    got = answers["where"]
    assert_close([getattr(got.box, e) for e in EDGES], [box[e] for e in EDGES], TOL)
    assert got.confidence == pytest.approx(confidence, abs=TOL)


def test_a_workload_temperature_applies_to_each_edge_before_the_pair_rule(engine, checkpoint, tmp_path):
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"boxes": 2.0}))
    service = Service.start(make_settings(checkpoint, calibration=calibration), engine=engine)
    answers, _, _ = answered(service, SystemOneDoor(service), {"where": {**BOX, "x_workload": "boxes"}})
    probabilities = {}
    for edge in EDGES:
        reading = answers["where"].x_edges[edge]
        assert (reading.x_semif.workload, reading.x_semif.temperature) == ("boxes", 2.0)
        probabilities[edge] = by_hand([v / 2.0 for v in reading.x_semif.option_logits.values()])
        assert_close(list(reading.probabilities.values()), list(probabilities[edge]), 1e-9)
    box, confidence = expected_box(probabilities)
    got = answers["where"]
    assert_close([getattr(got.box, e) for e in EDGES], [box[e] for e in EDGES], 1e-9)
    assert got.confidence == pytest.approx(confidence, abs=1e-9)


def test_a_box_is_four_rows_of_the_batch_and_its_prefix_counts_once_in_usage(service, door):
    _, _, decided = answered(service, door, {"where": BOX})
    outcome = decided.outcome
    assert outcome.timing is not None and outcome.timing.batch_size == 4
    rows = [r for q in outcome.questions for r in q.readouts]
    shared = outcome.timing.prefix_tokens
    evaluated = shared + sum(r.input_tokens - shared for r in rows)
    assert evaluated_tokens(outcome) == evaluated
    assert usage_of(decided).input_tokens == evaluated


def test_the_official_sdk_parses_a_reply_holding_a_box_answer(service, door):
    from typesafe_sdk import BoxAnswer as SdkBoxAnswer
    from typesafe_sdk._core.response_types import SystemOneResponse as SdkResponse

    answers, _, decided = answered(service, door, {"where": BOX, "n": NOUL})
    reply = SystemOneResponse(
        model=door.model_name,
        answers=answers,
        usage=usage_of(decided),
        x_timing=timing_block(decided),
    )
    parsed = SdkResponse.model_validate_json(reply.model_dump_json())
    box = parsed.boxes["where"]
    assert isinstance(box, SdkBoxAnswer)
    ours = answers["where"]
    assert (box.box.top, box.box.bottom, box.box.left, box.box.right) == (
        ours.box.top,
        ours.box.bottom,
        ours.box.left,
        ours.box.right,
    )
    assert box.confidence == ours.confidence and 0.0 <= box.confidence <= 1.0
    assert set(parsed.nouls) == {"n"}


# -- over HTTP: what a box question gets before the engine reads images -----------------------------


@pytest.fixture(scope="module")
def app(service):
    return create_app(service)


def post(app, questions: dict):
    return call(
        app, "POST", "/v1/systemone", json={"model": "jev-latest", "state": "text", "questions": questions}
    )


def test_a_request_of_sixty_five_boxes_passes_the_row_cap_of_256_before_it_is_validated(app):
    reply = post(app, {f"b{i}": BOX for i in range(65)})  # 65 x 4 edges = 260 rows
    assert reply.status_code == 413, reply.text
    assert reply.json()["detail"]["error_type"] == "request_too_large"
    assert "260 rows" in reply.json()["detail"]["message"]


def test_sixty_four_boxes_fit_the_row_cap_and_reach_the_no_image_refusal(app):
    reply = post(app, {f"b{i}": BOX for i in range(64)})  # exactly 256 rows
    assert reply.status_code == 422, reply.text
    assert reply.json()["detail"][0]["loc"] == ["body", "questions", "b0"]


def test_a_box_in_reversal_counts_eight_rows_against_the_cap(app):
    reply = post(app, {f"b{i}": {**BOX, "x_orderings": "reversal"} for i in range(33)})  # 264 rows
    assert reply.status_code == 413 and "264 rows" in reply.json()["detail"]["message"]


@pytest.mark.parametrize("orderings", ["rotations", "shifts", "all"])
def test_a_box_asked_in_an_ordering_that_breaks_the_positions_order_is_refused(app, orderings):
    reply = post(app, {"where": {**BOX, "x_orderings": orderings}})
    assert reply.status_code == 422, reply.text
    (item,) = reply.json()["detail"]
    assert item["loc"] == ["body", "questions", "where", "box"]
    assert "not allowed for a box" in item["msg"]


def test_the_published_schema_declares_the_box_answer(app):
    schema = call(app, "GET", "/openapi.json").json()
    components = schema["components"]["schemas"]
    answers = components["SystemOneResponse"]["properties"]["answers"]["additionalProperties"]
    assert {"$ref": "#/components/schemas/BoxAnswer"} in answers["anyOf"]
    box = components["BoxAnswer"]
    assert set(box["required"]) == {"type", "box", "confidence", "x_edges"}
    assert set(components["BoxCoordinates"]["required"]) == {"top", "bottom", "left", "right"}
    assert {"type": "null"} in box["properties"]["confidence"]["anyOf"]


def test_probabilities_in_a_box_answer_are_distributions(service, door):
    answers, _, _ = answered(service, door, {"where": BOX})
    for reading in answers["where"].x_edges.values():
        assert all(0.0 <= p <= 1.0 for p in reading.probabilities.values())
        # The edge's own reading is SemIf's float32 softmax over 21 slots; the pair rule's is float64.
        assert math.fsum(reading.probabilities.values()) == pytest.approx(1.0, abs=1e-6)
        assert all(0.0 <= p <= 1.0 for p in reading.ordered.values())
        assert math.fsum(reading.ordered.values()) == pytest.approx(1.0, abs=1e-12)
