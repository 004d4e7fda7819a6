"""SemIf's core: questions over a state -> prompt rows (one per ordering) -> the engine's
readouts -> typed outcomes (combined over orderings, calibrated). Its plug-in is
`service.methods.semif`; it knows nothing of HTTP."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from semif_serve.domain.calibration import CalibrationTable, calibrated_probabilities
from semif_serve.domain.orderings import combine, mean_option_logits, option_orders, order_count
from semif_serve.domain.types import (
    Calibrated,
    DecisionError,
    OrderingReadout,
    PromptRow,
    Question,
    QuestionOutcome,
    TooManyOptions,
    TooManyRows,
    UnknownWorkload,
    WorkloadOfAnotherModel,
)
from semif_serve.engine.rows import Readout


@dataclass(frozen=True)
class PlannedQuestion:
    """A question and the option orders it is asked in; its rows start at `first_row`."""

    question: Question
    orders: list[tuple[int, ...]]
    first_row: int


def plan_rows(
    questions: Sequence[Question],
    *,
    max_rows: int,
    max_options: int,
    calibration: CalibrationTable,
    model: str | None = None,
    base_name: str = "the base model",
) -> tuple[list[PlannedQuestion], list[PromptRow]]:
    """Expand every question into one row per ordering; refuse unknown workloads, workloads
    calibrated on another model than `model` (the adapter reading the request; None: the base,
    named `base_name`), too many options and row-cap breaches. Rows are counted before any is
    built, so a refusal costs nothing however many rows the request would need."""
    needed = 0
    for index, question in enumerate(questions):
        if len(question.options) > max_options:
            raise TooManyOptions(len(question.options), max_options, index)
        workload = question.workload
        if workload is not None and workload not in calibration:
            raise UnknownWorkload(workload, calibration.names(), index)
        if workload is not None and workload in calibration.models and calibration.models[workload] != model:
            calibrated = calibration.models[workload]
            raise WorkloadOfAnotherModel(workload, calibrated or base_name, model or base_name, index)
        needed += order_count(len(question.options), question.orderings)
    if needed > max_rows:
        raise TooManyRows(needed, max_rows)
    planned: list[PlannedQuestion] = []
    rows: list[PromptRow] = []
    for question in questions:
        orders = option_orders(len(question.options), question.orderings)
        planned.append(PlannedQuestion(question, orders, len(rows)))
        for order in orders:
            rows.append(PromptRow(question.text, tuple(question.options[i].description for i in order)))
    return planned, rows


def question_outcome(
    planned: PlannedQuestion, readout: Readout, calibration: CalibrationTable
) -> QuestionOutcome:
    """One question's typed outcome from the batch's readouts."""
    question = planned.question
    ids = [o.id for o in question.options]
    readouts = tuple(
        OrderingReadout(
            option_ids=tuple(ids[i] for i in order),
            option_logits=row.option_logits,
            probabilities=row.probabilities,
            input_tokens=row.input_tokens,
            prompt_sha256=row.prompt_sha256,
        )
        for order, row in zip(
            planned.orders,
            readout.rows[planned.first_row : planned.first_row + len(planned.orders)],
            strict=True,
        )
    )
    if question.orderings is None:
        calibrated = None
        if question.workload is not None:
            calibrated = _calibrated(calibration, question.workload, "single", readouts[0].option_logits)
        return QuestionOutcome(question, readouts, None, calibrated)
    logits = [r.option_logits for r in readouts]
    combined = combine(ids, planned.orders, logits, question.orderings)
    calibrated = None
    if question.workload is not None:
        mean = mean_option_logits(len(ids), planned.orders, logits)
        calibrated = _calibrated(calibration, question.workload, question.orderings, mean)
    return QuestionOutcome(question, readouts, combined, calibrated)


def _calibrated(
    calibration: CalibrationTable, workload: str, mode: str, logits: Sequence[float]
) -> Calibrated:
    temperature = calibration.temperature(workload, mode)
    return Calibrated(
        workload=workload,
        temperature=temperature.value,
        temperature_mode=temperature.source,
        probabilities=calibrated_probabilities(logits, temperature.value),
    )


def located(exc: DecisionError, planned: Sequence[PlannedQuestion]) -> DecisionError:
    """The error at the question of the engine's row position, a slot turned into the caller's option."""
    if exc.row is None:
        return exc
    for index, p in enumerate(planned):
        if p.first_row <= exc.row < p.first_row + len(p.orders):
            option = None if exc.option is None else p.orders[exc.row - p.first_row][exc.option]
            return exc.located(question=index, option=option)
    return exc
