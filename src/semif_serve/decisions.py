"""From validated questions to engine rows, and from engine scores to SemIf result dicts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .calibration import CalibrationTable, calibrated_probabilities
from .engine import DIRECT_READOUT, SHARED_READOUT, SHARED_SERVING_CONFIG, BatchScore, Row, RowScore
from .errors import invalid
from .orderings import combine, mean_option_logits, option_orders
from .prompt import PROMPT_VERSION
from .requests import Question

PROBABILITY_STATUS = "conditional option score; uncalibrated as decision confidence"


@dataclass(frozen=True)
class PlannedQuestion:
    """A question and the option orders it is asked in; its rows start at `first_row`."""

    question: Question
    orders: list[tuple[int, ...]]
    first_row: int
    field: str


def plan_rows(
    questions: Sequence[Question], fields: Sequence[str], max_rows: int, calibration: CalibrationTable
) -> tuple[list[PlannedQuestion], list[Row]]:
    """Expand every question into one row per ordering; refuse unknown workloads and row-cap breaches."""
    planned: list[PlannedQuestion] = []
    rows: list[Row] = []
    for question, field in zip(questions, fields, strict=True):
        if question.workload is not None and question.workload not in calibration:
            known = ", ".join(calibration.names()) or "none are configured"
            raise invalid(
                f"{field}.workload" if field else "workload",
                f"unknown workload {question.workload!r}; known workloads: {known}",
                code="unknown_workload",
            )
        orders = option_orders(len(question.options), question.orderings)
        planned.append(PlannedQuestion(question, orders, len(rows), field))
        for order in orders:
            descriptions = tuple(question.options[i].description for i in order)
            rows.append(Row(question.question, descriptions, field or "state"))
    if len(rows) > max_rows:
        raise invalid(
            "decisions" if len(questions) > 1 or fields[0] else "orderings",
            f"the request needs {len(rows)} rows (decisions x orderings), over the limit of "
            f"{max_rows}; split it across requests",
            code="too_many_rows",
        )
    return planned, rows


def semif_result(
    decision_id: str, option_ids: list[str], score: RowScore, batch: BatchScore, model: dict[str, Any]
) -> dict[str, Any]:
    """SemIf's result dict for one row, keys in upstream's order."""
    if batch.shared:
        model = {**model, "serving_config": SHARED_SERVING_CONFIG}
    return {
        "id": decision_id,
        "option_ids": option_ids,
        "probabilities": score.probabilities,
        "option_logits": score.option_logits,
        "input_tokens": score.input_tokens,
        "forward_seconds": batch.forward_seconds,
        "total_seconds": batch.total_seconds,
        "prompt_sha256": score.prompt_sha256,
        "prompt_version": PROMPT_VERSION,
        "model": model,
        "readout": SHARED_READOUT if batch.shared else DIRECT_READOUT,
        "probability_status": PROBABILITY_STATUS,
    }


def _calibrated(
    calibration: CalibrationTable,
    workload: str,
    mode: str,
    logits: Sequence[float],
    option_ids: list[str] | None,
) -> dict[str, Any]:
    temperature = calibration.temperature(workload, mode)
    probs = calibrated_probabilities(logits, temperature.value)
    return {
        "workload": workload,
        "temperature": temperature.value,
        "temperature_mode": temperature.source,
        "probabilities": dict(zip(option_ids, probs, strict=True)) if option_ids else probs,
    }


def build_result(
    planned: PlannedQuestion, batch: BatchScore, model: dict[str, Any], calibration: CalibrationTable
) -> dict[str, Any]:
    """One decision's reply: the native result for the caller's order, plus orderings/combined/calibrated."""
    question = planned.question
    ids = [o.id for o in question.options]
    natives = []
    for k, order in enumerate(planned.orders):
        score = batch.rows[planned.first_row + k]
        natives.append(semif_result(question.id, [ids[i] for i in order], score, batch, model))
    result = dict(natives[0])
    if question.orderings is None:
        if question.workload is not None:
            result["calibrated"] = _calibrated(
                calibration, question.workload, "single", natives[0]["option_logits"], None
            )
        return result
    logits = [n["option_logits"] for n in natives]
    combined = combine(ids, planned.orders, logits, question.orderings)
    if question.workload is not None:
        mean = mean_option_logits(len(ids), planned.orders, logits)
        combined["calibrated"] = _calibrated(calibration, question.workload, question.orderings, mean, ids)
    result["orderings"] = natives
    result["combined"] = combined
    return result
