"""One request as lev serves it: its plan (one prefix, every question's rows in order) and its
readout (softmax with the bucket's temperature, orders averaged, the type's value; `model.py`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from semif_serve.domain.lev.calibration import LevCalibration
from semif_serve.domain.lev.prompt import render_prefix, render_suffix
from semif_serve.domain.lev.release import LevOptions
from semif_serve.domain.lev.routing import LevCodes, LevRoute, question_orders, route
from semif_serve.domain.lev.types import (
    BINARY_NOUL_OPTIONS,
    HEAD_FILE,
    RATING_LEVELS,
    RATING_TEXTS,
    LevAnswer,
    LevChoice,
    LevQuestion,
    LevScore,
    ModeBUnavailable,
    Order,
)
from semif_serve.domain.numerics import argmax, softmax


@dataclass(frozen=True)
class LevRow:
    """One forward row: the prefix (encoded with special tokens) then this suffix (without),
    joined as ids; read at the last token: `label_ids` (Mode A) or the head (Mode B)."""

    question_id: str
    order: Order
    suffix: str
    label_ids: tuple[int, ...] | None


@dataclass(frozen=True)
class LevPlan:
    """A request as lev serves it: one prefix, the rows of every question in request order."""

    prefix: str
    rows: tuple[LevRow, ...]
    questions: Mapping[str, LevQuestion]
    routes: Mapping[str, LevRoute]


def plan_request(
    state: Any,
    questions: Mapping[str, LevQuestion],
    codes: LevCodes,
    options: LevOptions,
    has_head: bool = True,
) -> LevPlan:
    """Route every question, choose its orders and render its rows; refuses Mode B without a head."""
    if codes.prefix != options.label_prefix:
        raise ValueError(
            f"codes were verified with prefix {codes.prefix!r}, the style reads {options.label_prefix!r}"
        )
    routes = {qid: route(q, codes, options) for qid, q in questions.items()}
    if not has_head:
        for qid, r in routes.items():
            if r.mode == "B":
                raise ModeBUnavailable(
                    f"question {qid!r} needs lev's candidate head ({r.reason}), and this release has no "
                    f"{HEAD_FILE}"
                )  # the message names the question: read whole
    rows = tuple(
        LevRow(
            qid,
            order,
            render_suffix(qid, q, routes[qid].codes, order, options.prompt_style),
            routes[qid].token_ids,
        )
        for qid, q in questions.items()
        for order in question_orders(q, routes[qid], options)
    )
    return LevPlan(render_prefix(state, options.prompt_style), rows, dict(questions), routes)


def average_orders(prob_rows: Sequence[Sequence[float]], orders: Sequence[Order]) -> list[float]:
    """Each order's probabilities put back in the caller's order, then their mean (lev averages
    probabilities, not logits)."""
    total = [0.0] * len(prob_rows[0])
    for probs, order in zip(prob_rows, orders, strict=True):
        for j, p in enumerate(probs):
            total[j if order is None else order[j]] += p
    return [t / len(prob_rows) for t in total]


def gini_confidence(probs: Sequence[float]) -> float:
    """lev's `confidence`: (K sum p^2 - 1) / (K - 1) (not System One's)."""
    k = len(probs)
    if k <= 1:
        return 1.0
    return (k * sum(p * p for p in probs) - 1.0) / (k - 1)


def read_question(
    question: LevQuestion,
    chosen: LevRoute,
    scores: Sequence[Sequence[float]],
    orders: Sequence[Order],
    calibration: LevCalibration,
) -> LevAnswer:
    """One question's answer from its rows' scores: each row's softmax(scores / T) with its
    bucket's temperature, averaged over the orders, then the type's value."""
    bucket_type = "noul_binary" if chosen.binary_noul else question.type
    bucket, temperature = calibration.temperature(bucket_type, chosen.mode, len(scores[0]))
    probs = average_orders([softmax(s, temperature) for s in scores], orders)
    value: float | str
    shown: tuple[float, ...] | None = tuple(probs)
    if isinstance(question, LevChoice):
        names = tuple(question.criteria)
        value = names[argmax(probs)]
    elif isinstance(question, LevScore):
        names = tuple(str(i) for i in range(len(probs)))
        value = sum(level * p for level, p in enumerate(probs))
    elif chosen.binary_noul:
        names, value, shown = BINARY_NOUL_OPTIONS, probs[0], None
    else:
        names = RATING_TEXTS
        value = sum((level / (RATING_LEVELS - 1)) * p for level, p in enumerate(probs))
    return LevAnswer(
        type=question.type,
        value=value,
        probabilities=shown,
        distribution=tuple(probs),
        names=names,
        lev_confidence=gini_confidence(probs),
        mode=chosen.mode,
        bucket=bucket,
        temperature=temperature,
        orders=len(orders),
    )


def read_plan(
    plan: LevPlan, row_scores: Sequence[Sequence[float]], calibration: LevCalibration
) -> dict[str, LevAnswer]:
    """Every question's answer, from one score list per row of `plan` (in row order)."""
    if len(row_scores) != len(plan.rows):
        raise ValueError(f"{len(plan.rows)} rows planned, {len(row_scores)} read")
    by_question: dict[str, tuple[list[Sequence[float]], list[Order]]] = {
        qid: ([], []) for qid in plan.questions
    }
    for row, scores in zip(plan.rows, row_scores, strict=True):
        by_question[row.question_id][0].append(scores)
        by_question[row.question_id][1].append(row.order)
    return {
        qid: read_question(q, plan.routes[qid], by_question[qid][0], by_question[qid][1], calibration)
        for qid, q in plan.questions.items()
    }
