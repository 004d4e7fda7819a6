"""The base's guarantees on every kind of served model (tests/support/served_models.py: the base,
a PEFT adapter, a lev release, the base read with lev's method, the base read by a third method
defined in a test), each test parametrised over them
and run through the real app: a state past the token limit is refused the same way, quickly,
holding nothing; a reply past the budget is refused the same way before any forward; a second
question about a state hits the state cache, under a key that names the model; each request is
counted in /metrics and logged with the same fields. (No stall and batching:
test_one_scheduler.py.) Expected numbers come from the tokenizer, the reply itself, or the same
request on the base, never from the code under test."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest

from semif_serve.app import create_app
from tests.http.test_operations import metric
from tests.support import TOKEN, request_log_lines
from tests.support.served_models import (
    BASE,
    SERVED,
    SERVED_IDS,
    THIRD_METHOD,
    Served,
    native_decision,
    noul,
    serving,
    systemone_body,
)

AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROUTE = {"route": "/v1/systemone", "status": "200"}
# A state past the kept-state threshold below (64 tokens), so its first question keeps it.
STATE = "Ticket {key}: the payment page times out since Tuesday's release, for every card type. " * 6
# Appended to a state, this sentence adds its own tokens and no others: it opens with a space after
# a full stop (a piece of its own for Qwen's pre-tokenizer) and ends with one, as the state does.
SENTENCE = " The retry queue grew to forty thousand jobs before the rollback."
HUGE_STATE = "The invoice was charged twice in March. " * 50_000  # 2 MB, about 400k tokens
TOKEN_LIMIT = 32_768  # SEMIF_SYSTEMONE_MAX_INPUT_TOKENS' default: 2 MB is under its byte bound (x128)
REPLY_BUDGET = 3_000


@pytest.fixture(scope="module")
def roomy(engine, checkpoint, served_models):
    """Bodies up to 4 MB; a state of 64 tokens or more kept by its first question."""
    with serving(
        engine, checkpoint, served_models, max_body_bytes=4_000_000, keep_state_tokens=64
    ) as service:
        yield create_app(service)


@pytest.fixture(scope="module")
def tight(engine, checkpoint, served_models):
    """Replies of at most REPLY_BUDGET bytes."""
    with serving(engine, checkpoint, served_models, max_reply_bytes=REPLY_BUDGET) as service:
        yield create_app(service)


def talk(app, script: Callable):
    """Run `script(client)` against `app` through httpx's ASGI transport (the bearer token sent)."""

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://t", headers=AUTH, timeout=120
        ) as c:
            return await script(c)

    return asyncio.run(main())


async def metrics_when(client: httpx.AsyncClient, ready: Callable[[str], bool], seconds: float = 10) -> str:
    """/metrics once `ready(text)` holds (a reply's counts are waited for, never raced)."""
    deadline = time.monotonic() + seconds
    while True:
        text = (await client.get("/metrics")).text
        if ready(text) or time.monotonic() > deadline:
            return text
        await asyncio.sleep(0.02)


def two_questions(served: Served, key: str) -> dict[str, dict]:
    """Two questions over one state (SemIf's method reads them over one shared prefill)."""
    return {
        "paid": noul(served, f"Was ticket {key} paid twice?"),
        "urgent": noul(served, f"Is ticket {key} urgent?"),
    }


def rows_of(reply: dict) -> int:
    """The rows a reply says it read: SemIf's `x_semif.rows`, lev's orders (`x_lev.orders`), the
    third method's `x_yes_no.rows`."""
    return sum(
        answer["x_semif"]["rows"]
        if "x_semif" in answer
        else answer["x_lev"]["orders"]
        if "x_lev" in answer
        else answer["x_yes_no"]["rows"]
        for answer in reply["answers"].values()
    )


def model_label(served: Served) -> str:
    """The `model` label /metrics counts a request under (the base: `(base)`)."""
    return "(base)" if served is BASE else served.model


# -- bounded tokenising: a huge state refused after about the limit's worth of tokenising ---------


@pytest.fixture(scope="module")
def whole_encoding_seconds(tokenizer) -> float:
    """What the tokenizer itself takes to encode HUGE_STATE whole (the cost a bound must avoid)."""
    started = time.perf_counter()
    count = len(tokenizer.encode(HUGE_STATE))
    seconds = time.perf_counter() - started
    assert count > 10 * TOKEN_LIMIT
    return seconds


