"""A third decision method, defined here and nowhere else, served with no change under `src/`:
yes-logit minus no-logit. P(yes) of a binary question is the sigmoid of the margin between the
logits of " yes" and " no" after one prompt over the base (a noul on System One; a decision of
two options on the native door, its first option the yes).

`YesMinusNo` is registered the way an operator registers one (SEMIF_METHODS, `module:Class`) and
served by SEMIF_MODELS' `method = "yes-no"`; it is asked through both doors, `/v1/models` and
run-batch in a child process, and compared with a plain full forward of the same prompt through
transformers' own class. The guarantee tests over every served model run over it too
(tests/support/served_models.py names it).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest
from pydantic import BaseModel

from semif_serve.app import create_app
from semif_serve.domain.requests import OPTIONS, AskedQuestion, as_text
from semif_serve.domain.tokens import BoundedEncoder, PastLimit
from semif_serve.domain.types import (
    DecisionError,
    DecisionOutcome,
    NotRead,
    Option,
    OrderingReadout,
    Question,
    QuestionOutcome,
    TooManyOptions,
    TooManyRows,
    TooManyTokens,
)
from semif_serve.engine.rows import RowsJob
from semif_serve.engine.state_cache import state_digest
from semif_serve.service.methods import Ask, Decided, MethodStart, Served, TypedAnswer, one_read
from semif_serve.service.models import EntryPlace, ModelEntry
from semif_serve.service.reply_size import FLOAT_BYTES, INT_BYTES, object_bytes
from tests.support import TOKEN, in_process_client, make_settings
from tests.support.batch import child_env, line
from tests.support.served_models import THIRD_METHOD, serving

NAME = "yes-no"
PLUG_IN = f"{__name__}:YesMinusNo"
DEFAULT_QUESTION = "Is the statement true of the evidence?"
ANSWER = "\nAnswer yes or no:"


class YesNoBlock(BaseModel):
    """`x_yes_no`: the margin logit(" yes") - logit(" no"), and the rows read (one)."""

    margin: float
    rows: int


@functools.cache
def answer_ids(tokenizer: Any) -> tuple[int, int]:
    """The single tokens " yes" and " no" (a tokenizer that splits either cannot serve the method)."""
    ids = [tokenizer.encode(word, add_special_tokens=False) for word in (" yes", " no")]
    assert all(len(one) == 1 for one in ids), ids
    return ids[0][0], ids[1][0]


def evidence(state: Any) -> str:
    """The prompt's head: the state as text."""
    return f"Evidence: {as_text(state)}\n"


def question_text(asked: AskedQuestion) -> str:
    """The prompt's tail for one question: its text, what yes and no mean, and the cue."""
    if asked.type == OPTIONS:
        yes, no = (option.description for option in asked.criteria)
        text = asked.instructions
    else:
        sides = asked.criteria or {}
        yes, no = sides.get("true"), sides.get("false")
        text = DEFAULT_QUESTION if asked.instructions is None else as_text(asked.instructions)
    meaning = "" if yes is None and no is None else f"\n(yes: {as_text(yes)}; no: {as_text(no)})"
    return f"Question: {text}{meaning}{ANSWER}"


