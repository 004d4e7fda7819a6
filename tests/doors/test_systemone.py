"""System One (`/v1/systemone`, `/v1/models`) through the real app on the tiny Qwen3.5 with the real
vocabulary: answers against an independent plain forward, the mapping, batching, the formulas,
models and aliases, operator policies, and TypeSafe's error shapes."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import math
import string

import httpx
import pytest
import torch

from semif_serve.app import create_app
from semif_serve.service.startup import Service
from tests.support import TOKEN, make_settings

SYSTEM = (  # written out from SemIf's spec, not imported
    "Apply the supplied criterion to the supplied evidence. Choose exactly one listed option. "
    "Respond with only its uppercase letter, with no explanation or reasoning."
)
STATE = {"ticket": "I was charged twice for my March invoice.", "customer": "Zoë", "tier": 2}
TOL = 1e-5


# -- an independent reading ------------------------------------------------------------------------


def answer_codes_by_hand(tokenizer) -> list[tuple[str, int]]:
    """A..Z, then AA..ZZ that are one exact round-trip token with an id not taken before."""
    pairs: list[tuple[str, int]] = []
    for code in [
        *string.ascii_uppercase,
        *("".join(p) for p in itertools.product(string.ascii_uppercase, repeat=2)),
    ]:
        ids = tokenizer.encode(code, add_special_tokens=False)
        if len(ids) == 1 and tokenizer.decode(ids) == code and ids[0] not in [i for _, i in pairs]:
            pairs.append((code, ids[0]))
    return pairs


@pytest.fixture(scope="module")
def codes(tokenizer):
    return answer_codes_by_hand(tokenizer)


def rendered(tokenizer, codes, state, question: str, descriptions: list[str]) -> str:
    user = json.dumps(
        {
            "evidence": state,
            "criterion": question,
            "options": [{"letter": codes[i][0], "description": d} for i, d in enumerate(descriptions)],
        },
        ensure_ascii=False,
    )
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )


def plain_forward(
    engine, tokenizer, codes, state, question, descriptions
) -> tuple[list[float], list[float], str]:
    """model(input_ids=the whole prompt), last position, at the codes' token ids; softmax by hand."""
    text = rendered(tokenizer, codes, state, question, descriptions)
    ids = tokenizer.encode(text, add_special_tokens=False)
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1).logits[0, -1]
    option_logits = [float(logits[token_id]) for _, token_id in codes[: len(descriptions)]]
    exps = [math.exp(v - max(option_logits)) for v in option_logits]
    return option_logits, [e / sum(exps) for e in exps], hashlib.sha256(text.encode()).hexdigest()


def assert_close(actual, expected, tol: float = TOL) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert abs(a - e) <= tol, (actual, expected)


# -- the app ------------------------------------------------------------------------------------------