@pytest.fixture(scope="module")
def huge_refusals(roomy) -> dict[str, tuple[httpx.Response, float, dict, dict, int]]:
    """Each model's reply to HUGE_STATE, its seconds, /health's queue before and after, and the
    status of a small request on the same model after it."""

    async def script(c):
        done = {}
        for served in SERVED:
            before = (await c.get("/health")).json()["queue"]
            started = time.perf_counter()
            reply = await c.post("/v1/systemone", json=systemone_body(served, HUGE_STATE))
            seconds = time.perf_counter() - started
            after = (await c.get("/health")).json()["queue"]
            small = await c.post("/v1/systemone", json=systemone_body(served, "Short state."))
            done[served.id] = (reply, seconds, before, after, small.status_code)
        return done

    return talk(roomy, script)


@pytest.mark.parametrize("served", SERVED, ids=SERVED_IDS)
def test_a_state_past_the_token_limit_is_refused_in_one_shape_on_every_model_holding_nothing(
    huge_refusals, served
):
    reply, _, before, after, small = huge_refusals[served.id]
    assert reply.status_code == 413, reply.text
    assert list(reply.json()) == ["detail"]
    detail = reply.json()["detail"]
    assert set(detail) == {"error_type", "message"}
    assert detail["error_type"] == "request_too_large"
    assert "'q'" in detail["message"] and f"the limit of {TOKEN_LIMIT}" in detail["message"]
    assert after == before == {"in_progress": 0, "reading_bodies": 0, "engine_pending": 0}
    assert small == 200  # nothing of the refused request holds a slot


@pytest.mark.parametrize("served", SERVED, ids=SERVED_IDS)
def test_a_huge_state_is_refused_in_a_fraction_of_the_tokenizers_time_for_it_on_every_model(
    huge_refusals, whole_encoding_seconds, served
):
    reply, seconds, *_ = huge_refusals[served.id]
    assert reply.status_code == 413
    # The encoder stops a slice past the limit (~5% of this state): a third of the whole is ample.
    assert seconds < whole_encoding_seconds / 3, (seconds, whole_encoding_seconds)
    assert "at least" in reply.json()["detail"]["message"]


SEMIF_METHOD = [served for served in SERVED if served.method == "semif"]


@pytest.mark.parametrize("served", SEMIF_METHOD, ids=[served.id for served in SEMIF_METHOD])
def test_the_native_door_refuses_a_state_past_its_token_limit_alike_on_the_base_and_an_adapter(
    roomy, tokenizer, served
):
    state = "The invoice was charged twice in March. " * 2_500  # 100 kB: under the byte bound (x128)
    assert len(tokenizer.encode(state)) > 4_096  # SEMIF_MAX_INPUT_TOKENS' default

    async def script(c):
        reply = await c.post("/decide", json=native_decision(served, state))
        return reply, (await c.get("/health")).json()["queue"]

    reply, queue = talk(roomy, script)
    assert reply.status_code == 422, reply.text
    error = reply.json()["error"]
    assert (error["code"], error["field"]) == ("too_many_tokens", "state")
    assert "at least" in error["message"] and "4096" in error["message"]
    assert queue == {"in_progress": 0, "reading_bodies": 0, "engine_pending": 0}


# -- bounded replies: a reply past the budget refused before any forward ---------------------------


def wide_choice(served: Served) -> dict[str, dict]:
    """One choice of 16 long-named options (32 long-named nouls where the model answers no
    choice): a reply of several kB on every model."""
    if not served.asks("choice"):
        return {f"queue-{i:02d}-" + "n" * 60: noul(served, f"Is queue {i} late?") for i in range(32)}
    criteria = {f"queue-{i:02d}-" + "n" * 60: f"The team of queue {i}." for i in range(16)}
    question = {"type": "choice", "criteria": criteria}
    return {"pick": {**question, "x_orderings": "none"} if served.method == "semif" else question}


@pytest.mark.parametrize("served", SERVED, ids=SERVED_IDS)
def test_a_reply_past_the_budget_is_refused_in_one_shape_before_any_forward_on_every_model(
    roomy, tight, served
):
    body = systemone_body(served, "The payment page times out.", wide_choice(served))

    async def answered(c):
        return await c.post("/v1/systemone", json=body)

    async def refused(c):
        before = (await c.get("/metrics")).text
        reply = await c.post("/v1/systemone", json=body)
        after = (await c.get("/metrics")).text  # any forward it ran ended before its reply
        small = await c.post("/v1/systemone", json=systemone_body(served, "Short state."))
        return reply, before, after, small

    sent = talk(roomy, answered)
    assert sent.status_code == 200, sent.text
    assert len(sent.content) > REPLY_BUDGET  # the reply it would send is past the budget
    reply, before, after, small = talk(tight, refused)
    assert reply.status_code == 413, reply.text
    detail = reply.json()["detail"]
    assert set(detail) == {"error_type", "message"} and detail["error_type"] == "request_too_large"
    assert f"over the reply budget of {REPLY_BUDGET} bytes" in detail["message"]
    need = int(detail["message"].split("up to ")[1].split(" bytes")[0])
    assert need >= len(sent.content)  # counted at least as large as it is sent
    assert metric(after, "semif_forwards_total") == metric(before, "semif_forwards_total")  # none ran
    assert small.status_code == 200, small.text


