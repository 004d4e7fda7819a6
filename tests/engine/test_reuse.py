"""A lone question at the plain forward's cost, follow-ups from the cache, on every door.

Every answer is compared with an independent computation: SemIf's plain forward of the same
prompt (`model(input_ids=prompt, use_cache=False, logits_to_keep=1).logits[0, -1]`), within 1e-5 in float32,
with the same `prompt_sha256` and `input_tokens`.
"""

from __future__ import annotations

import asyncio
import hashlib

import httpx
import pytest
import torch

from semif_serve.app import create_app
from semif_serve.domain.requests import Limits, RowsRequest
from semif_serve.domain.types import PromptRow
from semif_serve.engine.batching import UNFINISHED, Group, Job
from semif_serve.engine.forwards import prefill
from semif_serve.engine.lone import DIRECT_MAX_TOKENS, ReturnVisits
from semif_serve.engine.runner import DIRECT_READOUT
from semif_serve.engine.state_cache import QUESTION, STATE, StateCache, state_digest
from semif_serve.service.startup import Service
from tests.engine.test_merging import EngineGate
from tests.support import TOKEN, asking, make_settings
from tests.support.polling import wait_until_async

AUTH = {"Authorization": f"Bearer {TOKEN}"}
TOL = 1e-5
OPTIONS = [{"id": "yes", "description": "It succeeded."}, {"id": "no", "description": "It failed."}]


def long_state(tag: str) -> str:
    return " ".join(f"{tag}: deploy {i} finished in zone {i % 3}." for i in range(40))


def plain_forward(engine, state, question: str, descriptions) -> tuple[list[float], str, int]:
    """SemIf's plain forward of the rendered prompt: slot logits, prompt sha256, input tokens."""
    prompt = engine.codec.encode_prompt(state, question, tuple(descriptions), 4096)
    with torch.inference_mode():
        logits = (
            engine.model(input_ids=torch.tensor([prompt.ids]), use_cache=False, logits_to_keep=1)
            .logits[0, -1]
            .float()
        )
    slots = logits[torch.tensor(engine.codec.slots[: len(descriptions)])].tolist()
    return slots, hashlib.sha256(prompt.text.encode()).hexdigest(), len(prompt.ids)


def assert_plain(result: dict, engine, state, question: str, descriptions) -> None:
    logits, sha, tokens = plain_forward(engine, state, question, descriptions)
    assert max(abs(a - b) for a, b in zip(result["option_logits"], logits, strict=True)) <= TOL
    assert result["prompt_sha256"] == sha and result["input_tokens"] == tokens


def decide_body(state, question: str) -> dict:
    return {"id": "d", "state": state, "question": question, "options": OPTIONS}


@pytest.fixture
def fresh(engine, checkpoint) -> Service:
    """A service whose lone questions keep states of 64 tokens and more (`long_state` is one)."""
    return Service.start(make_settings(checkpoint, keep_state_tokens=64), engine=engine)


@pytest.fixture
def short_kept(engine, checkpoint) -> Service:
    """A service for which `long_state` is too short to keep (the default threshold)."""
    service = Service.start(make_settings(checkpoint), engine=engine)
    assert len(engine.codec.encode(long_state("x"))) < service.settings.keep_state_tokens
    return service


def client_of(service: Service) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(service)), base_url="http://t")


