"""System One's wire to the domain and back: each typed question (noul, choice, score; a box as
its four edge questions) as the core's questions, the rows a decoded request asks for, and the
core's outcomes as System One answers, timing and usage."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from semif_serve.domain.answers import (
    box_confidence,
    choice_confidence,
    expected_score,
    final_distribution,
    rows_needed,
    score_confidence,
)
from semif_serve.domain.boxes import DEFAULT_TARGET, EDGES, POSITIONS, edge_questions, read_box
from semif_serve.domain.orderings import (
    ANSWER_TYPES,
    CORE_ORDERINGS,
    NO_ORDERINGS,
)
from semif_serve.domain.prompt import PROMPT_VERSION
from semif_serve.domain.types import DecisionOutcome, Option, Question, QuestionOutcome
from semif_serve.doors.systemone.schemas import (
    BatchTimingBlock,
    BoxAnswer,
    BoxCoordinates,
    BoxEdge,
    BoxQuestion,
    ChoiceAnswer,
    ChoiceQuestion,
    NoulAnswer,
    NoulQuestion,
    Reading,
    ScoreAnswer,
    ScoreQuestion,
    SemIfBlock,
    SystemOneAnswer,
)

# The wording a question gets where the request leaves it out (fixed: answers stay reproducible).
DEFAULT_INSTRUCTIONS = {
    "noul": "Is the statement this question is about true of the evidence?",
    "choice": "Which option best fits the evidence?",
    "score": "Which level best fits the evidence?",
}
DEFAULT_NOUL_CRITERIA = {"true": "Yes, it is true.", "false": "No, it is false."}
NOUL_OPTIONS = ("true", "false")  # `true` in slot A


def as_text(value: Any) -> str:
    """Text as the model reads it: a string as is, structured data as JSON (insertion order kept)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class Policy:
    """The operator's defaults per answer type: orderings, and the calibration workload."""

    orderings: dict[str, str]
    workloads: dict[str, str]


def to_question(
    question_id: str, body: NoulQuestion | ChoiceQuestion | ScoreQuestion, policy: Policy
) -> Question:
    """One System One question as the core's domain question (option ids = names / "true" / "0")."""
    kind = body.type
    text = DEFAULT_INSTRUCTIONS[kind] if body.instructions is None else as_text(body.instructions)
    options: tuple[Option, ...]
    if isinstance(body, NoulQuestion):
        given = body.criteria.model_dump() if body.criteria is not None else {}
        options = tuple(
            Option(side, DEFAULT_NOUL_CRITERIA[side] if given.get(side) is None else as_text(given[side]))
            for side in NOUL_OPTIONS
        )
    elif isinstance(body, ChoiceQuestion):
        options = tuple(
            Option(name, name if description is None else as_text(description))
            for name, description in body.criteria.items()
        )
    else:
        options = tuple(Option(str(i), as_text(level)) for i, level in enumerate(body.criteria))
    mode = body.x_orderings or policy.orderings[kind]
    return Question(
        id=question_id,
        text=text,
        options=options,
        orderings=CORE_ORDERINGS[mode],
        workload=body.x_workload or policy.workloads.get(kind),
    )


def box_questions(question_id: str, body: BoxQuestion) -> tuple[Question, ...]:
    """A box question as its four edge questions (domain/boxes.py), in `EDGES` order: asked in
    the caller's `x_orderings` (`none` or `reversal`; no operator default), with its workload."""
    target = DEFAULT_TARGET if body.instructions is None else as_text(body.instructions)
    return edge_questions(
        question_id,
        target,
        orderings=CORE_ORDERINGS[body.x_orderings or NO_ORDERINGS],
        workload=body.x_workload,
    )


def core_questions(
    question_id: str, body: NoulQuestion | ChoiceQuestion | ScoreQuestion | BoxQuestion, policy: Policy
) -> tuple[Question, ...]:
    """The core's questions one System One question is asked as: four for a box, else one."""
    if isinstance(body, BoxQuestion):
        return box_questions(question_id, body)
    return (to_question(question_id, body, policy),)


def rows_asked(data: dict[str, Any], policy: Policy) -> int:
    """The rows a decoded (not yet validated) request asks for: each well-formed question's option
    count in its orderings (a box: its four edges'); what is malformed counts one row and is left
    to validation."""
    questions = data.get("questions")
    if not isinstance(questions, dict):
        return 0
    rows = 0
    for question in questions.values():
        kind = question.get("type") if isinstance(question, dict) else None
        if kind == "box":
            n, mode, asked = POSITIONS, question.get("x_orderings") or NO_ORDERINGS, len(EDGES)
        elif kind in ANSWER_TYPES:
            criteria = question.get("criteria")
            n = 2 if kind == "noul" else len(criteria) if isinstance(criteria, (dict, list)) else 0
            mode, asked = question.get("x_orderings") or policy.orderings[kind], 1
        else:
            rows += 1
            continue
        rows += rows_needed(n, mode, asked)
    return rows