# -- the state cache: a second question about a state hits it, keyed by the model -----------------


def cache_counts(text: str) -> tuple[float, float]:
    """The state tier's entries and hits, from /metrics."""
    return (
        metric(text, "semif_state_cache_kind_entries", kind="state"),
        metric(text, "semif_state_cache_kind_hits_total", kind="state"),
    )


@pytest.mark.parametrize("served", SERVED, ids=SERVED_IDS)
def test_a_second_question_about_a_state_hits_the_state_cache_on_every_model(roomy, served):
    state = STATE.format(key=f"cache-{served.id}")

    async def script(c):
        # Another state first: the model's preamble, stored at its first use, is then in the cache.
        await c.post("/v1/systemone", json=systemone_body(served, STATE.format(key=f"warm-{served.id}")))
        before = (await c.get("/metrics")).text
        start = cache_counts(before)
        first = await c.post("/v1/systemone", json=systemone_body(served, state))
        after = (await c.get("/metrics")).text
        kept = cache_counts(after)
        forwards.append(metric(after, "semif_forwards_total") - metric(before, "semif_forwards_total"))
        ask = {"again": noul(served, "Did the customer ask for a refund?")}
        second = await c.post("/v1/systemone", json=systemone_body(served, state, ask))
        hit = cache_counts(await metrics_when(c, lambda t: cache_counts(t)[1] > kept[1]))
        return start, first, kept, second, hit

    forwards: list[float] = []
    start, first, kept, second, hit = talk(roomy, script)
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    assert kept == (start[0] + 1, start[1])  # the first question kept its state
    assert forwards == [1]  # in the forward that answered it: keeping costs no second pass
    assert hit == (kept[0], kept[1] + 1)  # the second found it
    assert second.json()["x_timing"]["prefill"] == "cached"


def test_one_state_on_every_model_is_an_entry_per_model_each_hit_again(roomy):
    state = STATE.format(key="every-model")

    async def script(c):
        start = cache_counts((await c.get("/metrics")).text)
        firsts = [await c.post("/v1/systemone", json=systemone_body(s, state)) for s in SERVED]
        kept = cache_counts((await c.get("/metrics")).text)
        ask = [{"again": noul(s, "Did the customer ask for a refund?")} for s in SERVED]
        seconds = [
            await c.post("/v1/systemone", json=systemone_body(s, state, q))
            for s, q in zip(SERVED, ask, strict=True)
        ]
        hit = cache_counts(await metrics_when(c, lambda t: cache_counts(t)[1] >= kept[1] + len(SERVED)))
        return start, firsts, kept, seconds, hit

    start, firsts, kept, seconds, hit = talk(roomy, script)
    assert all(r.status_code == 200 for r in firsts + seconds)
    assert kept == (start[0] + len(SERVED), start[1])  # one entry per model, none found another's
    assert hit == (kept[0], kept[1] + len(SERVED))  # each model's second question found its own
    # The base and its adapter render one prompt: only the key's model tells their states apart.
    base, adapter = (r.json()["answers"]["again"]["x_semif"] for r in seconds[:2])
    assert base["prompt_sha256"] == adapter["prompt_sha256"]
    assert base["option_logits"] != adapter["option_logits"]


# -- metrics and logs: every model's requests counted and logged alike ----------------------------


