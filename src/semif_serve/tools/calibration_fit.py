"""The `semif-serve calibrate` command: join gold and prediction files, fit the workload's
temperature (domain/fitting.py, the code `POST /calibrate` runs too) and print a calibration.json entry."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from semif_serve.domain.calibration import T_MAX, T_MIN
from semif_serve.domain.fitting import (
    FOLDS,
    Row,
    calibration_entry,
    calibration_report,
    reliability_bins,
)
from semif_serve.domain.orderings import MODES
from semif_serve.tools.reliability_plot import Panel, PlotUnavailable, write_reliability_png


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


def _plot(path: Path, rows: Sequence[Row], report: dict[str, Any]) -> None:
    t, oof = report["temperature"], report["ece_out_of_fold"]
    heading = f"{report['workload']} {report['mode']}  N={report['n']}  OUT-OF-FOLD ECE " + (
        "N/A" if oof is None else f"{oof:.4f}"
    )
    write_reliability_png(
        path,
        heading,
        Panel(f"BEFORE T=1  ECE {report['ece_before']:.4f}", reliability_bins(rows, 1.0)),
        Panel(f"AFTER T={t:.4g}  ECE {report['ece_after']:.4f}", reliability_bins(rows, t)),
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
    entry = calibration_entry(workload, args.mode, report["temperature"])
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
