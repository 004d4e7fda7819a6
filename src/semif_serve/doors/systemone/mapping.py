"""System One's wire to the domain and back, for whichever method reads the model a request
names: each typed question as an `AskedQuestion` (its text as sent), the rows a decoded request
asks for, a method's typed answers in the one wire shape of their type, and the timing and usage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from semif_serve.domain.orderings import ANSWER_TYPES
from semif_serve.domain.requests import AskedQuestion, Defaults
from semif_serve.doors.systemone.schemas import (
    ANSWERS,
    BatchTimingBlock,
    BoxQuestion,
    ChoiceQuestion,
    NoulQuestion,
    ScoreQuestion,
    SystemOneAnswer,
    Usage,
)
from semif_serve.service.methods import Decided, DecisionMethod, TypedAnswer, block_field

WireQuestion = NoulQuestion | ChoiceQuestion | ScoreQuestion | BoxQuestion


def asked_question(question_id: str, body: WireQuestion) -> AskedQuestion:
    """One System One question as the methods read it: its text and criteria as sent (a noul's
    criteria as the sides it sent), its `x_orderings` and `x_workload`, and their fields' names."""
    criteria: Any = None
    if isinstance(body, NoulQuestion):
        criteria = None if body.criteria is None else body.criteria.model_dump(exclude_unset=True)
    elif isinstance(body, (ChoiceQuestion, ScoreQuestion)):
        criteria = body.criteria
    where = f"questions.{question_id}"
    return AskedQuestion(
        id=question_id,
        type=body.type,
        instructions=body.instructions,
        criteria=criteria,
        orderings=body.x_orderings,
        workload=body.x_workload,
        fields={
            "type": f"{where}.type",
            "orderings": f"{where}.x_orderings",
            "workload": f"{where}.x_workload",
        },
    )


def asked_questions(bodies: dict[str, WireQuestion]) -> tuple[AskedQuestion, ...]:
    """Every question of a request, in its order."""
    return tuple(asked_question(qid, body) for qid, body in bodies.items())


def rows_asked(data: dict[str, Any], method: DecisionMethod, defaults: Defaults) -> int:
    """At least the rows a decoded (not yet validated) request asks of `method`: each well-formed
    question's rows by the method's count (`rows_for`); what is malformed counts one row and is
    left to validation."""
    questions = data.get("questions")
    if not isinstance(questions, dict):
        return 0
    rows = 0
    for question in questions.values():
        kind = question.get("type") if isinstance(question, dict) else None
        if kind != "box" and kind not in ANSWER_TYPES:
            rows += 1
            continue
        assert isinstance(question, dict)
        criteria = question.get("criteria")
        n = 2 if kind == "noul" else len(criteria) if isinstance(criteria, (dict, list)) else 0
        orderings = question.get("x_orderings")
        if orderings is not None and not isinstance(orderings, str):
            rows += 1  # malformed: left to validation
            continue
        asked = AskedQuestion("", kind, orderings=orderings)
        rows += method.rows_for(asked, n, defaults)
    return rows


def answer_body(answer: TypedAnswer, method: DecisionMethod) -> SystemOneAnswer:
    """A method's typed answer in its type's one wire shape, its block as `x_<method>`."""
    fields: dict[str, Any] = {"type": answer.type, **answer.fields}
    if answer.block is not None:
        fields[block_field(method)] = answer.block
    return ANSWERS[answer.type].model_validate(fields)


def answers_of(
    ids: Sequence[str], answers: Sequence[TypedAnswer], method: DecisionMethod
) -> dict[str, SystemOneAnswer]:
    """Every answer by question id, in the request's order."""
    return {qid: answer_body(answer, method) for qid, answer in zip(ids, answers, strict=True)}


def timing_block(decided: Decided) -> BatchTimingBlock:
    """`x_timing`: how the call's rows ran (prefill fresh, extended or cached; merging) and the
    engine's seconds."""
    return BatchTimingBlock(
        **decided.timing.as_dict(),
        forward_seconds=decided.forward_seconds,
        total_seconds=decided.total_seconds,
    )


def usage_of(decided: Decided) -> Usage:
    """`usage`: the tokens evaluated (the method's count; `cached_input_tokens` where it gives one)."""
    if decided.cached_input_tokens is None:
        return Usage(input_tokens=decided.input_tokens, output_tokens=0)
    return Usage(
        input_tokens=decided.input_tokens, output_tokens=0, cached_input_tokens=decided.cached_input_tokens
    )
