"""`averaging`: on labelled rows, accuracy of one read vs `rotations` vs `all`, the group-bootstrap
CI of each difference, accuracy by unanimous vs split agreement, and the ECE of each mode."""

from __future__ import annotations

import argparse
from typing import Any

from harness.client import Client, ServiceCallError
from harness.report import log, print_table
from harness.stats import accuracy, group_bootstrap_difference, top_option
from semif_serve.domain.numerics import expected_calibration_error
from semif_serve.domain.orderings import MAX_ALL_OPTIONS, NATIVE_MODES

from .common import CheckError, Gate, Outcome, add_connection_arguments, connect, decision_body, finish
from .parity import fixture_argument, load_fixture

COMPARISONS = (("rotations", "single"), ("all", "single"), ("all", "rotations"))


def add_averaging(commands) -> None:
    p = commands.add_parser("averaging", help="accuracy single vs rotations vs all, with group-bootstrap CIs")
    add_connection_arguments(p)
    fixture_argument(p)
    p.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    p.add_argument("--bins", type=int, default=10, help="ECE bins")
    p.add_argument(
        "--require-gain", action="store_true", help="gate: the 95%% CI of rotations - single must lie above 0"
    )
    p.set_defaults(handler=run_averaging)


def check_labelled(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        label = row.get("label")
        if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(row["options"]):
            raise CheckError(f"row {row['id']!r} has no valid label (an index into its options)")


def read_row(row: dict[str, Any], single: dict, rotations: dict, every: dict | None) -> dict[str, Any]:
    """One row's three reads: chosen option, confidence, correctness, agreement."""
    gold = row["options"][row["label"]]["id"]
    every = every or rotations
    out = {
        "id": row["id"],
        "group_id": row.get("group_id", row["id"]),
        "gold": gold,
        "all_fallback": every is rotations,
    }
    single_top = top_option(single)
    out["single"] = {
        "top": single_top,
        "confidence": max(single["probabilities"]),
        "correct": single_top == gold,
    }
    for mode, result in (("rotations", rotations), ("all", every)):
        combined = result["combined"]
        out[mode] = {
            "top": combined["top"],
            "confidence": max(combined["probabilities"].values()),
            "correct": combined["top"] == gold,
            "agreement": combined["agreement"],
            "orderings": combined["orderings"],
        }
    return out


def score_averaging(
    client: Client, rows: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    reads: list[dict[str, Any]] = []
    errors: dict[str, dict[str, Any]] = {}
    for i, row in enumerate(rows, 1):
        try:
            single, _ = client.decide(decision_body(row))
            rotations, _ = client.decide(decision_body(row, orderings="rotations"))
            every = None
            if len(row["options"]) <= MAX_ALL_OPTIONS:
                every, _ = client.decide(decision_body(row, orderings="all"))
        except ServiceCallError as exc:
            errors[row["id"]] = exc.as_dict()
            continue
        reads.append(read_row(row, single, rotations, every))
        if i % 25 == 0 or i == len(rows):
            log(f"averaging: {i}/{len(rows)} rows")
    return reads, errors


def averaging_summary(reads: list[dict[str, Any]], resamples: int, seed: int, bins: int) -> dict[str, Any]:
    """Accuracy, ECE and agreement splits per mode, and the bootstrap CI of each difference."""
    groups = [r["group_id"] for r in reads]
    modes: dict[str, Any] = {}
    for mode in NATIVE_MODES:
        correct = [r[mode]["correct"] for r in reads]
        entry = {
            "rows": len(reads),
            "accuracy": accuracy(correct),
            "ece": expected_calibration_error([r[mode]["confidence"] for r in reads], correct, bins),
        }
        if mode != "single":
            unanimous = [r[mode]["correct"] for r in reads if r[mode]["agreement"] >= 1.0]
            split = [r[mode]["correct"] for r in reads if r[mode]["agreement"] < 1.0]
            entry["unanimous"] = {"rows": len(unanimous), "accuracy": accuracy(unanimous)}
            entry["split"] = {"rows": len(split), "accuracy": accuracy(split)}
        modes[mode] = entry
    differences = {}
    for treatment, baseline in COMPARISONS:
        differences[f"{treatment} - {baseline}"] = group_bootstrap_difference(
            groups,
            [r[baseline]["correct"] for r in reads],
            [r[treatment]["correct"] for r in reads],
            resamples,
            seed,
        )
    return {
        "rows": len(reads),
        "groups": len(set(groups)),
        "all_fallback_rows": sum(r["all_fallback"] for r in reads),
        "modes": modes,
        "differences": differences,
    }


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _pts(value: float) -> str:
    return f"{100 * value:+.1f}"


def print_averaging(summary: dict[str, Any]) -> None:
    rows = []
    for mode in NATIVE_MODES:
        m = summary["modes"][mode]
        unanimous, split = m.get("unanimous"), m.get("split")
        rows.append(
            [
                mode,
                _pct(m["accuracy"]),
                m["rows"],
                round(m["ece"], 4),
                f"{_pct(unanimous['accuracy'])} ({unanimous['rows']})" if unanimous else "-",
                f"{_pct(split['accuracy'])} ({split['rows']})" if split else "-",
            ]
        )
    print_table(
        ["mode", "accuracy", "rows", "ECE", "unanimous acc (rows)", "split acc (rows)"],
        rows,
        title=f"averaging: {summary['rows']} rows, {summary['groups']} groups",
    )
    print_table(
        ["difference", "points", "95% CI (group bootstrap)"],
        [
            [name, _pts(d["difference"]), f"{_pts(d['ci_low'])}..{_pts(d['ci_high'])}"]
            for name, d in summary["differences"].items()
        ],
    )


def run_averaging(args: argparse.Namespace) -> int:
    rows = load_fixture(args)
    check_labelled(rows)
    client, service = connect(args)
    with client:
        reads, errors = score_averaging(client, rows)
    if not reads:
        raise CheckError("no row could be scored")
    summary = averaging_summary(reads, args.resamples, args.seed, args.bins)
    print_averaging(summary)
    gates = [Gate("scored", not errors, f"{len(reads)}/{len(rows)} rows scored in every mode")]
    if args.require_gain:
        d = summary["differences"]["rotations - single"]
        gates.append(
            Gate(
                "rotations gain",
                d["ci_low"] > 0,
                f"{_pts(d['difference'])} pts, CI {_pts(d['ci_low'])}..{_pts(d['ci_high'])}",
            )
        )
    return finish(Outcome("averaging", summary, gates, {"rows": reads, "errors": errors}), args, service)
