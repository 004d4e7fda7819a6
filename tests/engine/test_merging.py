"""Cross-request batching and the state cache inside the service, on the real tiny Qwen3.5.

Every merged or cached answer is compared with the same request run alone on an engine with
no state cache (a fresh prefill, or SemIf's plain forward), within 1e-5 in float32.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from semif_serve.app import create_app
from semif_serve.domain.numerics import MIB
from semif_serve.domain.requests import Limits, RowsRequest
from semif_serve.domain.types import Option, OutOfMemory, PromptRow, Question, TooLargeForMemory
from semif_serve.engine.batching import Bounds, Job, plan_groups
from semif_serve.engine.forwards import prefill
from semif_serve.engine.memory import ReleasePolicy
from semif_serve.engine.runner import TorchEngine
from semif_serve.engine.state_cache import StateCache
from semif_serve.service.startup import Service
from tests.support import TOKEN, asking, make_settings
from tests.support.memory_sim import SimulatedMemory, cuda_oom
from tests.support.polling import wait_until_async

AUTH = {"Authorization": f"Bearer {TOKEN}"}
LIMITS = dict(max_input_tokens=4096, max_options=16, max_rows=64)
STATE = {"service": "checkout", "events": [f"deploy {i} finished in zone {i % 3}" for i in range(12)]}


def question(n: int, orderings=None) -> Question:
    options = tuple(Option(f"o{k}", f"Option {k} for question {n}.") for k in range(3))
    return Question(f"q{n}", f"Which option fits question number {n}?", options, orderings)


def uncached(engine: TorchEngine) -> TorchEngine:
    """The same weights with no state cache: every shared request prefills from scratch."""
    return engine.with_options(cache=StateCache(0), prefill_chunk_tokens=None)


def alone(engine: TorchEngine, state, q: Question, shared: bool):
    rows = [PromptRow(q.text, tuple(o.description for o in q.options))]
    return uncached(engine).read(RowsRequest.of(state, rows, shared=shared, max_input_tokens=4096)).rows[0]


def assert_close(got, want, tol=1e-5) -> None:
    assert len(got) == len(want)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= tol


class EngineGate:
    """Holds the engine thread inside the batcher (as a long forward would) until opened."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.opened = threading.Event()

    def run_group(self, group):
        self.started.set()
        self.opened.wait(30)
        return {p.job.id: [None] for p in group.parts}

    def bind(self, service: Service) -> None:
        """Run the gate's job on the engine thread in place of the engine (every other job as before)."""
        batcher = service.worker.batcher
        real = batcher.run_groups

        def run_groups(groups):
            if groups[0].job_ids == ("gate",):  # the gate runs alone: the engine was idle when it came
                return [self.run_group(group) for group in groups]
            return real(groups)

        batcher.run_groups = run_groups

    async def hold(self, service: Service) -> asyncio.Task:
        self.bind(service)
        held = asyncio.create_task(service.worker.batcher.submit(Job("gate", None, 0, (1,), payload=self)))
        await asyncio.to_thread(self.started.wait, 30)
        return held


async def held_burst(service: Service, calls):
    """Hold the engine thread, queue every call, then free it: the calls meet in one take."""
    gate = EngineGate()
    held = await gate.hold(service)
    tasks = [asyncio.create_task(call()) for call in calls]
    await wait_until_async(
        lambda: service.worker.batcher.queued >= len(tasks), timeout=60, what="every call queued"
    )
    gate.opened.set()
    await held
    return await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture
def fresh(engine, checkpoint) -> Service:
    """A service of its own (its own cache and counters) over the shared weights."""
    return Service.start(make_settings(checkpoint), engine=engine)