def test_a_second_decide_about_a_state_skips_its_prefill_and_both_equal_the_plain_forward(fresh, engine):
    state = long_state("second")
    base = fresh.engine.cache.stats().by_kind[STATE]  # the warm-up stored its own state

    async def go():
        async with client_of(fresh) as c:
            first = await c.post("/decide", json=decide_body(state, "Did it succeed?"), headers=AUTH)
            after_first = (await c.get("/health")).json()["state_cache"]
            second = await c.post("/decide", json=decide_body(state, "Was it rolled back?"), headers=AUTH)
            return first, after_first, second, (await c.get("/health")).json()["state_cache"]

    first, after_first, second, after_second = asyncio.run(go())
    assert first.status_code == second.status_code == 200
    # The first's own pass ended at the state and stored it (one miss), then went on to its question;
    # the second, sent as soon as the first answer arrived, found it.
    one, two = after_first["by_kind"][STATE], after_second["by_kind"][STATE]
    assert one["misses"] == base.misses + 1 and one["entries"] == base.entries + 1
    assert two["hits"] == one["hits"] + 1 and two["misses"] == base.misses + 1
    descriptions = [o["description"] for o in OPTIONS]
    assert_plain(first.json(), engine, state, "Did it succeed?", descriptions)
    assert_plain(second.json(), engine, state, "Was it rolled back?", descriptions)
    for reply in (first.json(), second.json()):  # /decide's reply is the same whichever way it ran
        assert reply["readout"] == DIRECT_READOUT and "timing" not in reply
        assert "serving_config" not in reply["model"]


def test_eight_concurrent_decides_about_one_new_state_share_one_prefill_and_each_equals_the_plain_forward(
    fresh, engine
):
    state = long_state("eight")
    questions = [f"Did step {i} of the rollout succeed?" for i in range(8)]

    async def go():
        gate = EngineGate()
        gate.bind(fresh)
        held = asyncio.create_task(fresh.worker.batcher.submit(Job("gate", None, 0, (1,), payload=gate)))
        await asyncio.to_thread(gate.started.wait, 30)
        async with client_of(fresh) as c:
            calls = [
                asyncio.create_task(c.post("/decide", json=decide_body(state, q), headers=AUTH))
                for q in questions
            ]
            await wait_until_async(
                lambda: fresh.worker.batcher.queued >= len(calls), timeout=60, what="every call in the queue"
            )
            gate.opened.set()
            await held
            return await asyncio.gather(*calls)

    before = fresh.engine.cache.stats().by_kind[STATE]
    replies = asyncio.run(go())
    after = fresh.engine.cache.stats().by_kind[STATE]
    assert after.misses - before.misses == 1 and after.entries == before.entries + 1  # one prefill, kept
    for q, reply in zip(questions, replies, strict=True):
        assert reply.status_code == 200
        assert_plain(reply.json(), engine, state, q, [o["description"] for o in OPTIONS])


def test_a_lone_question_whose_short_state_another_request_in_flight_wants_prefills_and_keeps_it(short_kept):
    state = long_state("wanted")
    service = short_kept
    base = service.engine.cache.stats().by_kind[STATE]
    service.engine.cache.demand.enter(state_digest(state))  # another request about it, still encoding
    try:
        asyncio.run(asking.outcome(service, state, [_question()], Limits(**LIMITS)))
    finally:
        service.engine.cache.demand.leave(state_digest(state))
    stats = service.engine.cache.stats().by_kind[STATE]
    # Looked up and prefilled on its own path (the plain path never looks up), for the other to join.
    assert stats.misses == base.misses + 1 and stats.entries == base.entries + 1


def test_a_lone_question_over_a_short_state_runs_the_plain_forward_and_keeps_nothing(short_kept, engine):
    state = long_state("short")
    base = short_kept.engine.cache.stats()
    outcome = asyncio.run(asking.outcome(short_kept, state, [_question()], Limits(**LIMITS)))
    assert not outcome.shared and outcome.timing.prefill == "none"
    _assert_plain_outcome(outcome, engine, state, "Did it succeed?")
    stats = short_kept.engine.cache.stats()
    assert (stats.hits, stats.misses, stats.entries) == (base.hits, base.misses, base.entries)
    assert len(short_kept.engine.lone.visits) >= 1  # remembered by its key alone


def test_a_client_coming_back_to_a_short_state_keeps_it_the_second_time_and_reads_the_third_from_the_cache(
    short_kept, engine
):
    state = long_state("comes-back")
    base = short_kept.engine.cache.stats().by_kind[STATE]
    texts = ("Did it succeed?", "Was it rolled back?", "Did it page anyone?")
    outcomes = [
        asyncio.run(asking.outcome(short_kept, state, [_question(t)], Limits(**LIMITS))) for t in texts
    ]
    assert [o.timing.prefill for o in outcomes] == ["none", "fresh", "cached"]
    after = short_kept.engine.cache.stats().by_kind[STATE]
    assert (after.misses, after.hits, after.entries) == (base.misses + 1, base.hits + 1, base.entries + 1)
    for outcome, text in zip(outcomes, texts, strict=True):
        _assert_plain_outcome(outcome, engine, state, text)


