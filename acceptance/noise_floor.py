"""`noise-floor`: the same rows scored twice must give the same answers (determinism)."""

from __future__ import annotations

import argparse

from harness.report import print_table
from harness.stats import compare_results, summarise_comparisons

from .common import Gate, Outcome, add_connection_arguments, connect, finish, fraction, score_rows
from .parity import fixture_argument, load_fixture


def add_noise_floor(commands) -> None:
    p = commands.add_parser("noise-floor", help="score the same rows twice: n/N identical, max gap")
    add_connection_arguments(p)
    fixture_argument(p)
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.0,
        help="largest allowed probability difference between the passes (0: bit-identical)",
    )
    p.set_defaults(handler=run_noise_floor)


def run_noise_floor(args: argparse.Namespace) -> int:
    rows = load_fixture(args)
    client, service = connect(args)
    with client:
        first, errors_1 = score_rows(client, rows, label="noise floor, pass 1")
        second, errors_2 = score_rows(client, rows, label="noise floor, pass 2")
    outcome = noise_floor_outcome(
        [r["id"] for r in rows], first, second, {**errors_1, **errors_2}, args.tolerance
    )
    s = outcome.summary
    print_table(
        ["check", "result"],
        [
            ["identical (hash, option ids, probabilities)", fraction(s["identical"], s["fixture_rows"])],
            ["same top choice", fraction(s["same_top"], s["fixture_rows"])],
            ["max probability gap", s["max_gap"]],
        ],
        title="noise-floor: pass 2 vs pass 1",
    )
    return finish(outcome, args, service)


def noise_floor_outcome(ids, first, second, errors, tolerance: float) -> Outcome:
    compared = [
        compare_results(second[i], first[i], tie_margin=0.0) for i in ids if i in first and i in second
    ]
    summary = summarise_comparisons(compared)
    summary.update(fixture_rows=len(ids), errors=len(errors), tolerance=tolerance)
    if tolerance == 0.0:
        stable = summary["identical"] == len(ids)
    else:
        stable = (
            summary["same_top"] == len(ids)
            and summary["same_hash"] == len(ids)
            and summary["max_gap"] is not None
            and summary["max_gap"] <= tolerance
        )
    gates = [
        Gate(
            "scored",
            not errors and len(compared) == len(ids),
            f"{len(compared)}/{len(ids)} rows scored twice",
        ),
        Gate(
            "deterministic",
            stable,
            f"identical {fraction(summary['identical'], len(ids))}, "
            f"max gap {summary['max_gap']!s} (tolerance {tolerance:g})",
        ),
    ]
    unstable = [c for c in compared if not c["identical"]]
    return Outcome("noise-floor", summary, gates, {"differences": unstable, "errors": errors})
