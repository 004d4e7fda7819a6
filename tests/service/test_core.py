"""SemIf's core, asked through `Service.decide`: typed outcomes, per-call limits, and errors that
name positions, not statuses."""

from __future__ import annotations

import pytest

from semif_serve.domain.calibration import CalibrationTable
from semif_serve.domain.numerics import softmax
from semif_serve.domain.requests import Limits
from semif_serve.domain.types import (
    AnswerBoundary,
    Option,
    Question,
    TooManyOptions,
    TooManyRows,
    TooManyTokens,
    UnknownWorkload,
)
from semif_serve.service.core import located, plan_rows
from tests.support.asking import outcome_now

YES_NO = (Option("yes", "It succeeded."), Option("no", "It failed."))
THREE = (Option("a", "First."), Option("b", "Second."), Option("c", "Third."))


def decide(service, questions, shared=True, **limits):
    values = {"max_input_tokens": 4096, "max_options": 16, "max_rows": 64, **limits}
    return outcome_now(service, "All zones are healthy.", questions, Limits(**values), shared=shared)


def test_an_outcome_holds_every_ordering_its_combination_and_the_batch_timing(service):
    question = Question("q", "Which one?", THREE, orderings="rotations")
    outcome = decide(service, [Question("p", "Did it succeed?", YES_NO), question])
    single, rotated = outcome.questions
    assert len(single.readouts) == 1 and single.combined is None
    assert [r.option_ids for r in rotated.readouts] == [("a", "b", "c"), ("b", "c", "a"), ("c", "a", "b")]
    assert outcome.timing is not None and outcome.timing.batch_size == 4
    for readout in rotated.readouts:
        assert readout.probabilities == pytest.approx(softmax(readout.option_logits), abs=1e-6)
    assert rotated.combined is not None and rotated.combined.top in {"a", "b", "c"}


def test_the_token_limit_is_a_per_call_parameter_and_the_error_names_the_question(service):
    long = Question("long", "Which? " + "the of and to in " * 60, YES_NO, orderings="rotations")
    questions = [Question("short", "Did it recover?", YES_NO), long]
    assert decide(service, questions, max_input_tokens=4096).questions[1].question.id == "long"
    with pytest.raises(TooManyTokens) as caught:
        decide(service, questions, max_input_tokens=200)
    assert (caught.value.question, caught.value.limit) == (1, 200)


def test_plan_rows_refuses_by_position_too_many_options_rows_and_unknown_workloads():
    table = CalibrationTable({"tickets": {"single": 1.5}})
    with pytest.raises(TooManyOptions) as options:
        plan_rows(
            [Question("a", "q", YES_NO), Question("b", "q", THREE)],
            max_rows=64,
            max_options=2,
            calibration=table,
        )
    assert (options.value.question, options.value.options, options.value.limit) == (1, 3, 2)
    with pytest.raises(TooManyRows) as rows:
        plan_rows([Question("a", "q", THREE, orderings="all")], max_rows=5, max_options=16, calibration=table)
    assert (rows.value.rows, rows.value.limit) == (6, 5)
    with pytest.raises(UnknownWorkload) as workload:
        plan_rows(
            [Question("a", "q", YES_NO, workload="nope")], max_rows=64, max_options=16, calibration=table
        )
    assert workload.value.question == 0 and workload.value.known == ["tickets"]


def test_a_boundary_error_in_a_rotated_row_names_the_callers_question_and_option():
    table = CalibrationTable({})
    questions = [Question("a", "q", YES_NO), Question("b", "q", THREE, orderings="rotations")]
    planned, _ = plan_rows(questions, max_rows=64, max_options=16, calibration=table)
    error = AnswerBoundary("A", option=0).located(row=3)  # question b, ordering (2, 0, 1): slot A is option 2
    placed = located(error, planned)
    assert (placed.question, placed.option) == (1, 2)
    assert (error.question, error.option) == (None, 0)  # the engine's error is left as it was built