def test_distinct_direct_decisions_queued_together_run_in_one_forward_and_equal_the_plain_forward(
    fresh, engine
):
    states = [f"Deployment {i} passed its health checks." for i in range(4)]
    before = fresh.worker.batcher.stats()

    outcomes = asyncio.run(
        held_burst(
            fresh,
            [
                lambda s=s, i=i: asking.outcome(fresh, s, [question(i)], Limits(**LIMITS))
                for i, s in enumerate(states)
            ],
        )
    )

    after = fresh.worker.batcher.stats()
    assert after.forwards - before.forwards == 2  # the gate's, then one for the four requests
    assert after.merged_forwards - before.merged_forwards == 1
    for i, (state, outcome) in enumerate(zip(states, outcomes, strict=True)):
        assert outcome.shared is False
        got = outcome.questions[0].readouts[0]
        assert_close(got.option_logits, alone(engine, state, question(i), shared=False).option_logits)


def test_requests_about_one_state_share_one_prefill_and_each_equals_its_fresh_prefill(fresh, engine):
    misses = fresh.engine.cache.stats().misses

    outcomes = asyncio.run(
        held_burst(
            fresh,
            [
                lambda i=i: asking.outcome(fresh, STATE, [question(i)], Limits(**LIMITS), shared=True)
                for i in range(5)
            ],
        )
    )

    assert fresh.engine.cache.stats().misses - misses == 1
    for i, outcome in enumerate(outcomes):
        assert outcome.timing.merged_requests == 5
        assert outcome.timing.prefill_shared is True
        assert outcome.timing.batch_size == 1
        got = outcome.questions[0].readouts[0]
        assert_close(got.option_logits, alone(engine, STATE, question(i), shared=True).option_logits)


def test_a_cached_state_serves_a_batch_of_rows_and_orderings_and_equals_a_fresh_prefill(fresh, engine):
    # Several rows share the state prefix and the question text up to its number: one key.
    asyncio.run(asking.outcome(fresh, STATE, [question(7), question(8)], Limits(**LIMITS), shared=True))
    questions = [question(1), question(2, "rotations"), question(3, "all")]
    hits = fresh.engine.cache.stats().hits

    cached = asyncio.run(asking.outcome(fresh, STATE, questions, Limits(**LIMITS), shared=True))
    uncached_service = Service.start(
        make_settings(fresh.settings.model_path, state_cache_mib=0), engine=engine
    )
    reference = asyncio.run(asking.outcome(uncached_service, STATE, questions, Limits(**LIMITS), shared=True))

    assert fresh.engine.cache.stats().hits == hits + 1
    assert cached.timing.prefill == "cached" and cached.timing.prefill_seconds == 0
    assert reference.timing.prefill == "fresh"
    assert cached.timing.prefix_tokens == reference.timing.prefix_tokens
    rows = [r for q in cached.questions for r in q.readouts]
    want = [r for q in reference.questions for r in q.readouts]
    assert len(rows) == 1 + 3 + 6
    for a, b in zip(rows, want, strict=True):
        assert a.prompt_sha256 == b.prompt_sha256
        assert_close(a.option_logits, b.option_logits)


def test_a_second_question_with_orderings_extends_the_stored_state_prefix(fresh, engine):
    asyncio.run(asking.outcome(fresh, STATE, [question(0, "rotations")], Limits(**LIMITS)))

    second = asyncio.run(asking.outcome(fresh, STATE, [question(1, "rotations")], Limits(**LIMITS)))

    assert second.timing.prefill == "extended"
    for order, row in zip(range(3), second.questions[0].readouts, strict=True):
        q = question(1)
        descs = tuple(q.options[(order + k) % 3].description for k in range(3))
        plain = uncached(engine).read(
            RowsRequest.of(STATE, [PromptRow(q.text, descs)], shared=False, max_input_tokens=4096)
        )
        assert_close(row.option_logits, plain.rows[0].option_logits)