def test_the_remembered_states_are_bounded_and_forgotten_after_their_window():
    clock = [0.0]
    visits = ReturnVisits(capacity=3, window=10.0, clock=lambda: clock[0])
    assert [visits.returned(k) for k in "abcd"] == [False] * 4
    assert len(visits) == 3  # "a", the oldest, is forgotten
    assert not visits.returned("a") and visits.returned("d")
    clock[0] = 11.0
    assert not visits.returned("c")  # seen 11 s ago: past the window, remembered afresh
    assert visits.returned("c")


def _assert_plain_outcome(outcome, engine, state, text: str) -> None:
    logits, sha, tokens = plain_forward(engine, state, text, [o["description"] for o in OPTIONS])
    readout = outcome.questions[0].readouts[0]
    assert max(abs(a - b) for a, b in zip(readout.option_logits, logits, strict=True)) <= TOL
    assert (readout.prompt_sha256, readout.input_tokens) == (sha, tokens)


LIMITS = dict(max_input_tokens=4096, max_options=16, max_rows=64)


def _question(text: str = "Did it succeed?"):
    from semif_serve.domain.types import Option, Question

    return Question("q", text, tuple(Option(o["id"], o["description"]) for o in OPTIONS))


def test_a_lone_row_over_a_long_state_stores_it_by_its_own_pass_equal_to_a_fresh_prefill(engine):
    cached = engine.with_options(cache=StateCache(1 << 30), prefill_chunk_tokens=None, keep_state_tokens=64)
    state = long_state("own")
    row = PromptRow("Did it succeed?", ("It succeeded.", "It failed."))

    readout = cached.read(RowsRequest.of(state, [row], shared=False, max_input_tokens=4096))

    assert readout.timing.prefill == "fresh"
    ids = cached.prepare(RowsRequest.of(state, [row], shared=False, max_input_tokens=4096)).state_ids
    assert len(ids) >= 64
    stored = cached.cache.get(ids)
    assert stored is not None and cached.cache.peek(cached.codec.preamble) is not None
    assert cached.cache.stats().by_kind[STATE].entries == 2  # the state, and the preamble it continued
    reference = StateCache(1 << 30).put(ids, prefill(engine.model, ids))
    for got, want in zip(stored.tensors(), reference.tensors(), strict=True):
        assert (got - want).abs().max().item() <= TOL
    logits, sha, tokens = plain_forward(engine, state, row.question, row.descriptions)
    for answer in (readout, cached.read(RowsRequest.of(state, [row], shared=False, max_input_tokens=4096))):
        got = answer.rows[0]
        assert max(abs(a - b) for a, b in zip(got.option_logits, logits, strict=True)) <= TOL
        assert (got.prompt_sha256, got.input_tokens) == (sha, tokens)
    assert cached.cache.stats().by_kind[STATE].hits == 2  # the lookup above and the follow-up


def test_system_one_asks_a_lone_question_like_decide_and_serves_its_follow_up_from_the_cache(fresh, engine):
    state = long_state("s1")
    noul = {"type": "noul", "instructions": "Did the rollout succeed?", "x_orderings": "none"}

    async def go():
        async with client_of(fresh) as c:
            body = {"model": "jev-latest", "state": state, "questions": {"a": noul}}
            first = await c.post("/v1/systemone", json=body, headers=AUTH)
            second = await c.post("/v1/systemone", json=body, headers=AUTH)
            return first, second

    base = fresh.engine.cache.stats().by_kind[STATE]
    first, second = asyncio.run(go())
    stats = fresh.engine.cache.stats().by_kind[STATE]
    assert stats.misses == base.misses + 1 and stats.hits == base.hits + 1  # kept by the first, at once
    descriptions = ["Yes, it is true.", "No, it is false."]
    logits, sha, tokens = plain_forward(engine, state, "Did the rollout succeed?", descriptions)
    for reply in (first.json(), second.json()):
        semif = reply["answers"]["a"]["x_semif"]
        assert max(abs(a - b) for a, b in zip(semif["option_logits"].values(), logits, strict=True)) <= TOL
        assert semif["prompt_sha256"] == sha and semif["input_tokens"] == tokens
        assert reply["usage"]["input_tokens"] == tokens