def call(app, method: str, url: str, auth: bool = True, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {TOKEN}"} if auth else {}
    headers.update(kw.pop("headers", {}))

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.request(method, url, headers=headers, **kw)

    return asyncio.run(go())


@pytest.fixture(scope="module")
def app(service):
    return create_app(service)


def ask(app, questions: dict, state=STATE, model: str = "jev-latest", **extra) -> dict:
    response = call(
        app, "POST", "/v1/systemone", json={"model": model, "state": state, "questions": questions, **extra}
    )
    assert response.status_code == 200, response.text
    return response.json()


def native(question: dict) -> dict:
    """The question asked once, in the caller's order (no averaging)."""
    return {**question, "x_orderings": "none"}


def choice(n: int, tag: str = "d", **extra) -> dict:
    return {
        "type": "choice",
        "instructions": "Which queue should take this ticket?",
        "criteria": {f"name {i}": f"Queue {tag}{i} handles it." for i in range(n)},
        **extra,
    }


def assert_distribution(probabilities: dict) -> None:
    assert all(type(p) is float and 0.0 <= p <= 1.0 for p in probabilities.values())
    assert abs(sum(probabilities.values()) - 1) < 1e-9


# -- answers ------------------------------------------------------------------------------------------


def test_every_answer_type_comes_back_in_typesafes_shape_with_float_probabilities(app, service):
    body = ask(
        app,
        {
            "yes or no": {"type": "noul", "instructions": "Was the customer charged twice?"},
            "queue": {"type": "choice", "criteria": {"billing": "Billing problems.", "tech": None}},
            "urgency": {"type": "score", "criteria": ["low", "medium", {"level": "high"}]},
        },
    )
    identity = service.engine.identity
    assert body["model"] == f"{identity.source}@{identity.revision}"
    assert set(body["answers"]) == {"yes or no", "queue", "urgency"}
    assert body["usage"]["output_tokens"] == 0 and body["usage"]["input_tokens"] > 0
    noul, pick, score = body["answers"]["yes or no"], body["answers"]["queue"], body["answers"]["urgency"]
    assert noul["type"] == "noul" and type(noul["noul"]) is float and 0 < noul["noul"] < 1
    assert pick["type"] == "choice" and list(pick["probabilities"]) == ["billing", "tech"]
    assert_distribution(pick["probabilities"])
    assert pick["choice"] == max(pick["probabilities"], key=pick["probabilities"].get)
    assert score["type"] == "score" and score["legend"] == {
        "0": "low",
        "1": "medium",
        "2": '{"level": "high"}',
    }
    assert list(score["probabilities"]) == ["0", "1", "2"]
    assert_distribution(score["probabilities"])
    for answer in body["answers"].values():
        assert all(
            key in ("type", "noul", "choice", "score", "legend", "probabilities", "confidence")
            or key.startswith("x_")
            for key in answer
        )


@pytest.mark.parametrize("n", [5, 255])
def test_a_choice_equals_the_readout_of_a_plain_forward_of_its_prompt(app, engine, tokenizer, codes, n):
    question = choice(n)
    answer = ask(app, {"q": native(question)})["answers"]["q"]
    descriptions = list(question["criteria"].values())
    logits, probabilities, digest = plain_forward(
        engine, tokenizer, codes, STATE, question["instructions"], descriptions
    )
    assert answer["x_semif"]["prompt_sha256"] == digest
    assert_close(list(answer["x_semif"]["option_logits"].values()), logits)
    assert_close(list(answer["probabilities"].values()), probabilities)
    assert list(answer["probabilities"]) == list(question["criteria"])


def test_a_255_option_prompt_letters_past_z_with_two_letter_codes_skipping_split_ones(tokenizer, codes):
    assert len(codes) == 26 + 562
    assert [c for c, _ in codes[25:28]] == ["Z", "AA", "AB"]
    assert "BQ" not in [c for c, _ in codes]


def test_renaming_options_with_the_same_descriptions_changes_nothing(app):
    first = choice(4)
    renamed = {**first, "criteria": {f"其他 {i} 🙂": d for i, d in enumerate(first["criteria"].values())}}
    a = ask(app, {"q": native(first)})["answers"]["q"]
    b = ask(app, {"q": native(renamed)})["answers"]["q"]
    assert a["x_semif"]["prompt_sha256"] == b["x_semif"]["prompt_sha256"]
    assert_close(list(a["probabilities"].values()), list(b["probabilities"].values()), 0.0)
    assert list(b["probabilities"]) == list(renamed["criteria"])  # names back byte for byte


def test_a_null_description_puts_the_option_name_in_the_prompt_and_nothing_else_does(
    app, engine, tokenizer, codes
):
    question = {
        "type": "choice",
        "instructions": "Pick.",
        "criteria": {"refund": None, "other name": "Anything else."},
    }
    answer = ask(app, {"the id": native(question)})["answers"]["the id"]
    _, probabilities, digest = plain_forward(
        engine, tokenizer, codes, STATE, "Pick.", ["refund", "Anything else."]
    )
    assert answer["x_semif"]["prompt_sha256"] == digest
    assert_close(list(answer["probabilities"].values()), probabilities)


def test_question_ids_never_reach_the_prompt_or_change_the_answer(app):
    question = {"type": "noul", "instructions": "Was the customer charged twice?"}
    a = ask(app, {"a": question})["answers"]["a"]
    b = ask(app, {"the 질문 . id 🙂": question})["answers"]["the 질문 . id 🙂"]
    assert a["x_semif"]["prompt_sha256"] == b["x_semif"]["prompt_sha256"]
    assert abs(a["noul"] - b["noul"]) <= TOL


def test_one_request_of_many_questions_equals_each_question_asked_alone(app):
    questions = {
        "n": {"type": "noul", "instructions": {"claim": "charged twice", "question": "Is the claim true?"}},
        "c": choice(6),
        "s": {
            "type": "score",
            "instructions": "How urgent?",
            "criteria": ["low", "medium", "high", "critical"],
        },
        "c2": {"type": "choice", "criteria": {"yes": None, "no": None}},
    }
    together = ask(app, questions)["answers"]
    reordered = ask(app, dict(reversed(list(questions.items()))))["answers"]
    for qid, question in questions.items():
        alone = ask(app, {qid: question})["answers"][qid]
        for other in (together[qid], reordered[qid]):
            if "noul" in alone:
                assert abs(other["noul"] - alone["noul"]) <= TOL
            else:
                assert_close(list(other["probabilities"].values()), list(alone["probabilities"].values()))
                assert other["x_semif"]["prompt_sha256"] == alone["x_semif"]["prompt_sha256"]


def test_up_to_16_options_the_prompt_and_numbers_equal_decide(app):
    question = choice(16)
    answer = ask(app, {"q": native(question)})["answers"]["q"]
    decision = {
        "id": "q",
        "state": STATE,
        "question": question["instructions"],
        "options": [{"id": k, "description": v} for k, v in question["criteria"].items()],
    }
    result = call(app, "POST", "/decide", json=decision).json()
    assert answer["x_semif"]["prompt_sha256"] == result["prompt_sha256"]
    assert_close(list(answer["x_semif"]["option_logits"].values()), result["option_logits"])
    assert_close(list(answer["probabilities"].values()), result["probabilities"])
    rotated = ask(app, {"q": {**question, "x_orderings": "rotations"}})["answers"]["q"]
    combined = call(app, "POST", "/decide", json={**decision, "orderings": "rotations"}).json()["combined"]
    assert_close(
        list(rotated["probabilities"].values()), [combined["probabilities"][k] for k in question["criteria"]]
    )


def test_noul_is_true_then_false_with_default_wording_where_a_side_is_missing(app, engine, tokenizer, codes):
    body = ask(
        app,
        {
            "one sided": native(
                {"type": "noul", "instructions": "Refund?", "criteria": {"true": {"asks": "refund"}}}
            ),
            "bare": native({"type": "noul"}),
        },
    )["answers"]
    from semif_serve.service.methods.semif import DEFAULT_INSTRUCTIONS, DEFAULT_NOUL_CRITERIA

    _, p, digest = plain_forward(
        engine, tokenizer, codes, STATE, "Refund?", ['{"asks": "refund"}', DEFAULT_NOUL_CRITERIA["false"]]
    )
    assert body["one sided"]["x_semif"]["prompt_sha256"] == digest
    assert abs(body["one sided"]["noul"] - p[0]) <= TOL
    _, p, digest = plain_forward(
        engine, tokenizer, codes, STATE, DEFAULT_INSTRUCTIONS["noul"], list(DEFAULT_NOUL_CRITERIA.values())
    )
    assert body["bare"]["x_semif"]["prompt_sha256"] == digest
    assert abs(body["bare"]["noul"] - p[0]) <= TOL


def test_score_and_confidences_follow_the_reference_formulas(app):
    body = ask(
        app,
        {
            "s": {"type": "score", "criteria": [f"level {i}" for i in range(10)]},
            "c": choice(7),
        },
    )["answers"]
    p = list(body["s"]["probabilities"].values())
    n, k = len(p), max(range(10), key=lambda i: p[i])
    assert abs(body["s"]["score"] - sum(i * q for i, q in enumerate(p))) < 1e-12
    d = sum(abs(i - (n - 1) / 2) for i in range(n)) / n
    assert (
        abs(body["s"]["confidence"] - max(0.0, 1 - sum(q * abs(i - k) for i, q in enumerate(p)) / d)) < 1e-12
    )
    c = list(body["c"]["probabilities"].values())
    assert abs(body["c"]["confidence"] - (max(c) - 1 / 7) / (1 - 1 / 7)) < 1e-12


def test_the_default_policy_averages_each_type_over_its_orders_and_reports_them(app):
    body = ask(
        app,
        {
            "n": {"type": "noul", "instructions": "Refund?"},
            "c": choice(9),
            "s": {"type": "score", "criteria": ["a", "b", "c"]},
            "few": choice(3),
        },
    )["answers"]
    seen = {qid: (a["x_semif"]["orderings"], a["x_semif"]["rows"]) for qid, a in body.items()}
    assert seen == {"n": ("rotations", 2), "c": ("shifts", 4), "s": ("reversal", 2), "few": ("shifts", 3)}


def test_an_averaged_choice_is_the_log_mean_of_its_shifted_reads(app):
    question = choice(8)
    averaged = ask(app, {"q": question})["answers"]["q"]
    names = list(question["criteria"])
    sums = dict.fromkeys(names, 0.0)
    for start in (0, 2, 4, 6):  # four evenly spaced cyclic shifts of eight
        order = [names[(start + i) % 8] for i in range(8)]
        shifted = {**question, "criteria": {name: question["criteria"][name] for name in order}}
        read = ask(app, {"q": native(shifted)})["answers"]["q"]["x_semif"]["option_logits"]
        for name in names:
            sums[name] += read[name] / 4
    exps = {name: math.exp(v) for name, v in sums.items()}
    expected = [exps[name] / sum(exps.values()) for name in names]
    assert_close(list(averaged["probabilities"].values()), expected)


def test_usage_counts_the_shared_state_once(app, tokenizer, codes):
    questions = {"a": native(choice(3, "x")), "b": native(choice(4, "y"))}
    usage = ask(app, questions)["usage"]["input_tokens"]
    prompts = [
        tokenizer.encode(
            rendered(tokenizer, codes, STATE, q["instructions"], list(q["criteria"].values())),
            add_special_tokens=False,
        )
        for q in questions.values()
    ]
    shared = next(i for i, (x, y) in enumerate(zip(*prompts, strict=False)) if x != y)
    assert usage == shared + sum(len(p) - shared for p in prompts)
    assert usage < sum(len(p) for p in prompts)


# -- models -------------------------------------------------------------------------------------------


def test_models_lists_the_real_identity_then_the_aliases(app, service):
    body = call(app, "GET", "/v1/models").json()
    identity = service.engine.identity
    real, *aliases = body["models"]
    assert real["name"] == f"{identity.source}@{identity.revision}"
    assert len(real["release_date"]) == 10 and real["release_date"][4] == "-"
    assert real["x_max_options"] == 255 and real["x_answer_codes"] == 588
    assert [a["name"] for a in aliases] == ["jev-latest", "jev-preview"]
    assert all(
        k in ("name", "description", "release_date") or k.startswith("x_") for m in body["models"] for k in m
    )


@pytest.mark.parametrize("model", ["jev-latest", "jev-preview", "Qwen/Qwen3.5-4B@demo-random-weights-v3"])
def test_the_real_name_and_every_alias_are_served_and_answered_as_the_real_identity(app, model):
    body = ask(app, {"q": {"type": "noul"}}, model=model)
    assert body["model"] == "Qwen/Qwen3.5-4B@demo-random-weights-v3"


def test_an_unknown_model_is_400_api_usage_error(app):
    response = call(
        app,
        "POST",
        "/v1/systemone",
        json={"model": "gpt-9", "state": "s", "questions": {"q": {"type": "noul"}}},
    )
    assert response.status_code == 400
    assert response.json()["detail"]["error_type"] == "api_usage_error"
    assert "gpt-9" in response.json()["detail"]["message"]


def test_health_shows_the_answer_code_capacity_and_system_ones_limits(app):
    limits = call(app, "GET", "/health").json()["limits"]
    assert limits["answer_codes"] == 588 and limits["systemone_max_options"] == 255
    assert limits["systemone_max_input_tokens"] == 32768 and limits["max_input_tokens"] == 4096


# -- errors -------------------------------------------------------------------------------------------


def assert_validation(response, loc: list) -> dict:
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, list) and detail
    assert all(set(item) == {"loc", "msg", "type"} and item["loc"][0] == "body" for item in detail)
    assert detail[0]["loc"] == loc, detail
    return detail[0]


