"""A lev release served through System One (`POST /v1/systemone`) by name and by an operator's
alias, through the real app: every answer against the independent computation of
tests/engine/test_lev_release.py (PEFT's own LoRA forward of the prompt written out in lev's
format, the softmax with temperature and the order averaging written out), System One's
`confidence` and lev's own written out, and what a lev model cannot read refused.
"""

from __future__ import annotations

import math

import pytest
import torch

from semif_serve.app import create_app
from semif_serve.doors.systemone.mapping import asked_questions
from semif_serve.doors.systemone.schemas import SystemOneRequest
from semif_serve.doors.systemone.sizes import answer_bytes, response_bytes
from semif_serve.service.methods.lev import LevMethod, answer_sizes
from semif_serve.service.startup import Service
from semif_serve.tools.lev_builder import DEFAULT_TEMPERATURES, write_lev_release
from tests.engine.test_lev_release import (
    BINARY,
    CANDIDATES,
    CHOICE_SUFFIXES,
    MODE_B,
    NINE,
    PLAIN_PREFIX,
    RATING,
    STATE,
    TOL,
    candidate_state,
    expected_probs,
    head_scores,
    labels_of,
    prefix_of,
    reference_last,
    score_suffix,
    softmax_t,
    tokens_of,
)
from tests.support import in_process_client, make_settings
from tests.support.peft_oracle import peft_model

MODELS = """
[models.lev-tiny]
release = "plain"
[models.lev-chat]
release = "chat"
[models.lev-binary]
release = "plain"
noul_readout = "binary"
score_order_average = "cyclic"
[models.lev-full]
release = "plain"
scale = 1.0
[models.lev-capped]
release = "plain"
max_label_options = 2
[models.lev-headless]
release = "headless"
max_label_options = 2
[aliases]
local = "lev-tiny"
"""
# The questions of test_lev_release.py, as a System One client sends them.
QUESTIONS = {
    "dept": {
        "type": "choice",
        "instructions": "Which team?",
        "criteria": {"billing": "money matters", "tech": None, "sales": {"z": 1, "a": "é"}},
    },
    "frustration": {
        "type": "score",
        "instructions": {"question": "How upset?", "data": 3},
        "criteria": ["calm", "annoyed", {"level": "furious"}],
    },
    "urgent": {"type": "noul", "criteria": {"true": "needs action today", "false": None}},
}
NAMES = ["billing", "tech", "sales"]