def semif_block(answer: QuestionOutcome) -> SemIfBlock:
    """`x_semif`: the native readout of the caller's order, and how the answer was combined."""
    native = answer.readouts[0]
    combined = answer.combined
    calibrated = answer.calibrated
    return SemIfBlock(
        prompt_sha256=native.prompt_sha256,
        prompt_version=PROMPT_VERSION,
        input_tokens=native.input_tokens,
        option_logits=dict(zip(native.option_ids, native.option_logits, strict=True)),
        orderings=combined.mode if combined is not None else NO_ORDERINGS,
        rows=len(answer.readouts),
        agreement=combined.agreement if combined is not None else 1.0,
        workload=calibrated.workload if calibrated is not None else None,
        temperature=calibrated.temperature if calibrated is not None else None,
        readings=[
            Reading(
                order=list(r.option_ids),
                probabilities=dict(zip(r.option_ids, r.probabilities, strict=True)),
            )
            for r in answer.readouts
        ],
    )


def answer_body(kind: str, answer: QuestionOutcome) -> NoulAnswer | ChoiceAnswer | ScoreAnswer:
    """One System One answer from the core's outcome."""
    final = final_distribution(answer)
    if kind == "noul":
        return NoulAnswer(type="noul", noul=final.probabilities[0], x_semif=semif_block(answer))
    if kind == "choice":
        return ChoiceAnswer(
            type="choice",
            choice=final.top(),
            probabilities=final.by_id(),
            confidence=choice_confidence(final.probabilities),
            x_semif=semif_block(answer),
        )
    return ScoreAnswer(
        type="score",
        score=expected_score(final.probabilities),
        legend={o.id: o.description for o in answer.question.options},
        probabilities=final.by_id(),
        confidence=score_confidence(final.probabilities),
        x_semif=semif_block(answer),
    )


def box_answer(edges: Sequence[QuestionOutcome]) -> BoxAnswer:
    """A box answer from its four edge questions' outcomes (in `EDGES` order): each edge's final
    distribution read jointly with its side's other edge (the pair rule of domain/boxes.py)."""
    finals = [final_distribution(edge) for edge in edges]
    reading = read_box(*(final.probabilities for final in finals))
    return BoxAnswer(
        type="box",
        box=BoxCoordinates(top=reading.top, bottom=reading.bottom, left=reading.left, right=reading.right),
        confidence=box_confidence([reading.marginals[edge] for edge in EDGES]),
        x_edges={
            edge: BoxEdge(
                probabilities=final.by_id(),
                ordered=dict(zip(final.ids, reading.marginals[edge], strict=True)),
                x_semif=semif_block(outcome),
            )
            for edge, final, outcome in zip(EDGES, finals, edges, strict=True)
        },
    )


def answers_of(
    bodies: dict[str, NoulQuestion | ChoiceQuestion | ScoreQuestion | BoxQuestion],
    asked: Sequence[tuple[Question, ...]],
    outcomes: Sequence[QuestionOutcome],
) -> dict[str, SystemOneAnswer]:
    """Every System One answer by id from the core's outcomes, `asked[k]` being the core
    questions the k-th question was asked as (its outcomes follow in that order)."""
    answers: dict[str, SystemOneAnswer] = {}
    start = 0
    for (qid, body), questions in zip(bodies.items(), asked, strict=True):
        own = outcomes[start : start + len(questions)]
        start += len(questions)
        answers[qid] = box_answer(own) if isinstance(body, BoxQuestion) else answer_body(body.type, own[0])
    return answers


def timing_block(outcome: DecisionOutcome) -> BatchTimingBlock:
    """`x_timing`: how the batch ran (prefill fresh, extended or cached; merging) and the engine's seconds."""
    return BatchTimingBlock(
        **outcome.timing.as_dict(),
        forward_seconds=outcome.forward_seconds,
        total_seconds=outcome.total_seconds,
    )


def evaluated_tokens(outcome: DecisionOutcome) -> int:
    """Tokens the engine evaluated: the shared prefix once, plus every row's own suffix."""
    if not outcome.shared:
        return sum(r.input_tokens for q in outcome.questions for r in q.readouts)
    return outcome.timing.prefix_tokens + outcome.timing.true_suffix_tokens