def asked_twice(app, served: Served, tag: str) -> tuple[list[httpx.Response], list[dict], str, str]:
    """Two requests on `served` about new states (`tag` names them; the second's one SENTENCE
    longer), with their log lines and /metrics before and after (waited for until both are counted)."""
    state = STATE.format(key=f"{tag}-{served.id}")
    bodies = [
        systemone_body(served, text, two_questions(served, served.id)) for text in (state, state + SENTENCE)
    ]

    async def script(c):
        before = (await c.get("/metrics")).text
        counted = metric(before, "semif_model_requests_total", model=model_label(served))
        replies = [
            await c.post("/v1/systemone", json=b, headers={"X-Request-ID": f"{served.id}-{i}"})
            for i, b in enumerate(bodies)
        ]
        after = await metrics_when(
            c, lambda t: metric(t, "semif_model_requests_total", model=model_label(served)) >= counted + 2
        )
        return replies, before, after

    with request_log_lines() as lines:
        replies, before, after = talk(app, script)
    assert [r.status_code for r in replies] == [200, 200], [r.text for r in replies]
    logged = [next(line for line in lines if line.get("request_id") == f"{served.id}-{i}") for i in range(2)]
    return replies, logged, before, after


@pytest.mark.parametrize("served", SERVED, ids=SERVED_IDS)
def test_every_models_requests_forwards_and_rows_are_counted_in_metrics(roomy, served):
    replies, logged, before, after = asked_twice(roomy, served, "counted")

    def grew(name: str, **labels) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grew("semif_requests_total", **ROUTE) == 2
    assert grew("semif_model_requests_total", model=model_label(served)) == 2
    assert grew("semif_forwards_total") >= 2  # asked one after the other: a forward each at least
    assert grew("semif_rows_scored_total") == sum(rows_of(r.json()) for r in replies)
    assert [line["rows"] for line in logged] == [rows_of(r.json()) for r in replies]


@pytest.mark.parametrize("served", SERVED, ids=SERVED_IDS)
def test_every_models_state_tokens_are_counted_in_metrics_as_the_tokenizer_counts_them(
    roomy, tokenizer, served
):
    _, logged, before, after = asked_twice(roomy, served, "tokens")

    def grew(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert grew("semif_prefix_tokens_count") == 2
    prefixes = [line.get("prefix_tokens") for line in logged]
    assert grew("semif_prefix_tokens_sum") == sum(p or 0 for p in prefixes)
    # The longer state's prefix is longer by the tokenizer's own count of the sentence (lev's plain
    # prefix ends "<state>\n\n", where the sentence's full stop may merge with the blank line).
    state = STATE.format(key=f"tokens-{served.id}")
    if served.method == "lev":
        plain = [len(tokenizer.encode(f"Context:\n{s}\n\n")) for s in (state, state + SENTENCE)]
        assert prefixes == plain
    elif served is THIRD_METHOD:  # its own head, "Evidence: <state>\n", encoded alone
        from tests.service.test_third_method import evidence

        assert prefixes == [
            len(tokenizer.encode(evidence(s), add_special_tokens=False)) for s in (state, state + SENTENCE)
        ]
    else:
        assert prefixes[1] - prefixes[0] == len(tokenizer.encode(SENTENCE, add_special_tokens=False))


@pytest.fixture(scope="module")
def base_lines(roomy) -> list[dict]:
    """The base's log lines for the requests `asked_twice` sends."""
    return asked_twice(roomy, BASE, "fields-base")[1]


@pytest.mark.parametrize("served", SERVED, ids=SERVED_IDS)
def test_every_models_request_log_line_counts_its_rows_tokens_and_forward_time(roomy, served):
    replies, logged, _, _ = asked_twice(roomy, served, "logged")
    for line, reply in zip(logged, replies, strict=True):
        assert (line["route"], line["status"]) == ("/v1/systemone", 200)
        assert line["rows"] == rows_of(reply.json())
        assert line["input_tokens"] > 0
        assert line["forward_seconds"] > 0 and line["engine_seconds"] >= line["forward_seconds"]


@pytest.mark.parametrize("served", SERVED, ids=SERVED_IDS)
def test_every_models_request_log_line_carries_the_bases_fields_with_its_forwards_and_prefix(
    roomy, base_lines, served
):
    _, logged, _, _ = asked_twice(roomy, served, "fields")
    for line, base in zip(logged, base_lines, strict=True):
        assert set(line) - {"model"} == set(base) - {"model"}, set(line) ^ set(base)
        assert line["forward_batches"] >= 1 and line["prefix_tokens"] > 0


@pytest.mark.parametrize(
    "served",
    SERVED,
    ids=SERVED_IDS,
)
def test_every_models_request_log_line_names_the_model_and_its_method(roomy, served):
    replies, logged, _, _ = asked_twice(roomy, served, "named")
    for line, reply in zip(logged, replies, strict=True):
        assert line.get("model") == reply.json()["model"]  # the served name the reply gives
        # Under whatever key: the HTTP method is "POST", so the decision method needs a name of its own.
        assert served.method in [value for key, value in line.items() if key != "method"]