@pytest.fixture(scope="module")
def release_dirs(checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("lev-door")
    write_lev_release(root / "plain", checkpoint, prompt_style="plain", seed=3)
    write_lev_release(root / "chat", checkpoint, prompt_style="chat", seed=4)
    write_lev_release(root / "headless", checkpoint, head=False, seed=3)
    (root / "models.toml").write_text(MODELS)
    return root


@pytest.fixture(scope="module")
def client(engine, checkpoint, release_dirs):
    settings = make_settings(checkpoint, models=release_dirs / "models.toml")
    return in_process_client(create_app(Service.start(settings, engine=engine)))


@pytest.fixture(scope="module")
def references(checkpoint, release_dirs):
    """PEFT's own LoRA over a fresh copy of the base, one per release."""
    return {style: peft_model(checkpoint, release_dirs / style) for style in ("plain", "chat")}


def ask(client, model, questions=QUESTIONS, **extra):
    reply = client.post(
        "/v1/systemone", json={"model": model, "state": STATE, "questions": questions, **extra}
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def close(got, want):
    assert len(got) == len(want)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < TOL, (got, want)


def system_one_choice_confidence(probs):
    n = len(probs)
    return (max(probs) - 1 / n) / (1 - 1 / n)


def system_one_score_confidence(probs):
    n = len(probs)
    k = probs.index(max(probs))
    spread = sum(abs(i - (n - 1) / 2) for i in range(n)) / n
    return max(0.0, 1 - sum(p * abs(i - k) for i, p in enumerate(probs)) / spread)


def gini(probs):
    k = len(probs)
    return (k * sum(p * p for p in probs) - 1) / (k - 1)


def expected(references, tokenizer, style, kind, scale=0.25, noul="rating", score_orders=((0, 1, 2),)):
    """The independent answer for one question of QUESTIONS: its distribution, in the caller's order."""
    reference, prefix = references[style], prefix_of(style)
    if kind == "dept":
        return expected_probs(
            reference, tokenizer, prefix, CHOICE_SUFFIXES[style], [[0, 1, 2], [2, 1, 0]],
            labels_of(style, "ABC"), DEFAULT_TEMPERATURES["choice:A:small"], scale,
        )  # fmt: skip
    if kind == "frustration":
        orders = [list(o) for o in score_orders]
        return expected_probs(
            reference, tokenizer, prefix, [score_suffix(style, o) for o in orders], orders,
            labels_of(style, "ABC"), DEFAULT_TEMPERATURES["score:A"], scale,
        )  # fmt: skip
    if noul == "binary":
        return expected_probs(
            reference, tokenizer, prefix, BINARY[style], [[0, 1], [1, 0]], labels_of(style, "AB"),
            DEFAULT_TEMPERATURES["noul_binary:A"], scale,
        )  # fmt: skip
    return expected_probs(
        reference, tokenizer, prefix, [RATING[style]], [list(range(9))], labels_of(style, NINE),
        DEFAULT_TEMPERATURES["noul:A"], scale,
    )  # fmt: skip


# -- answers equal the independent computation -------------------------------------------------


@pytest.mark.parametrize("model, style", [("local", "plain"), ("lev-chat", "chat")])
def test_each_type_equals_lev_read_by_hand_in_both_prompt_styles(model, style, client, references, tokenizer):
    reply = ask(client, model)
    assert reply["model"] == {"local": "lev-tiny"}.get(model, model)  # the real name, not the alias
    answers = reply["answers"]

    dept = expected(references, tokenizer, style, "dept")
    got = answers["dept"]
    assert list(got["probabilities"]) == NAMES
    close(list(got["probabilities"].values()), dept)
    assert got["choice"] == NAMES[dept.index(max(dept))]
    assert abs(got["confidence"] - system_one_choice_confidence(dept)) < TOL
    assert abs(got["x_lev"]["confidence"] - gini(dept)) < TOL
    assert (got["x_lev"]["bucket"], got["x_lev"]["orders"], got["x_lev"]["mode"]) == (
        "choice:A:small",
        2,
        "A",
    )
    assert "x_semif" not in got

    levels = expected(references, tokenizer, style, "frustration")
    got = answers["frustration"]
    close(list(got["probabilities"].values()), levels)
    assert abs(got["score"] - sum(i * p for i, p in enumerate(levels))) < TOL
    assert abs(got["confidence"] - system_one_score_confidence(levels)) < TOL
    assert got["legend"] == {"0": "calm", "1": "annoyed", "2": '{"level": "furious"}'}

    rating = expected(references, tokenizer, style, "urgent")
    got = answers["urgent"]
    assert abs(got["noul"] - sum(i / 8 * p for i, p in enumerate(rating))) < TOL
    close(list(got["x_lev"]["distribution"].values()), rating)
    assert (got["x_lev"]["bucket"], got["x_lev"]["orders"]) == ("noul:A", 1)
    # lev's server's noul extras: its nine levels, and its normalised Gini of them
    assert list(got["probabilities"]) == [str(i) for i in range(9)]
    close(list(got["probabilities"].values()), rating)
    assert abs(got["confidence"] - (9 * sum(p * p for p in rating) - 1) / 8) < TOL

    suffixes = [*CHOICE_SUFFIXES[style], score_suffix(style, [0, 1, 2]), RATING[style]]
    assert reply["usage"] == {
        "input_tokens": tokens_of(tokenizer, prefix_of(style), suffixes),
        "output_tokens": 0,
        "cached_input_tokens": len(tokenizer.encode(prefix_of(style))),  # lev's extra: the prefix
    }
    # Four rows repeat the prefix three times more than one prefill of it: they ran over it.
    prefix = len(tokenizer.encode(prefix_of(style)))
    own = [len(tokenizer.encode(s, add_special_tokens=False)) for s in suffixes]
    timing = reply["x_timing"]
    assert (timing["prefill"], timing["prefix_tokens"], timing["forward_batches"]) == ("fresh", prefix, 1)
    assert (timing["batch_size"], timing["true_suffix_tokens"]) == (4, sum(own))
    assert timing["padded_suffix_tokens"] == sum(own)  # packed end to end: no padding


def test_the_entrys_lev_options_binary_noul_and_cyclic_score_orders(client, references, tokenizer):
    answers = ask(client, "lev-binary")["answers"]
    binary = expected(references, tokenizer, "plain", "urgent", noul="binary")
    assert abs(answers["urgent"]["noul"] - binary[0]) < TOL
    assert answers["urgent"]["x_lev"]["distribution"].keys() == {"yes", "no"}
    assert answers["urgent"]["probabilities"] is None  # a binary noul has no levels, as lev sends it
    yes, no = answers["urgent"]["x_lev"]["distribution"].values()
    assert abs(answers["urgent"]["confidence"] - (2 * (yes * yes + no * no) - 1)) < TOL
    assert answers["urgent"]["x_lev"]["bucket"] == "noul_binary:A"
    cyclic = expected(
        references, tokenizer, "plain", "frustration", score_orders=((0, 1, 2), (1, 2, 0), (2, 0, 1))
    )
    close(list(answers["frustration"]["probabilities"].values()), cyclic)
    assert answers["frustration"]["x_lev"]["orders"] == 3


def test_the_entrys_scale_replaces_the_manifests_adapter_scale(client, references, tokenizer):
    full = ask(client, "lev-full", questions={"dept": QUESTIONS["dept"]})["answers"]["dept"]
    close(list(full["probabilities"].values()), expected(references, tokenizer, "plain", "dept", scale=1.0))
    quarter = ask(client, "lev-tiny", questions={"dept": QUESTIONS["dept"]})["answers"]["dept"]
    gap = max(
        abs(a - b)
        for a, b in zip(full["probabilities"].values(), quarter["probabilities"].values(), strict=True)
    )
    assert gap > 100 * TOL


def test_a_choice_of_ten_reads_the_mid_band_temperature(client, references, tokenizer):
    names = [f"opt{i}" for i in range(10)]
    codes = list("ABCDEFGHIJ")
    order = list(range(10))
    suffixes = [
        "Question: many\nOptions:\n" + "\n".join(f"  {c}: {names[i]}" for c, i in zip(codes, o, strict=True))
        + "\nAnswer:"
        for o in (order, order[::-1])
    ]  # fmt: skip
    got = ask(client, "local", questions={"many": {"type": "choice", "criteria": dict.fromkeys(names)}})
    want = expected_probs(
        references["plain"], tokenizer, PLAIN_PREFIX, suffixes, [order, order[::-1]],
        labels_of("plain", codes), DEFAULT_TEMPERATURES["choice:A:mid"],
    )  # fmt: skip
    close(list(got["answers"]["many"]["probabilities"].values()), want)
    assert got["answers"]["many"]["x_lev"]["bucket"] == "choice:A:mid"


def test_under_the_entrys_label_cap_every_question_reads_the_candidate_head(
    client, references, tokenizer, release_dirs
):
    answers = ask(client, "lev-capped")["answers"]
    state = torch.load(release_dirs / "plain" / "mode_b_head.pt", weights_only=True)
    temperatures = {"dept": DEFAULT_TEMPERATURES["choice:B"], "frustration": 1.0, "urgent": 1.0}
    for qid, suffix in MODE_B["plain"].items():
        _, hidden = reference_last(references["plain"], tokenizer, PLAIN_PREFIX, suffix, 0.25)
        candidates = torch.stack(
            [candidate_state(references["plain"], tokenizer, t) for t in CANDIDATES[qid]]
        )
        want = softmax_t(head_scores(state, hidden, candidates), temperatures[qid])
        close(list(answers[qid]["x_lev"]["distribution"].values()), want)
        assert (answers[qid]["x_lev"]["mode"], answers[qid]["x_lev"]["orders"]) == ("B", 1)
    assert answers["dept"]["x_lev"]["bucket"] == "choice:B"


def test_under_the_label_cap_usage_counts_every_candidates_tokens_as_rows_of_their_own(client, tokenizer):
    usage = ask(client, "lev-capped")["usage"]
    rows = tokens_of(tokenizer, PLAIN_PREFIX, MODE_B["plain"].values())
    shown = sum(
        len(tokenizer.encode(text, add_special_tokens=False))
        for qid in MODE_B["plain"]
        for text in CANDIDATES[qid]
    )
    assert usage["input_tokens"] == rows + shown
    assert usage["cached_input_tokens"] == len(tokenizer.encode(PLAIN_PREFIX))


def test_models_lists_each_release_with_its_method_adapter_scale_and_buckets(client):
    listed = {m["name"]: m for m in client.get("/v1/models").json()["models"]}
    tiny, full = listed["lev-tiny"], listed["lev-full"]
    assert (tiny["x_method"], tiny["x_scale"], full["x_scale"]) == ("lev", 0.25, 1.0)
    # The builder's adapter: r = 4, alpha = 8, so PEFT's alpha / r = 2, times the serving scale.
    assert (tiny["x_adapter"]["rank"], tiny["x_adapter"]["factor"], full["x_adapter"]["factor"]) == (
        4,
        0.5,
        2.0,
    )
    assert tiny["x_calibration"] == sorted(DEFAULT_TEMPERATURES)
    assert listed["local"]["x_alias_of"] == "lev-tiny"


def test_a_lev_request_is_counted_under_its_model(client):
    def counted():
        line = [ln for ln in client.get("/metrics").text.splitlines() if 'model="lev-tiny"' in ln]
        return float(line[0].rsplit(" ", 1)[1]) if line else 0.0

    before = counted()
    ask(client, "local", questions={"urgent": QUESTIONS["urgent"]})
    assert counted() == before + 1


def test_the_base_still_answers_as_the_base_beside_a_lev_model(client):
    question = {"ok": {"type": "noul", "instructions": "Is the ticket about billing?"}}
    before = ask(client, "jev-latest", questions=question)["answers"]["ok"]
    ask(client, "local")
    after = ask(client, "jev-latest", questions=question)["answers"]["ok"]
    assert "x_semif" in after and math.isclose(before["noul"], after["noul"], abs_tol=1e-9)


# -- what a lev model cannot read is refused, naming the field --------------------------------


def refused(reply, status, error_type):
    assert reply.status_code == status, reply.text
    detail = reply.json()["detail"]
    assert detail["error_type"] == error_type
    return detail["message"]


def post(client, model="local", **body):
    return client.post("/v1/systemone", json={"model": model, "state": "text", **body})


PNG = {"type": "image", "format": "png", "data_base64": "iVBORw0KGgo="}


@pytest.mark.parametrize(
    "body, field",
    [
        ({"questions": {"q": QUESTIONS["urgent"]}, "assets": {"<img>": PNG}, "state": "see <img>"}, "assets"),
        ({"questions": {"where": {"type": "box"}}}, "questions.where.type"),
        ({"questions": {"q": {**QUESTIONS["dept"], "x_orderings": "rotations"}}}, "questions.q.x_orderings"),
        ({"questions": {"q": {**QUESTIONS["dept"], "x_workload": "triage"}}}, "questions.q.x_workload"),
    ],
    ids=["images", "box", "x_orderings", "x_workload"],
)
def test_a_request_lev_does_not_read_is_refused_naming_the_field(client, body, field):
    message = refused(post(client, **body), 400, "api_usage_error")
    assert message.startswith(f"{field}: ") and "lev-tiny" in message


def test_a_question_for_a_head_the_release_lacks_is_refused_naming_it(client):
    questions = {"ok": QUESTIONS["urgent"], "dept": QUESTIONS["dept"]}
    message = refused(post(client, model="lev-headless", questions=questions), 400, "api_usage_error")
    assert message.startswith("question 'ok' needs lev's candidate head") and "mode_b_head.pt" in message


def test_rows_past_the_row_cap_are_refused_before_any_forward(engine, checkpoint, release_dirs):
    settings = make_settings(checkpoint, models=release_dirs / "models.toml", systemone_max_rows=3)
    small = in_process_client(create_app(Service.start(settings, engine=engine)))
    # Two choices read in two orders each: four of lev's rows (SemIf would ask them in one).
    questions = {"a": QUESTIONS["dept"], "b": QUESTIONS["dept"]}
    message = refused(post(small, questions=questions), 413, "request_too_large")
    assert "4 rows" in message


def test_a_prompt_over_the_token_limit_is_refused_naming_the_question(engine, checkpoint, release_dirs):
    settings = make_settings(checkpoint, models=release_dirs / "models.toml", systemone_max_input_tokens=40)
    small = in_process_client(create_app(Service.start(settings, engine=engine)))
    questions = {"short": {"type": "noul"}, "long": {"type": "noul", "instructions": "word " * 60}}
    message = refused(post(small, questions=questions), 413, "request_too_large")
    assert message.startswith("question 'long': the prompt is")


def test_a_lev_reply_is_counted_before_any_engine_work_at_least_as_large_as_it_is_sent(client):
    wide = {"type": "choice", "criteria": {f"option-{i}-" + "é" * i: None for i in range(30)}}
    questions = {**QUESTIONS, "wide": wide, "again": QUESTIONS["frustration"]}
    reply = post(client, questions=questions)
    assert reply.status_code == 200, reply.text
    for model in ("lev-tiny", "lev-binary"):  # a rating noul and a binary one
        sent = post(client, model=model, questions=questions)
        assert sent.status_code == 200
        request = SystemOneRequest.model_validate({"model": model, "state": "text", "questions": questions})
        # lev's count of each answer, in its type's one shape, in the reply around them
        answers = [answer_bytes(q.type, answer_sizes(q)) for q in asked_questions(request.questions)]
        assert response_bytes(model, list(request.questions), answers) >= len(sent.content)


def test_a_lev_reply_over_the_reply_budget_is_refused_before_any_engine_work(
    engine, checkpoint, release_dirs, monkeypatch
):
    settings = make_settings(checkpoint, models=release_dirs / "models.toml", max_reply_bytes=2048)
    small = in_process_client(create_app(Service.start(settings, engine=engine)))
    asked = []
    real = LevMethod.jobs

    def counted(self, *args, **kwargs):
        asked.append(args)
        return real(self, *args, **kwargs)

    # A call's rows reach the batcher as the method's jobs: none are made for a refused reply.
    monkeypatch.setattr(LevMethod, "jobs", counted)
    assert post(small, questions={"urgent": QUESTIONS["urgent"]}).status_code == 200
    wide = {"type": "choice", "criteria": {f"queue-{i}": None for i in range(40)}}
    message = refused(post(small, questions={"wide": wide}), 413, "request_too_large")
    assert "over the reply budget of 2048 bytes" in message and "fewer questions" in message
    assert len(asked) == 1  # the refused request's rows never reached the engine
