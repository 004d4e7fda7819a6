"""The presentation checks' metrics (domain.presentation) against numbers worked out by hand: the
probe's questions, the identical-option lean, the first-slot rate with ties split, consistency,
leave-one-out bounds, the raw log-mean, drift, settings and the cheapest passing ordering."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from semif_serve.domain.presentation import (
    FIRST_SLOT_GATE_MAX,
    cheapest_passing,
    drift,
    first_slot_metric,
    identical_metric,
    kind_metrics,
    leave_one_out,
    log_mean,
    probes,
    settings_mismatch,
)


def test_each_kind_probes_six_identical_configurations_and_every_order_of_three_options():
    for kind in ("choice", "score"):
        found = probes(kind)
        identical = [p for p in found if p.check == "identical"]
        permuted = [p for p in found if p.check == "perm"]
        assert sorted(p.size for p in identical) == [3, 3, 4, 4, 5, 5]
        assert len(permuted) == 6 and len({p.order for p in permuted}) == 6
        for probe in identical:
            texts = probe.question["criteria"]
            texts = list(texts.values()) if isinstance(texts, dict) else texts
            assert len(set(texts)) == 1, "every option reads the same text"
        slots = Counter((p.order[slot], slot) for p in permuted for slot in range(3))
        assert set(slots.values()) == {2}, "every option sits in every slot exactly twice"
    nouls = probes("noul")
    assert [p.size for p in nouls] == [2, 2] and all(p.check == "identical" for p in nouls)
    assert all(p.question["criteria"]["true"] == p.question["criteria"]["false"] for p in nouls)


def test_an_unknown_kind_is_refused_by_name():
    with pytest.raises(ValueError, match="box"):
        probes("box")


def test_leave_one_out_is_the_smallest_and_largest_mean_without_one_state():
    # without 0.1: 0.4; without 0.2: 0.35; without 0.6: 0.15
    assert leave_one_out([0.1, 0.2, 0.6]) == pytest.approx([0.15, 0.4])
    assert leave_one_out([0.7]) == [0.7, 0.7]


def test_the_identical_lean_is_slot_zeros_log_probability_above_the_mean_averaged_per_state():
    # state 1: configs give log(.5) - mean(log .5, log .25, log .25) and 0 (uniform); state 2: one config
    state1 = {"a|3": [0.5, 0.25, 0.25], "a|4": [0.25] * 4}
    state2 = {"a|3": [0.2, 0.4, 0.4]}
    lean1 = (math.log(0.5) - (math.log(0.5) + 2 * math.log(0.25)) / 3 + 0.0) / 2
    lean2 = math.log(0.2) - (math.log(0.2) + 2 * math.log(0.4)) / 3
    result = identical_metric([state1, state2], "none")
    assert result["metric"] == pytest.approx((lean1 + lean2) / 2)
    assert result["leave_one_out"] == pytest.approx(sorted([lean1, lean2]))
    assert result["by_config"]["a|3"] == pytest.approx(
        (math.log(0.5) - (math.log(0.5) + 2 * math.log(0.25)) / 3 + lean2) / 2
    )
    assert result["by_config"]["a|4"] == pytest.approx(0.0)
    assert result["passed"] is (-0.2 <= result["metric"] <= 0.2)


def test_an_order_free_model_picks_slot_zero_a_third_of_the_time_and_is_consistent():
    # The model's answer depends on the options alone: option 2 always wins, wherever it is shown.
    orders = [(0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0)]
    by_option = [0.2, 0.3, 0.5]
    state = [(order, [by_option[i] for i in order]) for order in orders]
    result = first_slot_metric([state, state])
    assert result["metric"] == pytest.approx(1 / 3)
    assert result["consistent"] == 1.0
    assert result["argmax_by_slot"] == [4.0, 4.0, 4.0]
    assert result["decisions"] == 12 and result["passed"]


def test_a_model_that_always_picks_the_first_slot_fails_and_is_never_consistent():
    orders = [(0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0)]
    state = [(order, [0.6, 0.3, 0.1]) for order in orders]
    result = first_slot_metric([state])
    assert result["metric"] == 1.0 > FIRST_SLOT_GATE_MAX
    assert not result["passed"] and result["consistent"] == 0.0


def test_a_tie_is_split_between_the_tied_slots():
    # Two orders: a tie of slots 0 and 1 (half a first-slot pick), then slot 2 alone.
    state = [((0, 1, 2), [0.4, 0.4, 0.2]), ((2, 1, 0), [0.1, 0.2, 0.7])]
    result = first_slot_metric([state])
    assert result["metric"] == pytest.approx((0.5 + 0.0) / 2)
    assert result["argmax_by_slot"] == [0.5, 0.5, 1.0]
    # picks: {0, 1} then {0}: two different answers
    assert result["consistent"] == 0.0


def test_kind_metrics_reads_each_probe_in_the_order_it_was_shown():
    answers = {}
    for probe in probes("choice"):
        # an order-free model: each option's probability fixed by its name; identical: uniform
        names = list(probe.question["criteria"])
        if probe.check == "identical":
            answers[probe.id] = {name: 1 / len(names) for name in names}
        else:
            answers[probe.id] = {"Billing": 0.5, "Technical": 0.3, "Sales": 0.2}
    result = kind_metrics("choice", [answers], "none")
    assert result["identical"]["metric"] == pytest.approx(0.0)
    assert result["first_slot"]["metric"] == pytest.approx(1 / 3)
    assert result["first_slot"]["consistent"] == 1.0


def test_the_raw_log_mean_is_the_softmax_of_the_mean_logits():
    logits = [[1.0, 2.0, 0.5], [0.3, -1.0, 2.2]]
    readings = []
    for row in logits:
        total = sum(math.exp(x) for x in row)
        readings.append({name: math.exp(x) / total for name, x in zip("abc", row, strict=True)})
    means = [(logits[0][i] + logits[1][i]) / 2 for i in range(3)]
    expected = [math.exp(m) / sum(math.exp(v) for v in means) for m in means]
    assert list(log_mean(readings).values()) == pytest.approx(expected, rel=1e-12)


def report_with(metric: float, consistent: float = 1.0) -> dict:
    block = {
        "identical": {"metric": metric},
        "first_slot": {"metric": 0.3, "consistent": consistent},
    }
    return {"checks": {"choice": {"none": {"calibrated": block, "raw": block}}}}


def test_drift_names_each_metric_that_moved_past_the_tolerance_or_went_missing():
    assert drift(report_with(0.10), report_with(0.12), 0.05) == []
    moved = drift(report_with(0.30, consistent=0.5), report_with(0.10), 0.05)
    assert sorted(line.split(":")[0] for line in moved) == [
        "choice.none.calibrated.first_slot.consistent",
        "choice.none.calibrated.identical",
        "choice.none.raw.first_slot.consistent",
        "choice.none.raw.identical",
    ]
    assert drift({"checks": {}}, report_with(0.1), 0.05)[0].endswith("missing from this run")


def test_settings_that_differ_are_named_with_both_values():
    saved = {"checkpoint_revision": "a", "dtype": "float32", "n_states": 8}
    assert settings_mismatch(saved, {**saved}, list(saved)) == []
    assert settings_mismatch(saved, {**saved, "checkpoint_revision": "b"}, list(saved)) == [
        "checkpoint_revision (report: 'a', run: 'b')"
    ]


def gated(passed: bool, first: float, lean: float) -> dict:
    return {
        "raw": {
            "identical": {"metric": lean, "passed": passed},
            "first_slot": {"metric": first, "passed": passed},
        }
    }


def test_the_cheapest_passing_ordering_wins_and_the_most_even_stands_in_when_none_passes():
    measured = {
        "none": gated(False, 0.9, 0.5),
        "reversal": gated(True, 0.34, 0.1),
        "rotations": gated(True, 1 / 3, 0.0),
    }
    assert cheapest_passing(measured, ("none", "reversal", "rotations")) == ("reversal", "rotations")
    failing = {"none": gated(False, 0.0, 0.3), "reversal": gated(False, 0.0, 0.1)}
    assert cheapest_passing(failing, ("none", "reversal")) == (None, "reversal")