def test_a_lone_question_over_a_state_past_the_direct_bound_is_prefilled_in_chunks_not_one_forward(
    fresh, engine
):
    # About 4,500 tokens: past the direct bound (4,096), and no longer than that needs.
    state = " ".join(f"line {i}: zone {i % 7} healthy." for i in range(420))
    assert len(engine.codec.encode(state)) > DIRECT_MAX_TOKENS
    noul = {"type": "noul", "instructions": "Did the rollout succeed?", "x_orderings": "none"}

    async def go():
        async with client_of(fresh) as c:
            body = {"model": "jev-latest", "state": state, "questions": {"a": noul}}
            return await c.post("/v1/systemone", json=body, headers=AUTH)

    reply = asyncio.run(go()).json()
    assert reply["x_timing"]["prefill"] == "fresh"  # over its state, prefilled in chunks and kept
    semif = reply["answers"]["a"]["x_semif"]
    prompt = engine.codec.encode_prompt(
        state, "Did the rollout succeed?", ("Yes, it is true.", "No, it is false."), 32768
    )
    with torch.inference_mode():
        logits = (
            engine.model(input_ids=torch.tensor([prompt.ids]), use_cache=False, logits_to_keep=1)
            .logits[0, -1]
            .float()
        )
    plain = logits[torch.tensor(engine.codec.slots[:2])].tolist()
    assert max(abs(a - b) for a, b in zip(semif["option_logits"].values(), plain, strict=True)) <= TOL
    assert semif["input_tokens"] == len(prompt.ids)


def test_the_plain_direct_path_setting_never_touches_the_cache(engine, checkpoint):
    service = Service.start(make_settings(checkpoint, direct_path="plain"), engine=engine)
    state = long_state("plain")
    base = service.engine.cache.stats()
    for _ in range(2):
        outcome = asyncio.run(asking.outcome(service, state, [_question()], Limits(**LIMITS)))
    stats = service.engine.cache.stats()
    assert (stats.hits, stats.misses, stats.entries) == (base.hits, base.misses, base.entries)
    logits, _, _ = plain_forward(engine, state, "Did it succeed?", [o["description"] for o in OPTIONS])
    assert outcome.questions[0].readouts[0].option_logits == pytest.approx(logits, abs=TOL)


def test_question_prefixes_live_in_a_lower_tier_that_never_evicts_a_state():
    from tests.engine.test_state_cache import fake_state

    cache = StateCache(budget_bytes=1000)
    cache.put([1], fake_state(400), STATE)
    cache.put([1, 9], fake_state(400), QUESTION)
    cache.put([2], fake_state(400), STATE)  # evicts the question prefix, not the older state
    assert cache.has([1]) and cache.has([2]) and not cache.has([1, 9], QUESTION)
    cache.put([2, 9], fake_state(400), QUESTION)  # no room beside two states: never stored
    assert cache.stats().refused == 1 and cache.has([1]) and cache.has([2])
    assert cache.get([1, 9], QUESTION) is None and cache.get([1]) is not None
    kinds = cache.stats().by_kind
    assert (kinds[STATE].hits, kinds[QUESTION].misses, kinds[STATE].entries, kinds[QUESTION].entries) == (
        1,
        1,
        2,
        0,
    )


