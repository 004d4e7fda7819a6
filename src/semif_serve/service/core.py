"""The decision core: questions over a state -> prompt rows -> the engine -> typed outcomes.

It knows nothing of HTTP. Every door (the native API, System One) calls `DecisionCore.decide`
with its own limits and maps the `DecisionError`s it raises to its own status and body.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from semif_serve.domain.calibration import CalibrationTable, calibrated_probabilities
from semif_serve.domain.orderings import combine, mean_option_logits, option_orders, order_count
from semif_serve.domain.requests import DecisionRequest, RowsRequest
from semif_serve.domain.types import (
    Calibrated,
    DecisionError,
    DecisionOutcome,
    OrderingReadout,
    PromptRow,
    Question,
    QuestionOutcome,
    ReplyTooLarge,
    TooManyOptions,
    TooManyRows,
    UnknownWorkload,
    WorkloadOfAnotherModel,
)
from semif_serve.engine.loader import ModelIdentity
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
    reply_bytes: int = 0,
    max_reply_bytes: int | None = None,
    model: str | None = None,
    base_name: str = "the base model",
) -> tuple[list[PlannedQuestion], list[PromptRow]]:
    """Expand every question into one row per ordering; refuse unknown workloads, workloads
    calibrated on another model than `model` (the adapter reading the request; None: the base,
    named `base_name`), too many options, row-cap breaches and a reply (`reply_bytes`, the
    door's count of it) over `max_reply_bytes` (None: no budget). Rows are counted before any
    is built, so a refusal costs nothing however many rows the request would need."""
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
    if max_reply_bytes is not None and reply_bytes > max_reply_bytes:
        raise ReplyTooLarge(reply_bytes, max_reply_bytes)
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


class Scorer(Protocol):
    """What the core needs of the engine side: the loaded model's facts, and one request's
    readout (`EngineWorker` over a `TorchEngine`; door and core tests may give a small fake)."""

    @property
    def model_info(self) -> dict[str, str]: ...

    @property
    def identity(self) -> ModelIdentity: ...

    @property
    def capacity(self) -> int: ...

    @property
    def reads_images(self) -> bool: ...

    async def score(self, request: RowsRequest) -> Readout:
        """The readouts of the request's rows, in order (raises `DecisionError`s naming a row)."""
        ...


class DecisionCore:
    """Answers questions over a state through one scorer (the engine's worker)."""

    def __init__(self, scorer: Scorer, calibration: CalibrationTable) -> None:
        self.scorer = scorer
        self.calibration = calibration
        # The loaded model's facts, read once: the `model` block, its identity, how many options
        # a question can have (the answer codes) and whether it reads images.
        self.model_info: dict[str, str] = scorer.model_info
        self.identity: ModelIdentity = scorer.identity
        self.capacity: int = scorer.capacity
        self.reads_images: bool = scorer.reads_images
        self.base_name = f"{self.identity.source}@{self.identity.revision}"

    async def decide(self, request: DecisionRequest) -> DecisionOutcome:
        """Ask every question (in every ordering) over the request's state in one engine batch
        (merged with other requests queued at the same time; the numbers are those of the call
        alone).

        `shared=True` runs the shared-prefix path even for one row; otherwise a single row runs
        SemIf's plain forward and several rows the shared path. `limits.max_request_tokens`
        (None: no budget) bounds the state's tokens plus every row's tokens after it. Raises a
        `DecisionError` that names the question (and option, in the caller's order) it concerns
        by position. Planning runs off the event loop (it is linear in the rows' text).
        The request's images (each with its placeholder) are shown where their placeholders
        stand, in the state and in the questions; they need `reads_images`. `reply_bytes` is the
        caller's count of its reply, refused over `limits.max_reply_bytes` (None: no budget)
        before any engine work.
        """
        limits = request.limits
        planned, rows = await asyncio.to_thread(
            plan_rows,
            request.questions,
            max_rows=limits.max_rows,
            max_options=limits.max_options,
            calibration=self.calibration,
            reply_bytes=request.reply_bytes,
            max_reply_bytes=limits.max_reply_bytes,
            model=request.model,
            base_name=self.base_name,
        )
        try:
            readout = await self.scorer.score(request.with_rows(rows))
        except DecisionError as exc:
            raise _located(exc, planned) from exc
        return DecisionOutcome(
            questions=tuple(question_outcome(p, readout, self.calibration) for p in planned),
            shared=readout.shared,
            forward_seconds=readout.forward_seconds,
            total_seconds=readout.total_seconds,
            timing=readout.timing,
            wait=readout.wait,
        )


def _located(exc: DecisionError, planned: Sequence[PlannedQuestion]) -> DecisionError:
    """The error at the question of the engine's row position, a slot turned into the caller's option."""
    if exc.row is None:
        return exc
    for index, p in enumerate(planned):
        if p.first_row <= exc.row < p.first_row + len(p.orders):
            option = None if exc.option is None else p.orders[exc.row - p.first_row][exc.option]
            return exc.located(question=index, option=option)
    return exc
