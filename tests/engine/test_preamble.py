"""The preamble: the ids every SemIf prompt starts with (the system turn and the user turn up to its
state), stored once per model and continued by every prompt the engine would otherwise compute
from position 0, so a new state costs only its own tokens. Every answer is compared with the same
request answered whole (SemIf's plain forward of its prompt, or the service at
`SEMIF_DIRECT_PATH=plain` for an adapter), within 1e-5 in float32; which segments each forward
computed is read from the packed forward's own arguments."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from semif_serve.app import create_app
from semif_serve.domain.prompt import USER_OPENING
from semif_serve.domain.requests import BASE
from semif_serve.domain.types import PromptRow
from semif_serve.engine.state_cache import STATE
from semif_serve.service.startup import Service
from tests.engine.test_reuse import OPTIONS, assert_plain, decide_body, long_state
from tests.support import TOKEN, make_settings
from tests.support.served_models import SERVED, native_decision, serving

AUTH = {"Authorization": f"Bearer {TOKEN}"}
TOL = 1e-5
DESCRIPTIONS = [o["description"] for o in OPTIONS]
STATES = [
    "The deploy finished.",
    " leading space",
    {"ticket": 7, "tags": ["a", "b"]},
    [1, 2.5, None],
    12,
    "",
    "Zo\u00eb \u6570\u5b57 \U0001f600",
    '{"evidence": "nested"}',
]


def post(service: Service, path: str, body: dict) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=create_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
            return await c.post(path, json=body, headers=AUTH)

    return asyncio.run(go())


def lone_question(service: Service, state, question: str, forwards: list[list]):
    """Ask one question over `state` on `/decide`, check it against the plain forward of its
    prompt, and return the segment its one forward computed."""
    forwards.clear()
    reply = post(service, "/decide", decide_body(state, question))
    assert reply.status_code == 200, reply.text
    assert_plain(reply.json(), service.engine, state, question, DESCRIPTIONS)
    [segments] = forwards
    [segment] = segments
    return segment


@pytest.mark.parametrize("state", STATES, ids=range(len(STATES)))
def test_every_prompt_starts_with_the_preamble_which_ends_before_its_state(engine, state):
    codec = engine.codec
    preamble = codec.preamble
    assert len(preamble) > 10
    for question, descriptions in (("Did it?", ("Yes.", "No.")), ("'s \u00e9 1", (" a", '"b"', "c"))):
        prompt = codec.encode_prompts(state, [PromptRow(question, descriptions)], 4096)[0]
        assert tuple(prompt.ids[: len(preamble)]) == preamble
        before_state = prompt.text[: prompt.user_offset + len(USER_OPENING)]
        decoded = codec.tokenizer.decode(list(preamble))
        assert before_state.startswith(decoded) and json.dumps(state, ensure_ascii=False) not in decoded


def test_a_lone_question_over_a_new_state_computes_only_its_tokens_past_the_stored_preamble(
    engine, checkpoint, forwards
):
    service = Service.start(make_settings(checkpoint), engine=engine)
    preamble = engine.codec.preamble
    stored = service.engine.cache.peek(preamble, STATE)
    assert stored is not None and stored.is_preamble  # the warm-up's lone question kept it
    before = service.engine.cache.stats()
    state = "The nightly backup of the billing database failed at 02:14 with a full disk."

    segment = lone_question(service, state, "Did the backup succeed?", forwards)

    prompt = engine.codec.encode_prompt(state, "Did the backup succeed?", tuple(DESCRIPTIONS), 4096)
    assert segment.start is stored and segment.ids == tuple(prompt.ids[len(preamble) :])
    after = service.engine.cache.stats()  # the preamble is no request's state: no hit, no miss
    assert (after.hits, after.misses, after.entries) == (before.hits, before.misses, before.entries)


def test_the_first_forward_keeps_the_preamble_and_rows_of_new_states_continue_it_in_that_forward(
    engine, checkpoint, forwards
):
    service = Service.start(make_settings(checkpoint), engine=engine)
    preamble = engine.codec.preamble
    service.engine.cache.clear()  # as after memory pressure: nothing stored
    forwards.clear()

    state = "Queue depth rose to 9,000 after the 14:00 release."
    reply = post(service, "/decide", decide_body(state, "Is the queue healthy?"))

    assert reply.status_code == 200
    assert_plain(reply.json(), engine, state, "Is the queue healthy?", DESCRIPTIONS)
    [segments] = forwards
    first, row = segments
    assert first.ids == preamble and first.keep and first.start is None and first.parent is None
    assert row.parent == 0 and row.read
    stored = service.engine.cache.peek(preamble, STATE)
    assert stored is not None and stored.is_preamble


def test_a_new_state_shared_by_several_questions_is_prefilled_fresh_from_the_preamble_and_kept(
    engine, checkpoint, forwards
):
    service = Service.start(make_settings(checkpoint), engine=engine)
    preamble = engine.codec.preamble
    stored = service.engine.cache.peek(preamble, STATE)
    forwards.clear()
    state = long_state("shared")
    questions = ["Did it succeed?", "Was it rolled back?"]
    decisions = [{"id": str(n), "question": q, "options": OPTIONS} for n, q in enumerate(questions)]

    reply = post(service, "/decide/shared", {"state": state, "decisions": decisions})

    assert reply.status_code == 200, reply.text
    assert reply.json()["timing"]["prefill"] == "fresh"  # a new state, whatever the preamble saved
    for question, result in zip(questions, reply.json()["results"], strict=True):
        assert_plain(result, engine, state, question, DESCRIPTIONS)
    [segments] = forwards
    kept = segments[0]  # the state, kept; then what its questions share, then the rows
    assert kept.keep and all(s.parent is not None for s in segments[1:])
    prompt = engine.codec.encode_prompt(state, questions[0], tuple(DESCRIPTIONS), 4096)
    assert kept.start is stored and kept.ids == tuple(
        prompt.ids[len(preamble) : len(preamble) + len(kept.ids)]
    )
    assert service.engine.cache.peek(preamble, STATE) is stored


def test_at_the_plain_direct_path_a_lone_question_runs_its_whole_prompt(engine, checkpoint, forwards):
    service = Service.start(make_settings(checkpoint, direct_path="plain"), engine=engine)
    state = "The canary passed every check."

    segment = lone_question(service, state, "Did the canary pass?", forwards)

    prompt = engine.codec.encode_prompt(state, "Did the canary pass?", tuple(DESCRIPTIONS), 4096)
    assert segment.start is None and segment.parent is None and segment.ids == tuple(prompt.ids)


def test_a_cache_too_small_for_the_preamble_refuses_it_once_and_is_never_asked_again(
    engine, checkpoint, forwards
):
    service = Service.start(make_settings(checkpoint, state_cache_mib=0), engine=engine)
    refused = service.engine.cache.stats().refused
    for n in range(3):
        segment = lone_question(service, f"Deploy {n} finished.", "Did it finish?", forwards)
        assert segment.start is None and segment.parent is None  # the whole prompt, as one segment
    assert service.engine.cache.stats().refused == refused


SEMIF_MODELS = [s for s in SERVED if native_decision(s, "x") is not None and s.method == "semif"]


@pytest.mark.parametrize("served", SEMIF_MODELS, ids=[s.id for s in SEMIF_MODELS])
def test_each_model_reads_a_new_state_from_its_own_preamble_as_its_whole_prompt_reads(
    engine, checkpoint, served_models, served, forwards
):
    state = "Invoice 4411 was charged twice on the 3rd of March."
    body = native_decision(served, state)
    answers = {}
    for path in ("plain", "reuse"):
        with serving(engine, checkpoint, served_models, direct_path=path) as service:
            post(service, "/decide", native_decision(served, "An earlier ticket."))  # its preamble kept
            forwards.clear()
            reply = post(service, "/decide", body)
            assert reply.status_code == 200, reply.text
            answers[path] = reply.json()
            starts = [s.start for s in forwards[-1]]
    assert starts[0] is not None and starts[0].is_preamble
    assert (starts[0].adapter != BASE) == served.adapter
    reuse, plain = answers["reuse"], answers["plain"]
    assert max(abs(a - b) for a, b in zip(reuse["option_logits"], plain["option_logits"], strict=True)) <= TOL
    assert reuse["prompt_sha256"] == plain["prompt_sha256"] and reuse["input_tokens"] == plain["input_tokens"]


def test_a_state_with_an_image_continues_the_text_preamble_and_equals_the_full_forward(
    vision_service, vision_reference, forwards
):
    from tests.doors.test_systemone_vision import (
        CHOICE,
        PHOTO,
        assert_answers_match,
        expected_answers,
        request_body,
    )
    from tests.support.vision_reference import noise_png

    images = {PHOTO: noise_png(33)}
    question = {**CHOICE, "x_orderings": "none"}  # one row: a lone question, from position 0
    body = request_body({"photo": PHOTO, "caption": "a shelf"}, {"c": question}, images)
    forwards.clear()

    reply = post(vision_service, "/v1/systemone", body)

    assert reply.status_code == 200, reply.text
    assert_answers_match(reply.json(), expected_answers(vision_service, body, images, vision_reference))
    preamble = vision_service.engine.codec.preamble
    [segments] = forwards
    assert segments[0].start is not None and segments[0].start.ids == preamble
    assert any(t < 0 for t in segments[0].ids)  # the image's tokens come after the preamble
