"""Box questions in the domain (domain/boxes.py): the four edge questions a box becomes, and the
pair rule that reads each side's two edges jointly, against a brute-force expectation over the
ordered pairs written out with numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from semif_serve.domain.boxes import (
    EDGES,
    FLOOR,
    POSITIONS,
    edge_questions,
    positions,
    read_box,
    read_pair,
)

GRID = [i / 20 for i in range(21)]  # 0, 0.05, ..., 1, written out


def brute_force_pair(p, q, x=GRID) -> tuple[float, float, np.ndarray, np.ndarray]:
    """E[x_i], E[x_j] under p_i q_j restricted to i < j and renormalised: the joint as a matrix."""
    joint = np.triu(np.outer(np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)), k=1)
    joint /= joint.sum()
    low, high = joint.sum(axis=1), joint.sum(axis=0)
    return float(low @ np.asarray(x)), float(high @ np.asarray(x)), low, high


def normalised(weights: list[float]) -> list[float]:
    total = math.fsum(weights)
    return [w / total for w in weights]


# Random readings over 21 positions: positive weights spanning many orders of magnitude.
reading = st.lists(
    st.floats(min_value=1e-12, max_value=1.0, allow_nan=False), min_size=POSITIONS, max_size=POSITIONS
).map(normalised)
# Anything a float64 softmax can give, exact zeros (underflow) and one-hot readings included.
any_reading = (
    st.lists(
        st.one_of(st.just(0.0), st.floats(min_value=0.0, max_value=1.0, allow_nan=False)),
        min_size=POSITIONS,
        max_size=POSITIONS,
    )
    .filter(lambda w: math.fsum(w) > 0)
    .map(normalised)
)


@settings(max_examples=200, deadline=None)
@given(reading, reading)
def test_the_pair_rule_equals_a_brute_force_expectation_over_ordered_pairs(p, q):
    got = read_pair(p, q)
    low, high, low_marginal, high_marginal = brute_force_pair(p, q)
    assert got.low == pytest.approx(low, abs=1e-12)
    assert got.high == pytest.approx(high, abs=1e-12)
    np.testing.assert_allclose(got.low_marginal, low_marginal, atol=1e-12)
    np.testing.assert_allclose(got.high_marginal, high_marginal, atol=1e-12)


@settings(max_examples=300, deadline=None)
@given(any_reading, any_reading, any_reading, any_reading)
def test_top_is_above_bottom_and_left_is_left_of_right_whatever_the_edges_read(top, bottom, left, right):
    box = read_box(top, bottom, left, right)
    for low, high in ((box.top, box.bottom), (box.left, box.right)):
        assert 0.0 <= low < high <= 1.0
        # Every ordered pair is at least one step apart, so the box is never thinner than a step.
        assert high - low >= 1 / (POSITIONS - 1) - 1e-12
    for edge in EDGES:
        marginal = box.marginals[edge]
        assert all(0.0 <= m <= 1.0 for m in marginal) and math.fsum(marginal) == pytest.approx(1.0)
    # A low edge never sits on the last position, a high edge never on the first.
    assert box.marginals["top"][-1] == box.marginals["left"][-1] == 0.0
    assert box.marginals["bottom"][0] == box.marginals["right"][0] == 0.0


@settings(max_examples=100, deadline=None)
@given(reading, reading, st.floats(min_value=1e-6, max_value=1e6))
def test_the_readout_ignores_the_scale_of_the_readings_it_renormalises(p, q, scale):
    plain, scaled = read_pair(p, q), read_pair([v * scale for v in p], [v * scale for v in q])
    assert (scaled.low, scaled.high) == pytest.approx((plain.low, plain.high), abs=1e-12)


def test_edges_whose_readings_never_cross_are_their_own_expected_positions():
    top = normalised([0, 1, 3, 2] + [0] * 17)  # mass on 0.05..0.15
    bottom = normalised([0] * 10 + [1, 4, 4, 1] + [0] * 7)  # mass on 0.50..0.65
    got = read_pair(top, bottom)
    assert got.low == pytest.approx(sum(p * x for p, x in zip(top, GRID, strict=True)), abs=1e-15)
    assert got.high == pytest.approx(sum(q * x for q, x in zip(bottom, GRID, strict=True)), abs=1e-15)


def test_certain_edges_in_order_read_exactly_their_positions():
    box = read_box(one_hot(4), one_hot(13), one_hot(0), one_hot(20))
    assert (box.top, box.bottom, box.left, box.right) == pytest.approx((0.2, 0.65, 0.0, 1.0), abs=1e-300)


def test_certain_edges_in_the_wrong_order_keep_one_of_them_in_every_pair_that_counts():
    got = read_pair(one_hot(15), one_hot(5))  # top certain at 0.75, bottom certain at 0.25
    # Weighed alike: the ordered pairs that keep the certain top, (15, j > 15), or the certain bottom.
    pairs = [(15, j) for j in range(16, 21)] + [(i, 5) for i in range(5)]
    assert got.low == pytest.approx(sum(GRID[i] for i, _ in pairs) / len(pairs), abs=1e-12)
    assert got.high == pytest.approx(sum(GRID[j] for _, j in pairs) / len(pairs), abs=1e-12)


def test_edges_certain_of_the_far_ends_in_the_wrong_order_weigh_every_ordered_pair_alike():
    got = read_pair(one_hot(20), one_hot(0))  # no ordered pair keeps either certain edge
    pairs = [(i, j) for i in range(21) for j in range(i + 1, 21)]
    assert got.low == pytest.approx(sum(GRID[i] for i, _ in pairs) / len(pairs), abs=1e-12)
    assert got.high == pytest.approx(sum(GRID[j] for _, j in pairs) / len(pairs), abs=1e-12)


def test_two_edges_certain_of_one_position_make_a_thin_box_around_it():
    got = read_pair(one_hot(10), one_hot(10))
    # The ordered pairs that keep one certain edge: (10, j > 10) and (i < 10, 10), weighed alike.
    pairs = [(10, j) for j in range(11, 21)] + [(i, 10) for i in range(10)]
    assert got.low == pytest.approx(sum(GRID[i] for i, _ in pairs) / len(pairs), abs=1e-12)
    assert got.high == pytest.approx(sum(GRID[j] for _, j in pairs) / len(pairs), abs=1e-12)
    assert got.low < 0.5 < got.high


def test_readings_far_below_the_smallest_float_still_decide_by_their_weights():
    # Every ordered pair's product underflows in plain float64, yet one pair outweighs the rest.
    top = [FLOOR] * 21
    top[3] = 1e-200
    bottom = [FLOOR] * 21
    bottom[9] = 1e-200
    got = read_pair(normalised(top), normalised(bottom))
    assert (got.low, got.high) == pytest.approx((0.15, 0.45), abs=1e-9)


def test_positions_are_evenly_spaced_from_zero_to_one():
    assert positions() == pytest.approx(GRID, abs=1e-15)
    assert positions()[0] == 0.0 and positions()[-1] == 1.0
    assert positions(3) == (0.0, 0.5, 1.0)
    with pytest.raises(ValueError, match="at least 2"):
        positions(1)


def test_a_pair_of_mismatched_or_unordered_readings_is_refused():
    with pytest.raises(ValueError, match="one probability per position"):
        read_pair([0.5, 0.5], [0.2, 0.3, 0.5])
    with pytest.raises(ValueError, match="increase"):
        read_pair([0.5, 0.5], [0.5, 0.5], at=[1.0, 0.0])


def test_a_custom_grid_of_positions_is_read_by_the_same_rule():
    x = [0.0, 0.1, 0.5, 1.0]
    p, q = normalised([4, 3, 2, 1]), normalised([1, 1, 3, 5])
    got = read_pair(p, q, at=x)
    low, high, _, _ = brute_force_pair(p, q, x)
    assert (got.low, got.high) == pytest.approx((low, high), abs=1e-12)


def test_a_box_question_becomes_four_edge_questions_of_twenty_one_positions():
    questions = edge_questions("dog", "the brown dog", orderings="reversal", workload="boxes")
    assert len(questions) == 4
    for edge, question in zip(EDGES, questions, strict=True):
        assert question.id == "dog"  # a refusal names the box question
        assert (question.orderings, question.workload) == ("reversal", "boxes")
        assert "the brown dog" in question.text and f"{edge} edge" in question.text
        assert [o.id for o in question.options] == [f"{x:.2f}" for x in GRID]
        assert [o.description for o in question.options] == [f"{5 * i}%" for i in range(21)]
        side = "height" if edge in ("top", "bottom") else "width"
        assert f"a percentage of the image's {side}, from 0% (" in question.text
    assert len({q.text for q in questions}) == 4  # each edge asks its own question


def one_hot(index: int) -> list[float]:
    return [1.0 if i == index else 0.0 for i in range(21)]
