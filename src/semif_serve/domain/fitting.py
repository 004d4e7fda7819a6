"""Fitting a workload temperature: golden-section NLL search, ECE before and after, and grouped
folds for an out-of-fold ECE. `semif-serve calibrate` and `POST /calibrate` both call
`calibration_report`, so the command line and the playground can never disagree."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from semif_serve.domain.calibration import T_MAX, T_MIN, calibrated_probabilities
from semif_serve.domain.numerics import ConfidenceBin, argmax, top_label_bins, top_label_ece

PROB_FLOOR = 1e-12  # upstream floors the gold probability so one confident miss stays finite
GOLDEN_ITERATIONS = 60
FOLDS = 5
MIN_ROWS = 150  # below this a fitted T moves a lot from one sample to the next
BOUND_TOLERANCE = 1e-3  # the search ends within 1e-11 of a bound it runs into

Row = tuple[Sequence[float], int]


def _row_nll(logits: Sequence[float], gold: int, temperature: float) -> float:
    # -log p_gold via log-sum-exp, capped where upstream's probability floor would bite; shifted
    # by the largest logit before scaling, so that no z / T overflows (inf - inf would be NaN).
    top = max(float(z) for z in logits)
    shifted = [(float(z) - top) / temperature for z in logits]
    lse = math.log(math.fsum(math.exp(s) for s in shifted))
    return min(lse - shifted[gold], -math.log(PROB_FLOOR))


def mean_nll(rows: Sequence[Row], temperature: float = 1.0) -> float:
    """Mean negative log-likelihood of the gold option at `temperature` (p floored at 1e-12)."""
    return math.fsum(_row_nll(z, g, temperature) for z, g in rows) / len(rows)


def fit_temperature(rows: Iterable[Row]) -> float:
    """The T in [0.05, 20] minimising mean NLL, by golden-section search (60 iterations)."""
    data = list(rows)
    if not data:
        raise ValueError("cannot fit a temperature on zero rows")
    inv_phi = (math.sqrt(5.0) - 1.0) / 2.0
    lo, hi = T_MIN, T_MAX
    c, d = hi - inv_phi * (hi - lo), lo + inv_phi * (hi - lo)
    fc, fd = mean_nll(data, c), mean_nll(data, d)
    for _ in range(GOLDEN_ITERATIONS):
        if fc <= fd:  # ties move left: a flat loss prefers the sharper temperature
            hi, d, fd = d, c, fc
            c = hi - inv_phi * (hi - lo)
            fc = mean_nll(data, c)
        else:
            lo, c, fc = c, d, fd
            d = lo + inv_phi * (hi - lo)
            fd = mean_nll(data, d)
    return min(max((lo + hi) / 2.0, T_MIN), T_MAX)


def group_folds(group_ids: Sequence[Any], k: int = FOLDS) -> list[int]:
    """Fold index per row: sorted distinct group ids dealt round-robin, so a group never splits."""
    order = sorted(set(group_ids), key=lambda g: (type(g).__name__, g))
    fold_of = {g: i % k for i, g in enumerate(order)}
    return [fold_of[g] for g in group_ids]


def _summary(rows: Sequence[Row], temperature: float) -> tuple[float, float]:
    probs = [calibrated_probabilities(z, temperature) for z, _ in rows]
    return mean_nll(rows, temperature), top_label_ece(probs, [g for _, g in rows])


def calibration_report(rows: Sequence[Row], group_ids: Sequence[Any]) -> dict[str, Any]:
    """n, accuracy, NLL/Brier/ECE at T=1 and at the fitted T, out-of-fold ECE (5 folds by group), T,
    and the warnings about it.

    `ece_out_of_fold` is None when there are fewer than two groups (nothing to hold out).
    """
    rows = list(rows)
    if len(rows) != len(group_ids) or not rows:
        raise ValueError("need the same non-zero number of rows and group ids")
    temperature = fit_temperature(rows)
    nll_before, ece_before = _summary(rows, 1.0)
    nll_after, ece_after = _summary(rows, temperature)
    folds = group_folds(group_ids)
    oof_probs: list[list[float]] = [[] for _ in rows]
    fold_report = []
    ece_oof = None
    if len(set(group_ids)) >= 2:
        for f in sorted(set(folds)):
            train = [row for row, g in zip(rows, folds, strict=True) if g != f]
            t_fold = fit_temperature(train)
            held = [i for i, g in enumerate(folds) if g == f]
            for i in held:
                oof_probs[i] = calibrated_probabilities(rows[i][0], t_fold)
            fold_report.append({"fold": f, "n": len(held), "temperature": t_fold})
        ece_oof = top_label_ece(oof_probs, [g for _, g in rows])
    report: dict[str, Any] = {
        "n": len(rows),
        "groups": len(set(group_ids)),
        "accuracy": sum(argmax(z) == g for z, g in rows) / len(rows),
        "nll_before": nll_before,
        "brier_before": mean_brier(rows, 1.0),
        "ece_before": ece_before,
        "nll_after": nll_after,
        "brier_after": mean_brier(rows, temperature),
        "ece_after": ece_after,
        "ece_out_of_fold": ece_oof,
        "temperature": temperature,
        "folds": fold_report,
    }
    report["warnings"] = fit_warnings(report)
    return report


def mean_brier(rows: Sequence[Row], temperature: float = 1.0) -> float:
    """Mean multi-class Brier score at `temperature`: sum over options of (p - [gold])^2, averaged."""
    total = 0.0
    for logits, gold in rows:
        probs = calibrated_probabilities(logits, temperature)
        total += math.fsum((p - (i == gold)) ** 2 for i, p in enumerate(probs))
    return total / len(rows)


def reliability_bins(rows: Sequence[Row], temperature: float) -> list[ConfidenceBin]:
    """The top-label confidence bins (ECE's 10 equal-width bins) of `rows` at `temperature`."""
    return top_label_bins([calibrated_probabilities(z, temperature) for z, _ in rows], [g for _, g in rows])


def fit_warnings(report: dict[str, Any]) -> list[str]:
    """What makes a fitted T doubtful: too few rows, T at a bound, no or no better out-of-fold ECE."""
    t, n = report["temperature"], report["n"]
    found = []
    if n < MIN_ROWS:
        found.append(
            f"only {n} rows: a temperature fitted on fewer than ~{MIN_ROWS} rows is noisy; "
            "judge it by the out-of-fold ECE, and prefer more labelled rows"
        )
    for bound, side, meaning in (
        (T_MIN, "lower", "the model is right and confident on nearly every row"),
        (T_MAX, "upper", "the model's confidence does not track its accuracy"),
    ):
        if abs(t - bound) <= BOUND_TOLERANCE:
            found.append(
                f"T = {t:g} is the {side} bound of [{T_MIN:g}, {T_MAX:g}]: the likelihood kept improving "
                f"toward it, so this is a clamp, not a fit ({meaning}, or too few rows; "
                f"accuracy {report['accuracy']:.2f}); check the rows before using it"
            )
    oof = report["ece_out_of_fold"]
    if oof is None:
        found.append("fewer than two group_ids: no out-of-fold ECE, so nothing checks the fitted T")
    elif oof >= report["ece_before"]:
        found.append(
            f"the out-of-fold ECE ({oof:.4f}) is no better than at T=1 ({report['ece_before']:.4f}): "
            "the fitted T does not carry over to held-out groups"
        )
    return found


def calibration_entry(workload: str, mode: str, temperature: float) -> dict[str, Any]:
    """The calibration.json entry for `workload`: T (4 decimals), or {mode: T} for a combined read."""
    t = round(temperature, 4)
    return {workload: t if mode == "single" else {mode: t}}
