"""Fitting a workload temperature (golden-section NLL search, ECE, grouped folds) and the
`semif-serve calibrate` command that prints a calibration.json entry."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from semif_serve.domain.calibration import T_MAX, T_MIN, calibrated_probabilities
from semif_serve.domain.numerics import argmax, top_label_bins, top_label_ece
from semif_serve.domain.orderings import MODES
from semif_serve.tools.reliability_plot import Panel, PlotUnavailable, write_reliability_png

PROB_FLOOR = 1e-12  # upstream floors the gold probability so one confident miss stays finite
GOLDEN_ITERATIONS = 60
FOLDS = 5
MIN_ROWS = 150  # below this a fitted T moves a lot from one sample to the next
BOUND_TOLERANCE = 1e-3  # the search ends within 1e-11 of a bound it runs into

Row = tuple[Sequence[float], int]


def _row_nll(logits: Sequence[float], gold: int, temperature: float) -> float:
    # -log p_gold via log-sum-exp, capped where upstream's probability floor would bite.
    scaled = [float(z) / temperature for z in logits]
    top = max(scaled)
    lse = top + math.log(math.fsum(math.exp(s - top) for s in scaled))
    return min(lse - scaled[gold], -math.log(PROB_FLOOR))


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
    """n, accuracy, NLL/ECE at T=1 and at the fitted T, out-of-fold ECE (5 folds by group), T.

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
    return {
        "n": len(rows),
        "groups": len(set(group_ids)),
        "accuracy": sum(argmax(z) == g for z, g in rows) / len(rows),
        "nll_before": nll_before,
        "ece_before": ece_before,
        "nll_after": nll_after,
        "ece_after": ece_after,
        "ece_out_of_fold": ece_oof,
        "temperature": temperature,
        "folds": fold_report,
    }


class _InputError(Exception):
    """A calibrate input problem; the message names the file and line."""


def _read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise _InputError(f"{path}: cannot read: {type(exc).__name__}") from None
    rows = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _InputError(f"{path} line {lineno}: not valid JSON: {exc.msg}") from None
        if not isinstance(row, dict) or isinstance(row.get("id"), bool | None):
            raise _InputError(f"{path} line {lineno}: expected a JSON object with an id")
        rows.append((lineno, row))
    return rows


def _by_id(path: Path, rows: list[tuple[int, dict[str, Any]]]) -> dict[Any, tuple[int, dict]]:
    out: dict[Any, tuple[int, dict]] = {}
    for lineno, row in rows:
        key = json.dumps(row["id"])  # ids are compared as JSON values: "1" and 1 differ
        if key in out:
            raise _InputError(f"{path} line {lineno}: duplicate id {key}")
        out[key] = (lineno, row)
    return out


def _gold_option(path: Path, lineno: int, row: dict[str, Any]) -> tuple[Any, Any]:
    options, label = row.get("options"), row.get("label")
    if "group_id" not in row or not isinstance(options, list) or not options:
        raise _InputError(f"{path} line {lineno}: needs group_id and a non-empty options list")
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(options):
        raise _InputError(f"{path} line {lineno}: label must index options, got {label!r}")
    if not isinstance(options[label], dict) or "id" not in options[label]:
        raise _InputError(f"{path} line {lineno}: options[{label}] has no id")
    return row["group_id"], options[label]["id"]


def _finite_numbers(where: str, values: list[Any], what: str) -> list[float]:
    if any(isinstance(v, bool) or not isinstance(v, int | float) for v in values) or not all(
        math.isfinite(v) for v in values
    ):
        raise _InputError(f"{where}: {what} must be finite numbers")
    return [float(v) for v in values]


def _prediction_logits(path: Path, lineno: int, row: dict[str, Any], mode: str) -> list[float]:
    # single: the read in the caller's order. rotations/all: the answer averaged over that mode's
    # orderings, whose log-probabilities are its mean logits shifted by a constant T ignores.
    where = f"{path} line {lineno}"
    ids = row.get("option_ids")
    if not isinstance(ids, list) or not ids:
        raise _InputError(f"{where}: option_ids must be a non-empty list")
    if mode == "single":
        logits = row.get("option_logits")
        if not isinstance(logits, list) or len(logits) != len(ids):
            raise _InputError(f"{where}: option_logits must match option_ids")
        return _finite_numbers(where, logits, "option_logits")
    combined = row.get("combined")
    if not isinstance(combined, dict):
        raise _InputError(
            f"{where}: --mode {mode} needs the answer averaged over the {mode} orderings, the result's "
            f'`combined` object (combined.probabilities, with combined.mode "{mode}"); this row has none, '
            f"so it is a single read. Score the fixture with `python -m acceptance score --orderings {mode}` "
            f'(or send /decide "orderings": "{mode}"), or fit --mode single'
        )
    if combined.get("mode") != mode:
        raise _InputError(
            f'{where}: combined.mode is {json.dumps(combined.get("mode"))}, not "{mode}": '
            f"these predictions were averaged over other orderings than --mode {mode}"
        )
    probs = combined.get("probabilities")
    if not isinstance(probs, dict) or any(str(i) not in probs for i in ids):
        raise _InputError(f"{where}: combined.probabilities lacks an option of option_ids")
    values = _finite_numbers(where, [probs[str(i)] for i in ids], "combined.probabilities")
    if any(not 0.0 <= p <= 1.0 for p in values):
        raise _InputError(f"{where}: combined.probabilities must lie in [0, 1]")
    return [math.log(max(p, sys.float_info.min)) for p in values]


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    """The `semif-serve calibrate` arguments (cli.py builds the parser around them)."""
    parser.add_argument(
        "--gold",
        type=Path,
        required=True,
        metavar="FILE",
        help="labelled rows, JSONL: id, group_id, options (each with an id), label (the right index)",
    )
    parser.add_argument(
        "--predictions",
        type=Path,
        required=True,
        metavar="FILE",
        help="the service's results for the same ids, JSONL (`python -m acceptance score` writes them)",
    )
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="single",
        help="the read to calibrate: single (each result's option_logits; the default), or rotations/all "
        "(each result's `combined` answer: score with --orderings MODE)",
    )
    parser.add_argument(
        "--workload", metavar="NAME", help="the name in calibration.json (default: the gold file's stem)"
    )
    parser.add_argument(
        "--json", type=Path, dest="json_out", metavar="FILE", help="also write the report as JSON"
    )
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="also write a reliability diagram (PNG): accuracy per confidence bin, before and after",
    )