def test_states_asked_questions_in_turn_under_a_budget_of_those_states_all_stay_cached(engine):
    # The case: each request with orderings also covers its question, which almost
    # nothing reuses; under a budget of the states alone, the states must survive it.
    states = [long_state(f"turn{i}") for i in range(3)]
    row = PromptRow("Did it succeed?", ("It succeeded.", "It failed.", "Unclear."))
    sizes = []
    for state in states:
        probe = engine.with_options(cache=StateCache(1 << 30), prefill_chunk_tokens=None)
        probe.read(
            RowsRequest.of(state, [row], shared=True, max_input_tokens=4096)
        )  # one row: the state prefix alone
        sizes.append(probe.cache.stats().bytes)
    turned = engine.with_options(
        cache=StateCache(3 * max(sizes) + max(sizes) // 2), prefill_chunk_tokens=None
    )

    def rotations(n: int) -> list[PromptRow]:
        opts = [f"Option {k} of question {n}." for k in range(3)]
        return [PromptRow(f"Which option fits question {n}?", tuple(opts[k:] + opts[:k])) for k in range(3)]

    readouts = []
    for n in range(3):
        for state in states:
            readouts.append(
                turned.read(RowsRequest.of(state, rotations(n), shared=False, max_input_tokens=4096))
            )
    stats = turned.cache.stats().by_kind[STATE]
    assert stats.hits == 6 and stats.misses == 3  # every question after a state's first found it
    assert [r.timing.prefill for r in readouts] == ["fresh"] * 3 + ["extended"] * 6
    last = rotations(2)[0]
    logits, sha, tokens = plain_forward(turned, states[2], last.question, last.descriptions)
    assert readouts[-1].rows[0].option_logits == pytest.approx(logits, abs=TOL)
    assert (readouts[-1].rows[0].prompt_sha256, readouts[-1].rows[0].input_tokens) == (sha, tokens)


def test_a_lone_question_about_a_state_being_prefilled_in_steps_joins_that_prefill(engine, monkeypatch):
    from semif_serve.engine.runner import _whole

    stepping = engine.with_options(cache=StateCache(64 << 20), prefill_chunk_tokens=16, keep_state_tokens=64)
    state = long_state("joined")
    texts = ("Did it succeed?", "Was it rolled back?")
    prepared = [
        stepping.prepare(
            RowsRequest.of(
                state, [PromptRow(t, ("It succeeded.", "It failed."))], shared=False, max_input_tokens=4096
            )
        )
        for t in texts
    ]
    groups = []
    for i, p in enumerate(prepared):
        job = p.job(i)
        groups.append(Group(job.prefix_key, job.prefix_tokens, (_whole(job),)))
    fed: list[int] = []
    decoder = engine.model.get_decoder()
    real = type(decoder).forward

    def counting(self, *args, **kwargs):
        fed.append(
            (
                kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]
            ).shape[1]
        )
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(decoder), "forward", counting)
    from semif_serve.engine.lanes import ForwardLanes

    packed = ForwardLanes.forward

    def packed_counting(self, model, segments, adapters=None):
        fed.append(sum(len(s.ids) for s in segments))
        return packed(self, model, segments, adapters)

    monkeypatch.setattr(ForwardLanes, "forward", packed_counting)
    results: dict[int, list] = {}
    first = stepping.run_group(groups[0])  # the first request's first step; the second arrives now
    assert first is UNFINISHED
    while len(results) < 2:  # the two take turns, as the batcher's rounds do
        for i, group in enumerate(groups):
            if i not in results and (out := stepping.run_group(group)) is not UNFINISHED:
                results[i] = out[i]
    monkeypatch.undo()
    n_state = len(prepared[0].state_ids)
    suffixes = sum(len(p.prompts[0].ids) - n_state for p in prepared)
    assert 0 < sum(fed) <= n_state + suffixes  # every state token prefilled once: the second joined
    for text, p, i in zip(texts, prepared, range(2), strict=True):
        logits, sha, tokens = plain_forward(engine, state, text, ["It succeeded.", "It failed."])
        row = stepping.readout(p, results[i]).rows[0]
        assert max(abs(a - b) for a, b in zip(row.option_logits, logits, strict=True)) <= TOL
        assert (row.prompt_sha256, row.input_tokens) == (sha, tokens)
