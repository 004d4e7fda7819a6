"""Tokenising bounded by the token limit, requests encoded side by side, and rows over a long
state batched by their own width (issue 30).

The slices are checked against the tokenizer encoding the whole text, the byte bound against
the vocabulary read independently, refusals against the limit's own error, and the batched rows
against a plain full forward of each prompt.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from semif_serve.app import create_app
from semif_serve.domain.requests import RowsRequest
from semif_serve.domain.tokens import BoundedEncoder, PastLimit, Turns
from semif_serve.domain.types import PromptRow
from semif_serve.engine.memory import HostMemory, ReleasePolicy
from semif_serve.engine.worker import EngineWorker
from semif_serve.service.startup import Service
from tests.http.test_hardening import HardenedServer, post_head, read_response
from tests.http.test_no_stalls import rendered
from tests.support import TOKEN, in_process_client, make_settings
from tests.support.polling import wait_until, wait_until_async
from tests.support.scoring import score

# What tokenizers treat specially: runs of spaces and newlines, long punctuation tokens, digits,
# contractions, combining marks NFC composes, added tokens, wide characters.
PIECES = [" ", "  ", " " * 130, "\t", "\n", "\r\n", "a", "Zo", "\u00e9", "e\u0301", "\u0301", "\u6570",
          "12", "7", ",", "'s", "'", "//" + "-" * 120, "<|im_end|>", "<|vision_start|>", "\u00a0",
          "\u3000", "\U0001f600", "\u0e01\u0e34", "\x1c", '"', "{", ":", "\u1100\u1161\u11a8"]  # fmt: skip
OPTIONS = [{"id": "y", "description": "Yes."}, {"id": "n", "description": "No."}]
texts = st.lists(st.sampled_from(PIECES), min_size=1, max_size=80).map("".join)


@pytest.fixture(scope="module")
def small_slices(tokenizer) -> BoundedEncoder:
    encoder = BoundedEncoder(tokenizer, slice_chars=3)  # a cut at nearly every eligible space
    assert encoder.slices_exact
    return encoder


@settings(max_examples=300, deadline=None)
@given(text=texts)
def test_a_text_encoded_in_slices_has_the_ids_of_the_whole_text(small_slices, tokenizer, text):
    assert small_slices.encode(text, limit=10**9) == tokenizer.encode(text, add_special_tokens=False)


@settings(max_examples=300, deadline=None)
@given(text=texts)
def test_the_byte_bound_never_counts_more_tokens_than_the_text_has(small_slices, tokenizer, text):
    assert small_slices.at_least(text) <= len(tokenizer.encode(text, add_special_tokens=False))


def test_the_longest_token_is_read_from_the_vocabulary_bytes(tokenizer, small_slices):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    longest = max(
        len(bytes(byte_of[c] for c in t)) if all(c in byte_of for c in t) else len(t.encode()) for t in tokens
    )
    assert small_slices.max_token_bytes == longest == 128  # a run of 128 spaces is one token


def test_a_text_past_the_limit_raises_with_a_count_that_is_really_past_it(small_slices, tokenizer):
    text = "The zones recovered after the restart. " * 400
    true = len(tokenizer.encode(text, add_special_tokens=False))
    for limit in (10, true // 2, true - 1):
        with pytest.raises(PastLimit) as past:
            small_slices.encode(text, limit)
        assert limit < past.value.tokens <= true
    assert len(small_slices.encode(text, true)) == true


# -- refusals through the app: the limit's own error, after work bounded by the limit -----------


def tokenised_chars(monkeypatch, engine) -> list[int]:
    """The length of every text the engine's tokenizer is asked to encode from now on."""
    tokenizer = engine.codec.tokenizer
    seen: list[int] = []
    real = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, **kw: seen.append(len(text)) or real(text, **kw))
    return seen


def refusal(client, state) -> tuple[int, str, str]:
    body = {"id": "q1", "state": state, "question": "Did it recover?", "options": OPTIONS}
    reply = client.post("/decide", json=body)
    error = reply.json()["error"]
    return reply.status_code, error["code"], error["field"]


