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

from .calibration import T_MAX, T_MIN, calibrated_probabilities
from .numerics import argmax, top_label_ece
from .orderings import MODES

PROB_FLOOR = 1e-12  # upstream floors the gold probability so one confident miss stays finite
GOLDEN_ITERATIONS = 60
FOLDS = 5

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


def _prediction_logits(path: Path, lineno: int, row: dict[str, Any], mode: str) -> list[float]:
    # Averaged (rotations/all) output carries `combined`; log of its probabilities serves as logits.
    ids = row.get("option_ids")
    if not isinstance(ids, list) or not ids:
        raise _InputError(f"{path} line {lineno}: option_ids must be a non-empty list")
    combined = row.get("combined")
    from_probs = mode != "single" and isinstance(combined, dict)
    values: Any
    if from_probs:
        assert isinstance(combined, dict)
        probs = combined.get("probabilities")
        if not isinstance(probs, dict) or any(str(i) not in probs for i in ids):
            raise _InputError(f"{path} line {lineno}: combined.probabilities lacks an option")
        values = [probs[str(i)] for i in ids]
    else:
        values = row.get("option_logits")
        if not isinstance(values, list) or len(values) != len(ids):
            raise _InputError(f"{path} line {lineno}: option_logits must match option_ids")
    if any(isinstance(v, bool) or not isinstance(v, int | float) for v in values) or not all(
        math.isfinite(v) for v in values
    ):
        raise _InputError(f"{path} line {lineno}: scores must be finite numbers")
    if from_probs:
        return [math.log(max(float(p), PROB_FLOOR)) for p in values]
    return [float(v) for v in values]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="semif-serve calibrate",
        description="Fit a workload temperature from labelled gold rows and SemIf predictions.",
    )
    parser.add_argument("--gold", type=Path, required=True, help="labelled fixtures (JSONL)")
    parser.add_argument("--predictions", type=Path, required=True, help="SemIf results (JSONL)")
    parser.add_argument("--mode", choices=MODES, default="single", help="read mode (single)")
    parser.add_argument("--workload", help="name in calibration.json (default: gold file stem)")
    parser.add_argument("--json", type=Path, dest="json_out", help="write the report here")
    return parser


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


def run_calibrate(argv: list[str]) -> int:
    """`semif-serve calibrate`: print the fit report and the calibration.json entry; 0 or 2."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help (0) and on bad arguments (2)
        return exc.code if isinstance(exc.code, int) else 2
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
    oof = report["ece_out_of_fold"]
    print(f"workload {workload}  mode {args.mode}  n {report['n']}  groups {report['groups']}")
    print(f"unjoined: {no_pred} gold rows without a prediction, {no_gold} predictions without gold")
    print(f"accuracy        {report['accuracy']:.4f}")
    print(f"NLL  T=1 {report['nll_before']:.4f}  ->  fitted {report['nll_after']:.4f}")
    print(f"ECE  T=1 {report['ece_before']:.4f}  ->  fitted {report['ece_after']:.4f}")
    print("ECE  out-of-fold (5 folds by group_id) " + ("n/a" if oof is None else f"{oof:.4f}"))
    print(f"T    {report['temperature']:.4f}")
    if args.mode != "single":
        print('note: the object form also needs "single": add the single-read T to this entry')
    print(json.dumps(entry))
    if args.json_out is not None:
        try:
            args.json_out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            print(f"semif-serve calibrate: error: {args.json_out}: {exc}", file=sys.stderr)
            return 2
    return 0