def post_body(app, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return call(app, "POST", "/v1/systemone", content=content)


BASE = {"model": "jev-latest", "state": "s"}


@pytest.mark.parametrize(
    "body, loc, words",
    [
        (
            {**BASE, "questions": {"q": {"type": "score", "criteria": {"0": "a", "1": "b"}}}},
            ["body", "questions", "q", "score", "criteria"],
            "map form",
        ),
        (
            {**BASE, "questions": {"q": choice(256)}},
            ["body", "questions", "q", "choice", "criteria"],
            "2 to 255",
        ),
        (
            {**BASE, "questions": {"q": choice(1)}},
            ["body", "questions", "q", "choice", "criteria"],
            "2 to 255",
        ),
        (
            {**BASE, "questions": {"q": {"type": "score", "criteria": list("abcdefghijk")}}},
            ["body", "questions", "q", "score", "criteria"],
            "2 to 10",
        ),
        ({**BASE, "questions": {}}, ["body", "questions"], "at least 1"),
        ({**BASE, "questions": {"": {"type": "noul"}}}, ["body", "questions"], "non-empty"),
        ({**BASE, "questions": {"q": {"type": "boolean"}}}, ["body", "questions", "q"], "tag"),
        ({"state": "s", "questions": {"q": {"type": "noul"}}}, ["body", "model"], "required"),
        ({**BASE, "state": 3, "questions": {"q": {"type": "noul"}}}, ["body", "state", "str"], "string"),
        (
            {**BASE, "questions": {"q": {"type": "noul", "criteria": {"maybe": "x"}}}},
            ["body", "questions", "q", "noul", "criteria", "maybe"],
            "Extra",
        ),
        (
            {
                **BASE,
                "questions": {"q": {"type": "score", "criteria": ["a", "b"], "x_orderings": "rotations"}},
            },
            ["body", "questions", "q", "score"],
            "not allowed for a score",
        ),
        (
            b'{"model": "jev-latest", "state": {"x": [NaN]}, "questions": {"q": {"type": "noul"}}}',
            ["body", "state"],
            "finite",
        ),
        (b"{not json", ["body"], "not valid JSON"),
    ],
    ids=[
        "map_score",
        "256_options",
        "1_option",
        "11_levels",
        "no_questions",
        "empty_id",
        "unknown_type",
        "no_model",
        "number_state",
        "noul_extra_side",
        "rotated_score",
        "nan_state",
        "bad_json",
    ],
)
def test_a_bad_request_is_422_in_fastapis_shape_naming_the_field(app, body, loc, words):
    item = assert_validation(post_body(app, body), loc)
    assert words in item["msg"], item


def test_unknown_top_level_fields_are_ignored(app):
    body = ask(app, {"q": {"type": "noul"}}, temperature=0.2, metadata={"a": 1})
    assert set(body) == {"model", "answers", "usage", "x_timing"}


def test_an_unknown_path_under_v1_is_404_in_typesafes_shape(app):
    response = call(app, "GET", "/v1/nothing")
    assert response.status_code == 404
    assert response.json()["detail"]["error_type"] == "not_found"


def test_a_wrong_method_on_v1_systemone_is_405_in_typesafes_shape(app):
    response = call(app, "GET", "/v1/systemone")
    assert response.status_code == 405
    assert set(response.json()["detail"]) == {"error_type", "message"}


# -- the operator's settings -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def operator_app(engine, checkpoint, tmp_path_factory):
    calibration = tmp_path_factory.mktemp("calibration") / "calibration.json"
    calibration.write_text(json.dumps({"grading": 2.0, "routing": {"single": 0.5, "shifts": 3.0}}))
    settings = make_settings(
        checkpoint,
        calibration=calibration,
        systemone_orderings="none",
        systemone_workloads="score=grading",
        systemone_max_input_tokens=300,
        systemone_allow_aliases=False,
    )
    return create_app(Service.start(settings, engine=engine))


def test_a_workload_temperature_applies_before_score_and_confidence(operator_app):
    answer = ask(
        operator_app,
        {"s": {"type": "score", "criteria": ["a", "b", "c", "d"]}},
        model="Qwen/Qwen3.5-4B@demo-random-weights-v3",
    )["answers"]["s"]
    logits = list(answer["x_semif"]["option_logits"].values())
    exps = [math.exp(v / 2.0) for v in logits]
    expected = [e / sum(exps) for e in exps]
    assert (answer["x_semif"]["workload"], answer["x_semif"]["temperature"]) == ("grading", 2.0)
    assert_close(list(answer["probabilities"].values()), expected, 1e-9)
    assert abs(answer["score"] - sum(i * p for i, p in enumerate(expected))) < 1e-9


def test_x_workload_and_x_orderings_override_the_operators_defaults(operator_app):
    answer = ask(
        operator_app,
        {"c": choice(6, x_orderings="shifts", x_workload="routing")},
        model="Qwen/Qwen3.5-4B@demo-random-weights-v3",
    )["answers"]["c"]
    semif = answer["x_semif"]
    assert (semif["orderings"], semif["rows"], semif["workload"], semif["temperature"]) == (
        "shifts",
        4,
        "routing",
        3.0,
    )


def test_policy_none_asks_every_type_once(operator_app):
    answers = ask(
        operator_app, {"n": {"type": "noul"}, "c": choice(5)}, model="Qwen/Qwen3.5-4B@demo-random-weights-v3"
    )["answers"]
    assert all(a["x_semif"]["rows"] == 1 and a["x_semif"]["orderings"] == "none" for a in answers.values())


def test_aliases_are_refused_when_the_operator_turns_them_off(operator_app):
    response = call(
        operator_app,
        "POST",
        "/v1/systemone",
        json={"model": "jev-latest", "state": "s", "questions": {"q": {"type": "noul"}}},
    )
    assert response.status_code == 400 and response.json()["detail"]["error_type"] == "api_usage_error"
    assert [m["name"] for m in call(operator_app, "GET", "/v1/models").json()["models"]] == [
        "Qwen/Qwen3.5-4B@demo-random-weights-v3"
    ]


def test_a_state_over_the_token_budget_is_413_with_the_need_never_a_5xx(operator_app):
    response = call(
        operator_app,
        "POST",
        "/v1/systemone",
        json={
            "model": "Qwen/Qwen3.5-4B@demo-random-weights-v3",
            "state": "word " * 400,
            "questions": {"first": {"type": "noul"}, "long one": {"type": "noul"}},
        },
    )
    assert response.status_code == 413, response.text
    detail = response.json()["detail"]
    assert detail["error_type"] == "request_too_large"
    assert "over the limit of 300" in detail["message"] and "question 'first'" in detail["message"]


def test_an_unknown_x_workload_is_400_naming_the_known_ones(operator_app):
    response = call(
        operator_app,
        "POST",
        "/v1/systemone",
        json={
            "model": "Qwen/Qwen3.5-4B@demo-random-weights-v3",
            "state": "s",
            "questions": {"q": {"type": "noul", "x_workload": "nope"}},
        },
    )
    assert response.status_code == 400
    assert "grading, routing" in response.json()["detail"]["message"]


def test_a_workload_map_naming_an_unknown_workload_stops_startup(engine, checkpoint):
    from semif_serve.domain.types import ConfigurationError

    with pytest.raises(ConfigurationError, match="SEMIF_SYSTEMONE_WORKLOADS: nope"):
        Service.start(make_settings(checkpoint, systemone_workloads="choice=nope"), engine=engine)
