"""System One's pieces without HTTP: the bounded orderings, the operator's maps, the reference
formulas, and the answer-boundary check over every code a 255-option prompt uses."""

from __future__ import annotations

import itertools

import pytest

from semif_serve.domain.answers import (
    Distribution,
    choice_confidence,
    expected_score,
    final_distribution,
    rows_needed,
    score_confidence,
)
from semif_serve.domain.orderings import option_orders, orderings_policy, parse_type_map
from semif_serve.domain.prompt import PromptCodec
from semif_serve.domain.types import (
    Calibrated,
    Combined,
    ConfigurationError,
    Option,
    OrderingReadout,
    Question,
    QuestionOutcome,
)
from semif_serve.service.settings import load_settings


def cyclic(n: int, start: int) -> tuple[int, ...]:
    return tuple((start + i) % n for i in range(n))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_shifts_of_at_most_four_options_are_every_rotation(n):
    assert option_orders(n, "shifts") == option_orders(n, "rotations") == [cyclic(n, s) for s in range(n)]


@pytest.mark.parametrize("n, starts", [(5, [0, 1, 2, 3]), (8, [0, 2, 4, 6]), (255, [0, 63, 127, 191])])
def test_shifts_of_many_options_are_four_evenly_spaced_cyclic_shifts(n, starts):
    assert option_orders(n, "shifts") == [cyclic(n, s) for s in starts]


def test_reversal_asks_the_callers_order_and_its_reverse():
    assert option_orders(4, "reversal") == [(0, 1, 2, 3), (3, 2, 1, 0)]


def test_the_orderings_policy_names_every_type_and_leaves_the_rest_native():
    assert orderings_policy("none") == {"noul": "none", "choice": "none", "score": "none"}
    assert orderings_policy("choice=rotations") == {"noul": "none", "choice": "rotations", "score": "none"}
    assert orderings_policy(" noul = reversal , score=reversal ")["score"] == "reversal"


@pytest.mark.parametrize(
    "text, words",
    [
        ("score=rotations", "score=rotations is not allowed"),
        ("boolean=rotations", "'boolean' is not an answer type"),
        ("choice=shifts,choice=all", "'choice' appears more than once"),
        ("choice", "is not <type>=<value>"),
    ],
)
def test_a_bad_orderings_policy_is_refused_naming_the_variable(text, words):
    with pytest.raises(ConfigurationError, match="SEMIF_SYSTEMONE_ORDERINGS") as caught:
        load_settings(systemone_orderings=text)
    assert words in str(caught.value)


def test_the_workload_map_is_type_to_name():
    assert parse_type_map("choice=routing, score=grading") == {"choice": "routing", "score": "grading"}
    with pytest.raises(ConfigurationError, match="SEMIF_SYSTEMONE_WORKLOADS"):
        load_settings(systemone_workloads="choice")


def test_confidence_is_0_for_a_uniform_answer_and_1_for_a_certain_one():
    for n in (2, 5, 10):
        uniform = [1 / n] * n
        certain = [0.0] * (n - 1) + [1.0]
        assert abs(choice_confidence(uniform)) < 1e-12 and choice_confidence(certain) == 1.0
        assert score_confidence(certain) == 1.0
    assert score_confidence([0.5, 0.0, 0.0, 0.0, 0.5]) == 0.0  # mass at both ends: D = 1.2, spread 2
    assert expected_score([0.25, 0.25, 0.5]) == 1.25


def outcome(readouts, combined=None, calibrated=None) -> QuestionOutcome:
    options = tuple(Option(i, f"option {i}") for i in ("x", "y", "z"))
    return QuestionOutcome(Question("q", "Which?", options), tuple(readouts), combined, calibrated)


def test_the_final_distribution_is_calibrated_else_combined_else_the_native_read_in_the_callers_order():
    native = OrderingReadout(("x", "y", "z"), [0.0, 1.0, 2.0], [0.2, 0.3, 0.5], 10, "h")
    shuffled = OrderingReadout(("z", "x", "y"), [0.0, 1.0, 2.0], [0.1, 0.6, 0.3], 10, "h")
    combined = Combined("rotations", 2, {"z": 0.4, "x": 0.35, "y": 0.25}, "z", 0.5, 0.1)
    calibrated = Calibrated("w", 2.0, "rotations", [0.3, 0.3, 0.4])
    assert final_distribution(outcome([native])) == Distribution(("x", "y", "z"), (0.2, 0.3, 0.5))
    assert final_distribution(outcome([native, shuffled], combined)).by_id() == {
        "x": 0.35,
        "y": 0.25,
        "z": 0.4,
    }
    final = final_distribution(outcome([native, shuffled], combined, calibrated))
    assert (
        final.probabilities == (0.3, 0.3, 0.4)
        and final.top() == "z"
        and list(final.by_id()) == ["x", "y", "z"]
    )
    with pytest.raises(ValueError):
        Distribution(("x",), (0.5, 0.5))


@pytest.mark.parametrize("n", [2, 3, 4, 5, 21])
def test_rows_needed_counts_the_orders_each_mode_asks(n):
    assert rows_needed(n, "none") == 1 and rows_needed(n, "reversal", 4) == 8
    assert rows_needed(n, "rotations") == n and rows_needed(n, "shifts") == min(n, 4)
    # over 4 options "all" is left to validation: one row
    assert rows_needed(n, "all") == (len(list(itertools.permutations(range(n)))) if n <= 4 else 1)
    assert rows_needed(1, "rotations") == rows_needed(n, "sideways") == rows_needed(n, None) == 1


def test_the_boundary_check_over_255_codes_agrees_with_re_encoding_each_prompt(tokenizer):
    codec = PromptCodec(tokenizer)
    descriptions = [f"Option {i}." for i in range(255)]
    prompt = codec.encode_prompt({"k": "v"}, "Which?", descriptions, 32768)
    for code, slot in zip(codec.codes[:255], codec.slots[:255], strict=True):
        assert tokenizer.encode(prompt.text + code, add_special_tokens=False) == prompt.ids + [slot], code
    assert codec.capacity == 588 and codec.codes[:16] == tuple("ABCDEFGHIJKLMNOP")