class YesMinusNo:
    """P(yes) = sigmoid(logit(" yes") - logit(" no")), one row per question over the base."""

    name: ClassVar[str] = NAME
    answers: ClassVar[tuple[str, ...]] = ("noul", OPTIONS)
    images: ClassVar[bool] = False
    workloads: ClassVar[bool] = False
    noun: ClassVar[str] = "a yes-minus-no model"
    claims: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tokenizer: Any) -> None:
        self.encoder = BoundedEncoder(tokenizer)
        self.columns = answer_ids(tokenizer)

    @classmethod
    def read_entry(cls, name: str, table: Mapping[str, Any], place: EntryPlace) -> ModelEntry:
        place.allow(table, ("method",), "a yes-minus-no model")
        return ModelEntry(name, cls.name)

    @classmethod
    def start(cls, entries: Sequence[ModelEntry], context: MethodStart) -> YesMinusNo:
        return cls(context.engine.codec.tokenizer)

    def rows_for(self, asked: AskedQuestion, options: int, defaults: Any) -> int:
        return 1

    def plan(self, ask: Ask) -> tuple[Ask, list[int], list[list[int]]]:
        for index, question in enumerate(ask.questions):
            for part in ("orderings", "workload"):
                if getattr(question, part) is not None:
                    field = question.fields.get(part, part)
                    raise NotRead(field, "the yes-minus-no model reads each question once, uncalibrated")
            if question.type == OPTIONS and len(question.criteria) != 2:
                raise TooManyOptions(len(question.criteria), 2, index)
        limits = ask.limits
        if len(ask.questions) > limits.max_rows:
            raise TooManyRows(len(ask.questions), limits.max_rows)
        try:
            prefix = self.encoder.encode(evidence(ask.state), limits.max_input_tokens)
        except PastLimit as past:
            raise TooManyTokens(past.tokens, limits.max_input_tokens, 0, at_least=True) from None
        suffixes, total = [], len(prefix)
        for index, question in enumerate(ask.questions):
            room = limits.max_input_tokens - len(prefix)
            try:
                suffix = self.encoder.encode(question_text(question), room)
            except PastLimit as past:
                raise TooManyTokens(
                    len(prefix) + past.tokens, limits.max_input_tokens, index, at_least=True
                ) from None
            suffixes.append(suffix)
            total += len(suffix)
            budget = limits.max_request_tokens
            if budget is not None and total > budget:
                raise TooManyTokens.for_request(total, budget, index + 1, len(ask.questions))
        return ask, prefix, suffixes

    def jobs(self, plan: Any, engine: Any) -> list[RowsJob]:
        ask, prefix, suffixes = plan
        prepare = functools.partial(
            engine.prepare_ids, prefix, suffixes, [self.columns] * len(suffixes), adapter=ask.served.adapter
        )
        return [RowsJob(state_digest(ask.state, (), ask.served.name), prepare)]

    def located(self, plan: Any, error: DecisionError) -> DecisionError:
        return error

    def outcome(self, plan: Any, readouts: Sequence[Any]) -> Decided:
        ask, prefix, suffixes = plan
        readout = readouts[0]
        margins = [row.option_logits[0] - row.option_logits[1] for row in readout.rows]
        yes = [1 / (1 + math.exp(-m)) for m in margins]
        typed = all(q.type != OPTIONS for q in ask.questions)
        answers = tuple(
            TypedAnswer("noul", {"noul": p}, YesNoBlock(margin=m, rows=1))
            for p, m in zip(yes, margins, strict=True)
        )
        outcomes = tuple(
            QuestionOutcome(
                Question(q.id, q.instructions, tuple(q.criteria)),
                (
                    OrderingReadout(
                        option_ids=tuple(o.id for o in q.criteria),
                        option_logits=list(row.option_logits),
                        probabilities=[p, 1 - p],
                        input_tokens=len(prefix) + len(suffix),
                        prompt_sha256=hashlib.sha256(json.dumps([*prefix, *suffix]).encode()).hexdigest(),
                    ),
                ),
                None,
                None,
            )
            for q, row, p, suffix in zip(ask.questions, readout.rows, yes, suffixes, strict=True)
            if q.type == OPTIONS
        )
        decision = DecisionOutcome(
            outcomes,
            readout.shared,
            readout.forward_seconds,
            readout.total_seconds,
            readout.timing,
            readout.wait,
        )
        tokens = len(prefix) + sum(map(len, suffixes))
        return Decided(
            answers=answers if typed else None,
            outcome=None if typed else decision,
            input_tokens=tokens,
            rows=len(suffixes),
            counted_tokens=tokens,
            batch=readout.timing,
            **one_read(readout),
        )

    def answer_sizes(self, plan: Any, index: int) -> dict[str, int]:
        block = object_bytes(YesNoBlock, {"margin": FLOAT_BYTES, "rows": INT_BYTES})
        return {"noul": FLOAT_BYTES, "x_yes_no": block}

    def listing(self, served: Served) -> dict[str, Any]:
        return {
            "description": f"{served.name}: P(yes) = sigmoid(logit(' yes') - logit(' no')); a row each.",
            "x_method": self.name,
            "x_max_options": 2,
            "x_reads_images": False,
        }

    def reply_remedy(self) -> str:
        return "ask fewer questions, shorten their ids, or split it across requests"


# -- the oracle: a plain full forward of the same prompt -------------------------------------------


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The checkpoint as transformers' own causal LM loads it (float32, on the CPU)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype="float32").eval()