def test_a_cancelled_request_is_dropped_before_its_forward_and_the_others_are_answered(fresh):
    async def go():
        gate = EngineGate()
        held = await gate.hold(fresh)
        calls = [
            asyncio.create_task(
                asking.outcome(fresh, f"State {i}.", [question(i)], Limits(**LIMITS), shared=True)
            )
            for i in range(3)
        ]
        await wait_until_async(
            lambda: fresh.worker.batcher.queued >= 3, timeout=60, what="the three calls queued"
        )
        calls[1].cancel()
        await wait_until_async(calls[1].done, what="the cancelled call to end")
        before = fresh.worker.batcher.stats()
        gate.opened.set()
        await held
        return before, await asyncio.gather(*calls, return_exceptions=True)

    before, results = asyncio.run(go())
    after = fresh.worker.batcher.stats()
    assert isinstance(results[1], asyncio.CancelledError)
    # The two live requests, over different states, shared one packed forward; the cancelled one none.
    assert results[0].timing.merged_requests == results[2].timing.merged_requests == 2
    assert after.cancelled_dropped - before.cancelled_dropped == 1
    assert after.rows - before.rows == 1 + 2  # the gate's row, then the two live requests' rows


def test_out_of_memory_in_a_merged_forward_fails_only_the_request_that_cannot_run_alone(
    engine, checkpoint, monkeypatch
):
    memory = SimulatedMemory(floor=100 * MIB)
    service = Service.start(make_settings(checkpoint), engine=engine.with_options(memory=memory))
    service.engine.cache.put([1, 2, 3], prefill(engine.model, [1, 2, 3]))
    real = TorchEngine.run_groups

    def runs_out_with_the_huge_one(self, groups):
        # OOM cannot happen on this CPU: the forward that carries the "huge" request fails.
        if any(p.job.payload.prompts[0].text.count("HUGE") for group in groups for p in group.parts):
            raise cuda_oom()
        return real(self, groups)

    monkeypatch.setattr(TorchEngine, "run_groups", runs_out_with_the_huge_one)
    states = ["A small state.", "HUGE state.", "Another small state."]
    results = asyncio.run(
        held_burst(
            service,
            [
                lambda s=s, i=i: asking.outcome(service, s, [question(i)], Limits(**LIMITS))
                for i, s in enumerate(states)
            ],
        )
    )
    monkeypatch.setattr(TorchEngine, "run_groups", real)

    assert isinstance(results[1], OutOfMemory)
    for i in (0, 2):
        got = results[i].questions[0].readouts[0]
        assert_close(got.option_logits, alone(engine, states[i], question(i), shared=False).option_logits)
    assert service.worker.out_of_memory_events == 2  # the merged forward, then the huge one alone
    assert service.worker.batcher.stats().isolated_retries == 3
    # The failures dropped the stored states first; only the preamble is back (the retries computed it).
    preamble = service.engine.cache.peek(service.engine.codec.preamble)
    assert preamble is not None and service.engine.cache.stats().entries == 1
    assert memory.reserved == memory.floor


def test_the_release_policy_drops_the_cached_states_before_it_empties_the_allocator(engine):
    memory = SimulatedMemory(floor=100 * MIB)
    cache = StateCache(64 * MIB)
    cache.put([5, 6, 7], prefill(engine.model, [5, 6, 7]))
    seen = []
    memory.on_release = lambda: seen.append(cache.stats().entries)
    policy = ReleasePolicy(memory, 0, cache)

    assert policy.mark_baseline() == memory.floor + 64 * MIB
    policy.after_failure()

    assert seen[-1] == 0 and cache.stats().bytes == 0
    assert policy.cache_clears == 1


def test_chunked_prefill_lets_a_long_state_fit_a_headroom_that_one_shot_prefill_would_not(engine):
    state = " ".join(f"event {i}: the cache warmed in zone {i % 5}." for i in range(120))
    row = PromptRow("Did the cache warm?", ("Yes.", "No."))
    whole = uncached(engine).read(RowsRequest.of(state, [row], shared=True, max_input_tokens=4096))
    n_prefix = whole.timing.prefix_tokens
    width = whole.rows[0].input_tokens - n_prefix
    chunk = 64
    assert n_prefix > 4 * chunk
    headroom = engine.estimate.prefill_bytes(n_prefix, chunk) + engine.estimate.row_bytes(n_prefix, width)

    chunked = engine.with_options(cache=StateCache(0), prefill_chunk_tokens=chunk, headroom_bytes=headroom)
    got = chunked.read(RowsRequest.of(state, [row], shared=True, max_input_tokens=4096))
    with pytest.raises(TooLargeForMemory) as refused:
        uncached(engine).with_options(headroom_bytes=headroom).read(
            RowsRequest.of(state, [row], shared=True, max_input_tokens=4096)
        )

    assert_close(got.rows[0].option_logits, whole.rows[0].option_logits)
    assert refused.value.need_bytes > headroom