def test_a_state_past_the_limit_is_refused_as_the_limit_refuses_after_tokenising_about_the_limit(
    client, service, monkeypatch
):
    limit = service.settings.max_input_tokens
    just_over = "word " * limit  # tokenised whole (shorter than one slice): today's refusal
    assert refusal(client, just_over) == (422, "too_many_tokens", "state")
    seen = tokenised_chars(monkeypatch, service.engine)
    for size in (100_000, 400_000):  # both under limit x the longest token's bytes: sliced
        state = "The zones recovered. " * (size // 21)
        seen.clear()
        assert refusal(client, state) == (422, "too_many_tokens", "state")
        assert sum(seen) < 80_000  # about the limit's worth of text, not the state's length
    seen.clear()
    proved = "x " * 300_000  # 600 kB: more bytes than the limit's tokens can cover
    assert refusal(client, proved) == (422, "too_many_tokens", "state")
    assert sum(seen) == 0  # refused before any of it was tokenised


def test_a_question_past_the_limit_is_refused_naming_it_after_tokenising_about_the_limit(
    client, service, monkeypatch
):
    seen = tokenised_chars(monkeypatch, service.engine)
    decisions = [
        {"id": "a", "question": "Did it recover?", "options": OPTIONS},
        {"id": "b", "question": "Why? " * 80_000, "options": OPTIONS},
    ]
    reply = client.post("/decide/shared", json={"state": "The zones recovered.", "decisions": decisions})
    assert reply.status_code == 422, reply.text
    error = reply.json()["error"]
    assert (error["code"], error["field"]) == ("too_many_tokens", "decisions[1]")
    assert "at least" in error["message"] and "4096" in error["message"]
    assert sum(seen) < 80_000


# -- encoding side by side ---------------------------------------------------------------------


def test_a_tiny_requests_encoding_is_not_queued_behind_a_big_ones(engine):
    own = engine.with_options(direct_path="reuse")  # an engine of its own to instrument
    big_started, release = threading.Event(), threading.Event()
    real = own.prepare

    def prepare(request):
        if request.state == "big":
            big_started.set()
            release.wait(60)  # the big request's encoding is held until the tiny one is answered
        return real(request)

    own.prepare = prepare  # type: ignore[method-assign]
    worker = EngineWorker(own, ReleasePolicy(HostMemory(), 1 << 30), encoders=4)
    row = [PromptRow("Did it recover?", ("Yes.", "No."))]

    async def main() -> list[str]:
        done: list[str] = []

        async def ask(state: str) -> None:
            await score(worker, RowsRequest.of(state, row, shared=False, max_input_tokens=4096))
            done.append(state)

        big = asyncio.create_task(ask("big"))
        await wait_until_async(big_started.is_set, timeout=30, what="the big request's encoding to start")
        await asyncio.wait_for(ask("tiny"), 30)
        release.set()
        await big
        return done

    try:
        assert asyncio.run(main()) == ["tiny", "big"]
    finally:
        release.set()
        worker.shutdown()


def test_the_service_gives_every_admitted_request_an_encoder_thread(service):
    assert service.worker._encoder._max_workers == service.settings.max_queue


def test_concurrent_encodings_give_the_ids_of_each_alone(engine):
    codec = engine.codec
    rows = [PromptRow("Did it recover?", ("Yes.", "No.")), PromptRow("Which zone?", ("A", "B", "C"))]
    states = [f"State {i}: " + "the zones recovered " * (50 * i) for i in range(8)]
    alone = [[p.ids for p in codec.encode_prompts(s, rows, 100_000)] for s in states]
    results: dict[int, list[list[int]]] = {}

    def encode(i: int) -> None:
        for _ in range(3):
            results[i] = [p.ids for p in codec.encode_prompts(states[i], rows, 100_000)]

    threads = [threading.Thread(target=encode, args=(i,)) for i in range(len(states))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert [results[i] for i in range(len(states))] == alone


def test_six_large_states_and_a_tiny_request_over_a_live_server(service):
    noul = {"q": {"type": "noul", "instructions": "Did it recover?"}}
    state = "The zones recovered. " * 45_000  # ~0.95 MB, ~225k tokens: past the 32768 of a row
    big = json.dumps({"model": "jev-latest", "state": state, "questions": noul}).encode()
    tiny = {"model": "jev-latest", "state": "ok", "questions": noul}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with HardenedServer(create_app(service)) as server:
        statuses: list[int] = []

        def post_big() -> None:  # a raw socket: the client's sending holds no lock the server needs
            sock = server.connect(post_head("/v1/systemone", len(big)) + big)
            statuses.append(read_response(sock, 120)[0])

        threads = [threading.Thread(target=post_big) for _ in range(6)]
        for thread in threads:
            thread.start()
        assert wait_until(lambda: service.worker.pending >= 6, 60)  # all six are being encoded
        t0 = time.monotonic()
        health = httpx.get(f"{server.url}/health", timeout=30)
        health_seconds = time.monotonic() - t0
        t0 = time.monotonic()
        small = httpx.post(f"{server.url}/v1/systemone", json=tiny, headers=headers, timeout=120)
        tiny_seconds = time.monotonic() - t0
        for thread in threads:
            thread.join(120)
    assert health.status_code == 200 and health_seconds < 1.0
    assert small.status_code == 200, small.text
    assert tiny_seconds < 10.0  # generous: it waits for one slice of each, not for their encodings
    assert statuses == [413] * 6  # each refused by the token limit


def test_tokenizer_calls_take_turns_in_the_order_they_ask(tokenizer):
    turns = Turns(width=1)
    encoder = BoundedEncoder(tokenizer, slice_chars=64, turns=turns)
    order: list[str] = []
    first_slice, tiny_waiting = threading.Event(), threading.Event()
    real = tokenizer.encode

    class Recording:
        def encode(self, text, **kw):
            order.append("tiny" if text == "tiny" else "big")
            if len(order) == 1:
                first_slice.set()
                assert tiny_waiting.wait(30)  # the tiny call asks while the big one holds the turn
            return real(text, **kw)

    encoder.tokenizer = Recording()
    big = threading.Thread(target=encoder.encode, args=("words of a state " * 40, 10**6))
    big.start()
    assert first_slice.wait(30)
    tiny = threading.Thread(target=encoder.encode, args=("tiny", 10**6))
    tiny.start()
    assert wait_until(lambda: len(turns._waiting) == 1, 30)
    tiny_waiting.set()
    big.join(30)
    tiny.join(30)
    assert order[:3] == ["big", "tiny", "big"]  # after one slice of the big text, not all of it
    assert order.count("big") > 3


# -- rows over a state longer than the batch budget ----------------------------------------------


def test_rows_over_a_state_longer_than_the_batch_budget_run_in_few_forwards_with_plain_numbers(
    engine, checkpoint, tokenizer
):
    import torch

    budget, rows = 256, 200
    service = Service.start(
        make_settings(checkpoint, max_batch_tokens=budget, max_batch_rows=256, max_rows=rows), engine=engine
    )
    state = "The zones recovered after the restart, one by one. " * 28  # ~300 tokens: past the budget
    decisions = [
        {"id": f"d{i}", "question": f"Is claim {i:03d} supported?", "options": OPTIONS} for i in range(rows)
    ]
    before = service.worker.batcher.stats().forwards
    reply = in_process_client(create_app(service)).post(
        "/decide/shared", json={"state": state, "decisions": decisions}
    )
    assert reply.status_code == 200, reply.text
    forwards = service.worker.batcher.stats().forwards - before
    results = reply.json()["results"]
    prefix = reply.json()["timing"]["prefix_tokens"]
    assert prefix > budget  # the state alone is past the budget (before: one forward per row)
    width = max(r["input_tokens"] for r in results) - prefix
    # Groups of as many whole rows as the batch budget takes; each forward packs as many groups as
    # the forward's token budget takes (the first beside the state's prefill).
    per_forward = service.worker.batcher.bounds.max_forward_tokens
    assert (
        math.ceil(rows * width / per_forward)
        <= forwards
        <= 1 + math.ceil(rows * width / (per_forward - budget))
    )
    prompts = [
        tokenizer.encode(
            rendered(tokenizer, state, d["question"], ["Yes.", "No."], engine.codec.codes),
            add_special_tokens=False,
        )
        for d in decisions
    ]
    assert [r["input_tokens"] for r in results] == [len(ids) for ids in prompts]
    assert (
        len({len(ids) for ids in prompts}) == 1
    )  # one length: plain forwards of several rows need no padding
    for start in range(0, rows, 50):
        with torch.no_grad():
            logits = engine.model(
                input_ids=torch.tensor(prompts[start : start + 50]), use_cache=False, logits_to_keep=1
            )
        plain = logits.logits[:, -1].float()[:, engine.codec.slots[:2]].tolist()
        for result, want in zip(results[start : start + 50], plain, strict=True):
            assert max(abs(a - b) for a, b in zip(result["option_logits"], want, strict=True)) <= 1e-5