def margin_by_hand(reference, tokenizer, state: Any, asked: AskedQuestion) -> float:
    """logit(" yes") - logit(" no") at the end of the whole prompt, in one plain forward."""
    import torch

    ids = tokenizer.encode(evidence(state), add_special_tokens=False)
    ids += tokenizer.encode(question_text(asked), add_special_tokens=False)
    with torch.no_grad():
        logits = reference(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
    yes, no = answer_ids(tokenizer)
    return float(logits[yes] - logits[no])


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# -- served --------------------------------------------------------------------------------------


STATE = "The deploy of release 41 finished; health checks passed in two of three zones."


@pytest.fixture(scope="module")
def service(engine, checkpoint, served_models):
    with serving(engine, checkpoint, served_models) as started:
        yield started


@pytest.fixture(scope="module")
def client(service):
    return in_process_client(create_app(service))


def test_the_method_is_registered_from_its_import_path_and_serves_the_models_file_entry(service):
    served = service.models.resolve(NAME)
    assert served is not None and type(served.method) is YesMinusNo
    assert served.method.name == NAME and served.entry.method == NAME
    assert service.settings.methods == [PLUG_IN]


def test_a_noul_on_system_one_is_the_sigmoid_of_the_margin_a_plain_forward_gives(
    client, reference, tokenizer
):
    questions = {
        "ok": {"type": "noul", "instructions": "Did the deploy succeed?"},
        "zones": {"type": "noul", "criteria": {"true": "All zones passed.", "false": "A zone failed."}},
    }
    reply = client.post("/v1/systemone", json={"model": NAME, "state": STATE, "questions": questions})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["model"] == NAME
    for qid, question in questions.items():
        asked = AskedQuestion(qid, "noul", question.get("instructions"), question.get("criteria"))
        want = margin_by_hand(reference, tokenizer, STATE, asked)
        answer = body["answers"][qid]
        assert list(answer) == ["type", "noul", "x_yes_no"]
        assert answer["x_yes_no"]["margin"] == pytest.approx(want, abs=1e-4)
        assert answer["noul"] == pytest.approx(sigmoid(want), abs=1e-5)
    tokens = len(tokenizer.encode(evidence(STATE), add_special_tokens=False)) + sum(
        len(
            tokenizer.encode(
                question_text(AskedQuestion(q, "noul", b.get("instructions"), b.get("criteria")))
            )
        )
        for q, b in questions.items()
    )
    assert body["usage"] == {"input_tokens": tokens, "output_tokens": 0}


def test_a_two_option_decision_on_the_native_door_reads_the_same_margin(client, reference, tokenizer):
    options = [{"id": "up", "description": "It is up."}, {"id": "down", "description": "It is down."}]
    body = {"state": STATE, "id": "d", "question": "Is the service up?", "options": options, "model": NAME}
    reply = client.post("/decide", json=body)
    assert reply.status_code == 200, reply.text
    result = reply.json()
    asked = AskedQuestion(
        "d", OPTIONS, body["question"], tuple(Option(o["id"], o["description"]) for o in options)
    )
    want = margin_by_hand(reference, tokenizer, STATE, asked)
    yes, no = result["option_logits"]
    assert yes - no == pytest.approx(want, abs=1e-4)
    assert result["option_ids"] == ["up", "down"]
    assert result["probabilities"][0] == pytest.approx(sigmoid(want), abs=1e-5)
    assert result["model"]["adapter"] == NAME


def test_models_lists_the_method_under_its_name(client):
    listed = {m["name"]: m for m in client.get("/v1/models").json()["models"]}
    assert listed[NAME]["x_method"] == NAME
    assert listed[NAME]["x_max_options"] == 2
    assert "x_adapter" not in listed[NAME]  # it reads the base weights alone


@pytest.mark.parametrize(
    ("question", "status", "field"),
    [
        ({"type": "noul", "x_orderings": "reversal"}, 400, "questions.q.x_orderings"),
        ({"type": "choice", "criteria": {"a": None, "b": None}}, 400, "questions.q.type"),
        ({"type": "score", "criteria": ["low", "high"]}, 400, "questions.q.type"),
    ],
)
def test_what_the_method_does_not_read_is_refused_naming_the_field(client, question, status, field):
    reply = client.post("/v1/systemone", json={"model": NAME, "state": STATE, "questions": {"q": question}})
    assert reply.status_code == status, reply.text
    assert reply.json()["detail"]["message"].startswith(f"{field}: ")


def test_a_native_decision_of_three_options_is_refused_before_any_forward(client):
    options = [{"id": k, "description": k} for k in ("a", "b", "c")]
    body = {"state": STATE, "id": "d", "question": "Which?", "options": options, "model": NAME}
    reply = client.post("/decide", json=body)
    assert reply.status_code == 422, reply.text
    assert "3 options, over the limit of 2" in reply.json()["error"]["message"]


def test_run_batch_in_a_child_process_serves_the_method_from_its_settings(
    checkpoint, served_models, tmp_path
):
    lines = [
        line("s1", "/v1/systemone", {"model": NAME, "state": STATE, "questions": {"ok": {"type": "noul"}}}),
        line(
            "native",
            "/decide",
            {
                "state": STATE,
                "id": "d",
                "question": "Is it up?",
                "model": NAME,
                "options": [{"id": "y", "description": "Yes."}, {"id": "n", "description": "No."}],
            },
        ),
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    env = child_env(
        SEMIF_MODEL_PATH=str(checkpoint),
        SEMIF_MODEL_REVISION=make_settings(checkpoint).model_revision,
        SEMIF_MODELS=str(served_models),
        SEMIF_METHODS=PLUG_IN,
        SEMIF_DEVICE="cpu",
        SEMIF_API_TOKEN=TOKEN,
    )
    done = subprocess.run(
        ["semif-serve", "run-batch", "-i", str(source), "-o", str(out)],
        env=env,
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = {r["custom_id"]: r["response"] for r in map(json.loads, out.read_text().splitlines())}
    assert results["s1"]["status_code"] == 200, results["s1"]
    assert results["s1"]["body"]["answers"]["ok"]["x_yes_no"]["rows"] == 1
    assert results["native"]["status_code"] == 200, results["native"]
    assert results["native"]["body"]["model"]["adapter"] == NAME


def test_the_method_lives_in_this_file_alone_and_src_names_it_nowhere():
    src = Path(__file__).parents[2] / "src"
    for path in src.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert "YesMinusNo" not in text and '"yes-no"' not in text, path


def test_the_shared_list_of_served_models_names_the_method():
    assert THIRD_METHOD.model == NAME and THIRD_METHOD.method == NAME
