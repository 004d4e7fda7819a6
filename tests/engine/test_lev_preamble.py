"""lev's preamble: the ids every lev prefix of a style starts with (the chat style's system turn and
the user turn up to its evidence), stored once per release and continued by every lev row the
engine would otherwise compute from position 0, as SemIf's prompts continue theirs
(tests/engine/test_preamble.py). Every answer is compared with lev's own computation (one full
forward per row through the release's adapter, `lev_per_row`) within 1e-5 in float32; which
segments each forward computed is read from the packed forward's own arguments."""

from __future__ import annotations

import pytest

from semif_serve.domain.lev.prompt import render_prefix, render_state
from semif_serve.domain.lev.types import LevChoice, LevNoul
from semif_serve.engine.lev_release import load_lev_release
from semif_serve.engine.packed_runs import PREAMBLE_MIN_TOKENS
from semif_serve.engine.runner import TorchEngine
from semif_serve.engine.state_cache import STATE, StateCache
from semif_serve.service.lev_core import LevEncoder
from semif_serve.tools.lev_builder import DEFAULT_BASE_NAME, write_lev_release
from tests.engine.test_preamble import STATES
from tests.support.lev_oracle import lev_on_engine, lev_per_row

TOL = 1e-5
QUESTIONS = {
    "dept": LevChoice(
        {"billing": "money matters", "tech": None, "sales": "deals"}, instructions="Which team?"
    ),
    "urgent": LevNoul(criteria={"true": "needs action today", "false": None}),
}
NEW_STATES = [
    "The nightly backup of the billing database failed at 02:14 with a full disk.",
    {"ticket": 4411, "text": "Refund not received after 10 days", "tier": "gold"},
]


@pytest.fixture(scope="module")
def releases(base, bank, checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("lev-preamble")
    return {
        style: load_lev_release(
            write_lev_release(root / style, checkpoint, prompt_style=style, seed=seed),
            bank,
            base.codec.tokenizer,
            name=style,
            base_name=DEFAULT_BASE_NAME,
            base_directory=checkpoint,
        )
        for style, seed in (("chat", 4), ("plain", 3))
    }


def assert_levs_own_answers(reply, release, base, bank, state, questions=QUESTIONS) -> None:
    want = lev_per_row(release, base.model, bank, state, questions)
    assert reply.answers.keys() == want.answers.keys()
    for qid, answer in reply.answers.items():
        expected = want.answers[qid]
        if isinstance(expected.value, str):
            assert answer.value == expected.value
        else:
            assert answer.value == pytest.approx(expected.value, abs=TOL)
        assert answer.probabilities == pytest.approx(expected.probabilities, abs=TOL)


@pytest.mark.parametrize("state", STATES, ids=range(len(STATES)))
def test_every_lev_chat_prefix_starts_with_its_preamble_which_ends_before_the_state(base, state):
    tokenizer = base.codec.tokenizer
    encoder = LevEncoder(tokenizer)
    preamble = encoder.preamble("chat")
    assert len(preamble) >= PREAMBLE_MIN_TOKENS
    prefix = render_prefix(state, "chat")
    assert tuple(encoder.encode(prefix, None, True)[: len(preamble)]) == preamble
    before_state = prefix[: prefix.rindex(render_state(state) + "\n\n")]
    assert before_state.startswith(tokenizer.decode(list(preamble)))


# How the rows meet lev's prefix: kept once and the rows over it (three label rows), or one row
# computed whole (a rating noul, read once: no prefill pays for it).
WAYS = {"kept prefix": (0, ("dept", "urgent"), "keep"), "whole rows": (10**6, ("urgent",), "read")}


@pytest.mark.parametrize("way", WAYS)
def test_a_lev_request_over_a_new_state_continues_the_stored_preamble_and_equals_levs_own_forwards(
    way, base, bank, releases, forwards
):
    keep_state_tokens, asked, continued_by = WAYS[way]
    questions = {qid: QUESTIONS[qid] for qid in asked}
    release = releases["chat"]
    engine = TorchEngine.over(base, bank).with_options(
        cache=StateCache(64 << 20), keep_state_tokens=keep_state_tokens
    )
    preamble = LevEncoder(release.tokenizer).preamble("chat")

    first = lev_on_engine(release, engine, NEW_STATES[0], questions)

    assert_levs_own_answers(first, release, base, bank, NEW_STATES[0], questions)
    stored = engine.cache.peek(preamble, STATE, release.adapter)
    assert stored is not None and stored.is_preamble
    kept = [s for f in forwards for s in f if s.keep and s.ids == preamble]
    assert len(kept) == 1 and kept[0].start is None and kept[0].adapter == release.adapter
    forwards.clear()

    second = lev_on_engine(release, engine, NEW_STATES[1], questions)

    assert_levs_own_answers(second, release, base, bank, NEW_STATES[1], questions)
    prefix = LevEncoder(release.tokenizer).encode(render_prefix(NEW_STATES[1], "chat"), None, True)
    past = tuple(prefix[len(preamble) : len(preamble) + 8])
    continued = [s for f in forwards for s in f if s.ids[:8] == past]
    assert continued and all(s.start is stored and getattr(s, continued_by) for s in continued)
    assert not [s for f in forwards for s in f if s.start is None and s.ids[: len(preamble)] == preamble]


def test_levs_plain_style_opens_with_too_few_ids_to_keep_a_preamble(base, bank, releases, forwards):
    release = releases["plain"]
    engine = TorchEngine.over(base, bank).with_options(cache=StateCache(64 << 20), keep_state_tokens=0)
    preamble = LevEncoder(release.tokenizer).preamble("plain")
    assert 0 < len(preamble) < PREAMBLE_MIN_TOKENS  # "Context" and no more

    reply = lev_on_engine(release, engine, NEW_STATES[0], QUESTIONS)

    assert_levs_own_answers(reply, release, base, bank, NEW_STATES[0])
    assert engine.cache.peek(preamble, STATE, release.adapter) is None
    assert not [s for f in forwards for s in f if s.ids == preamble]