def test_a_state_cached_through_the_http_app_answers_the_follow_up_and_health_shows_it(fresh):
    app = create_app(fresh)
    body = {
        "state": STATE,
        "decisions": [
            {
                "id": "a",
                "question": "Is the checkout healthy?",
                "options": [{"id": "y", "description": "Yes."}, {"id": "n", "description": "No."}],
            },
        ],
    }

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            first = await c.post("/decide/shared", json=body, headers=AUTH)
            second = await c.post("/decide/shared", json=body, headers=AUTH)
            return first, second, await c.get("/health"), await c.get("/metrics")

    first, second, health, metrics = asyncio.run(go())
    assert first.status_code == second.status_code == 200
    assert first.json()["timing"]["prefill"] == "fresh"
    assert second.json()["timing"]["prefill"] == "cached"
    assert second.json()["timing"]["merged_requests"] == 1
    assert_close(second.json()["results"][0]["option_logits"], first.json()["results"][0]["option_logits"])
    cache = health.json()["state_cache"]
    assert cache["budget_bytes"] == fresh.settings.state_cache_mib * MIB
    assert cache["hits"] >= 1 and cache["entries"] >= 1 and 0 < cache["bytes"] <= cache["budget_bytes"]
    assert health.json()["batching"]["max_batch_rows"] == fresh.settings.max_batch_rows
    assert health.json()["batching"]["max_batch_tokens"] == fresh.settings.max_batch_tokens
    for name in ("semif_state_cache_hits_total", "semif_forwards_total", "semif_padded_token_share"):
        assert name in metrics.text


def test_a_request_cut_over_several_groups_costs_each_group_its_own_rows_and_the_state_until_kept(engine):
    engine = engine.with_options(cache=StateCache(1 << 30))
    rows = [PromptRow(f"Did step {i} finish?", ("It did.", "It did not.")) for i in range(6)]
    request = RowsRequest.of(STATE, rows, shared=True, max_input_tokens=4096)
    prepared = engine.prepare(request)
    groups = plan_groups([prepared.job("cut")], Bounds(max_batch_rows=2))
    state = len(prepared.prefix)
    after_state = [len(prompt.ids) - state for prompt in prepared.prompts]
    pairs = [
        after_state[0] + after_state[1],
        after_state[2] + after_state[3],
        after_state[4] + after_state[5],
    ]
    assert [engine.forward_cost(g) for g in groups] == [state + n for n in pairs]
    engine.read(request)  # keeps the state
    assert [engine.forward_cost(g) for g in groups] == pairs


def test_requests_about_one_new_state_in_one_group_cost_the_state_once_and_their_own_rows(engine):
    # Their forward computes the state once (one segment, every request's rows continuing it), so
    # the budget must not count it per request: questions asked together about a new state share one.
    engine = engine.with_options(cache=StateCache(1 << 30))
    requests = [
        RowsRequest.of(
            STATE,
            [PromptRow(f"Did step {i} finish?", ("It did.", "It did not."))],
            shared=True,
            max_input_tokens=4096,
        )
        for i in range(3)
    ]
    prepared = [engine.prepare(request) for request in requests]
    (group,) = plan_groups([p.job(f"question {n}") for n, p in enumerate(prepared)], Bounds())
    state = len(prepared[0].prefix)
    rows = sum(len(p.prompts[0].ids) - state for p in prepared)
    assert engine.forward_cost(group) == state + rows
    engine.read(requests[0])  # keeps the state
    assert engine.forward_cost(group) == rows