def _join(args: argparse.Namespace) -> tuple[list[Row], list[Any], int, int]:
    # Every line is validated, joined or not, so a malformed file always fails loudly.
    gold = {
        key: (_gold_option(args.gold, line, row), line)
        for key, (line, row) in _by_id(args.gold, _read_jsonl(args.gold)).items()
    }
    preds = {
        key: (_prediction_logits(args.predictions, line, row, args.mode), row["option_ids"], line)
        for key, (line, row) in _by_id(args.predictions, _read_jsonl(args.predictions)).items()
    }
    rows: list[Row] = []
    groups: list[Any] = []
    for key, ((group, gold_id), _) in gold.items():
        if key not in preds:
            continue
        logits, option_ids, p_line = preds[key]
        if gold_id not in option_ids:
            raise _InputError(
                f"{args.predictions} line {p_line}: gold option {json.dumps(gold_id)} is not among option_ids"
            )
        rows.append((logits, option_ids.index(gold_id)))
        groups.append(group)
    return rows, groups, len(gold.keys() - preds.keys()), len(preds.keys() - gold.keys())


def _warnings(report: dict[str, Any]) -> list[str]:
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


def _plot(path: Path, rows: Sequence[Row], report: dict[str, Any]) -> None:
    golds = [g for _, g in rows]
    t, oof = report["temperature"], report["ece_out_of_fold"]

    def bins(temperature: float) -> list:
        return top_label_bins([calibrated_probabilities(z, temperature) for z, _ in rows], golds)

    heading = f"{report['workload']} {report['mode']}  N={report['n']}  OUT-OF-FOLD ECE " + (
        "N/A" if oof is None else f"{oof:.4f}"
    )
    write_reliability_png(
        path,
        heading,
        Panel(f"BEFORE T=1  ECE {report['ece_before']:.4f}", bins(1.0)),
        Panel(f"AFTER T={t:.4g}  ECE {report['ece_after']:.4f}", bins(t)),
    )


def calibrate(args: argparse.Namespace) -> int:
    """`semif-serve calibrate`: print the fit report and the calibration.json entry; 0 or 2."""
    workload = args.workload or args.gold.stem
    try:
        rows, groups, no_pred, no_gold = _join(args)
        if not rows:
            raise _InputError(f"no gold row joins a prediction by id ({args.gold}, {args.predictions})")
    except _InputError as exc:
        print(f"semif-serve calibrate: error: {exc}", file=sys.stderr)
        return 2
    report = calibration_report(rows, groups)
    t = round(report["temperature"], 4)
    entry = {workload: t if args.mode == "single" else {args.mode: t}}
    report.update(
        workload=workload,
        mode=args.mode,
        missing_predictions=no_pred,
        missing_gold=no_gold,
        entry=entry,
    )
    report["warnings"] = _warnings(report)
    oof = report["ece_out_of_fold"]
    print(f"workload {workload}  mode {args.mode}  n {report['n']}  groups {report['groups']}")
    print(f"unjoined: {no_pred} gold rows without a prediction, {no_gold} predictions without gold")
    print(f"accuracy        {report['accuracy']:.4f}")
    print(f"NLL  T=1 {report['nll_before']:.4f}  ->  fitted {report['nll_after']:.4f}")
    print(f"ECE  T=1 {report['ece_before']:.4f}  ->  fitted {report['ece_after']:.4f}  (in-sample)")
    print(
        f"ECE  T=1 {report['ece_before']:.4f}  ->  fitted "
        + ("n/a" if oof is None else f"{oof:.4f}")
        + f"  (out-of-fold: {FOLDS} folds by group_id, T refitted without each)"
    )
    print(f"T    {report['temperature']:.4f}  (searched in [{T_MIN:g}, {T_MAX:g}])")
    for warning in report["warnings"]:
        print(f"semif-serve calibrate: warning: {warning}", file=sys.stderr)
    if args.mode != "single":
        print('note: the object form also needs "single": add the single-read T to this entry')
    print(json.dumps(entry))
    try:
        if args.json_out is not None:
            args.json_out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        if args.plot is not None:
            _plot(args.plot, rows, report)
            print(f"wrote the reliability diagram to {args.plot}", file=sys.stderr)
    except (OSError, PlotUnavailable) as exc:
        print(f"semif-serve calibrate: error: {exc}", file=sys.stderr)
        return 2
    return 0
