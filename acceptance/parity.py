"""`score`, `parity` and `negative-control`: our /decide readout against upstream's committed
predictions, and the same check on deliberately wrong prompts (it must fail)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.report import log, print_table
from harness.stats import compare_results, summarise_comparisons

from .common import (
    EXIT_PASS,
    CheckError,
    Gate,
    Outcome,
    add_connection_arguments,
    by_id,
    connect,
    finish,
    fraction,
    read_jsonl,
    score_rows,
    write_jsonl,
)

DEFAULT_TIE_MARGIN = 0.02  # top-2 probability margin below which a flipped top counts as a tie
DEFAULT_MAX_GAP = 0.10  # BF16 paths differ by a few hundredths; the spec measured 0.049..0.093
MAX_PRINTED = 20


def fixture_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fixture", required=True, type=Path, help="SemIf rows (JSONL: id, state, question, options, ...)"
    )
    parser.add_argument("--limit", type=int, default=None, help="only the first N fixture rows")


def load_fixture(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = read_jsonl(args.fixture)
    by_id(rows, str(args.fixture))  # ids must be unique
    return rows[: args.limit] if args.limit else rows


def comparison_arguments(parser: argparse.ArgumentParser, max_gap: float = DEFAULT_MAX_GAP) -> None:
    parser.add_argument(
        "--tie-margin",
        type=float,
        default=DEFAULT_TIE_MARGIN,
        help="a flipped top where either side's top-2 margin is below this is a tie flip, not a failure",
    )
    parser.add_argument(
        "--max-gap", type=float, default=max_gap, help="largest allowed |probability difference| per option"
    )


def rotate_descriptions(row: dict[str, Any], shift: int = 1) -> dict[str, Any]:
    """The row with its option descriptions rotated against its ids (ids stay in place)."""
    options = row["options"]
    n = len(options)
    rotated = [
        {"id": o["id"], "description": options[(i + shift) % n]["description"]} for i, o in enumerate(options)
    ]
    return {**row, "options": rotated}


def compare_against(
    command: str,
    fixture_ids: Sequence[str],
    ours: dict[str, dict[str, Any]],
    reference: dict[str, dict[str, Any]],
    errors: dict[str, dict[str, Any]],
    tie_margin: float,
    max_gap: float,
    reference_name: str = "reference",
) -> Outcome:
    """The parity gates over fixture rows: all scored and joined, identical prompt hashes, no
    real top flips (tie flips reported apart), and the probability gap within `max_gap`."""
    missing = [i for i in fixture_ids if i not in reference]
    compared = [
        compare_results(ours[i], reference[i], tie_margin)
        for i in fixture_ids
        if i in ours and i in reference
    ]
    summary = summarise_comparisons(compared)
    total = len(fixture_ids)
    summary.update(
        fixture_rows=total, errors=len(errors), missing_reference=len(missing), tie_margin=tie_margin
    )
    max_seen = summary["max_gap"]
    gates = [
        Gate(
            "scored",
            not errors and not missing,
            f"{len(compared)}/{total} rows scored and joined"
            + (f"; {len(errors)} refused" if errors else "")
            + (f"; {len(missing)} without a {reference_name} row" if missing else ""),
        ),
        Gate(
            "prompt_sha256",
            summary["same_hash"] == total,
            f"identical {fraction(summary['same_hash'], total)}",
        ),
        Gate(
            "top choice",
            summary["real_flips"] == 0 and summary["option_mismatches"] == 0 and len(compared) == total,
            f"same {fraction(summary['same_top'], total)}; tie flips {summary['tie_flips']} "
            f"(margin < {tie_margin:g}); real flips {summary['real_flips']}"
            + (
                f"; option-id mismatches {summary['option_mismatches']}"
                if summary["option_mismatches"]
                else ""
            ),
        ),
        Gate(
            "probability gap",
            max_seen is not None and max_seen <= max_gap,
            f"max {max_seen:.4g} (limit {max_gap:g}), median {summary['median_gap']:.4g}"
            if max_seen is not None
            else "nothing compared",
        ),
    ]
    details = {
        "disagreements": [c for c in compared if c["kind"] != "match"],
        "hash_mismatches": [c["id"] for c in compared if not c["same_hash"]],
        "missing_reference": missing,
        "errors": errors,
    }
    return Outcome(command, summary, gates, details)


def print_comparison(outcome: Outcome, ours: str = "ours", theirs: str = "reference") -> None:
    s = outcome.summary
    total = s["fixture_rows"]
    rows = [
        ["same top choice", fraction(s["same_top"], total)],
        ["identical prompt_sha256", fraction(s["same_hash"], total)],
        ["tie flips", s["tie_flips"]],
        ["real flips", s["real_flips"]],
        ["max probability gap", s["max_gap"]],
        ["median probability gap", s["median_gap"]],
    ]
    print_table(["check", "result"], rows, title=f"{outcome.command}: {ours} vs {theirs}")
    flips = outcome.details["disagreements"]
    if flips:
        print_table(
            ["id", f"{ours} top", f"{theirs} top", f"{ours} margin", f"{theirs} margin", "gap", "kind"],
            [
                [
                    d["id"],
                    d["our_top"],
                    d["reference_top"],
                    d["our_margin"],
                    d["reference_margin"],
                    d["gap"],
                    d["kind"],
                ]
                for d in flips[:MAX_PRINTED]
            ],
            title="disagreements (top-2 margin on both sides)"
            + (f", first {MAX_PRINTED}" if len(flips) > MAX_PRINTED else ""),
        )


# -- commands -----------------------------------------------------------------------------


def add_score(commands) -> None:
    p = commands.add_parser(
        "score", help="score a fixture through /decide and write the results as JSONL predictions"
    )
    add_connection_arguments(p)
    fixture_argument(p)
    p.add_argument("--predictions-out", required=True, type=Path, help="JSONL file of SemIf result dicts")
    p.add_argument(
        "--orderings",
        choices=("rotations", "all"),
        default=None,
        help="ask every row in these orderings (results then carry `combined`, for calibrate --mode)",
    )
    p.set_defaults(handler=run_score)


def run_score(args: argparse.Namespace) -> int:
    rows = load_fixture(args)
    client, service = connect(args)
    with client:
        extra = {"orderings": args.orderings} if args.orderings else {}
        results, errors = score_rows(client, rows, **extra)
    write_jsonl(args.predictions_out, (results[r["id"]] for r in rows if r["id"] in results))
    gates = [Gate("scored", not errors, f"{len(results)}/{len(rows)} rows scored")]
    print(f"wrote {len(results)} predictions to {args.predictions_out}")
    return finish(
        Outcome("score", {"rows": len(rows), "scored": len(results)}, gates, {"errors": errors}),
        args,
        service,
    )


def add_parity(commands) -> None:
    p = commands.add_parser("parity", help="compare /decide with upstream's committed predictions")
    add_connection_arguments(p)
    fixture_argument(p)
    p.add_argument(
        "--predictions", required=True, type=Path, help="upstream predictions JSONL (direct or serial schema)"
    )
    p.add_argument("--save-predictions", type=Path, default=None, help="also write our results as JSONL")
    comparison_arguments(p)
    p.set_defaults(handler=run_parity)


def run_parity(args: argparse.Namespace) -> int:
    rows = load_fixture(args)
    reference = by_id(read_jsonl(args.predictions), str(args.predictions))
    client, service = connect(args)
    with client:
        ours, errors = score_rows(client, rows, label="parity")
    if args.save_predictions:
        write_jsonl(args.save_predictions, (ours[r["id"]] for r in rows if r["id"] in ours))
    outcome = compare_against(
        "parity", [r["id"] for r in rows], ours, reference, errors, args.tie_margin, args.max_gap
    )
    print_comparison(outcome, theirs="upstream")
    return finish(outcome, args, service)


EXPECT_GATES = {
    "top": ("top choice",),
    "any": ("prompt_sha256", "top choice", "probability gap"),
}


def add_negative_control(commands) -> None:
    p = commands.add_parser(
        "negative-control",
        help="rotate option descriptions against their ids, score again: parity must now fail",
    )
    add_connection_arguments(p)
    fixture_argument(p)
    p.add_argument(
        "--predictions", required=True, type=Path, help="the same reference predictions parity uses"
    )
    p.add_argument("--shift", type=int, default=1, help="rotate descriptions by this many places")
    p.add_argument(
        "--expect",
        choices=sorted(EXPECT_GATES),
        default="top",
        help="which parity gate must fail: 'top' (the answers follow the descriptions; the spec saw "
        "14/144 same tops) or 'any' (the prompt-hash gate alone suffices, e.g. for a random-weight "
        "model whose answers ignore the option text)",
    )
    comparison_arguments(p)
    p.set_defaults(handler=run_negative_control)


def run_negative_control(args: argparse.Namespace) -> int:
    rows = load_fixture(args)
    if any(len(r["options"]) < 2 for r in rows):
        raise CheckError("every row needs at least two options to rotate")
    reference = by_id(read_jsonl(args.predictions), str(args.predictions))
    rotated = [rotate_descriptions(r, args.shift) for r in rows]
    client, service = connect(args)
    with client:
        ours, errors = score_rows(client, rotated, label="negative control")
    parity = compare_against(
        "negative-control", [r["id"] for r in rows], ours, reference, errors, args.tie_margin, args.max_gap
    )
    print_comparison(parity, ours="rotated", theirs="reference")
    outcome = negative_control_verdict(parity, args.expect)
    return finish(outcome, args, service)


def negative_control_verdict(parity: Outcome, expect: str) -> Outcome:
    """The negative control passes when the parity check, run on rotated prompts, fails where
    `expect` says. Every row must still have been scored and joined: a parity failure caused by
    refused rows proves nothing."""
    by_name = {g.name: g for g in parity.gates}
    failed = [name for name in EXPECT_GATES["any"] if not by_name[name].passed]
    wanted = [name for name in EXPECT_GATES[expect] if name in failed]
    gates = [
        by_name["scored"],
        Gate(
            f"parity fails ({expect})",
            bool(wanted),
            ("parity failed on: " + ", ".join(failed)) if failed else "parity PASSED on rotated descriptions",
        ),
    ]
    if "top choice" not in failed:
        log(
            "negative-control: the top choice still matched on "
            f"{parity.summary['same_top']}/{parity.summary['fixture_rows']} rotated rows: the model's "
            "answers do not follow the option text (expected of random weights, where only "
            "--expect any can pass; on the real model it means the parity check is blind)"
        )
    summary = {**parity.summary, "parity_failed_gates": failed, "expect": expect}
    return Outcome(
        "negative-control",
        summary,
        gates,
        {**parity.details, "parity_gates": [g.__dict__ for g in parity.gates]},
    )


__all__ = ["EXIT_PASS", "compare_against", "negative_control_verdict", "rotate_descriptions"]
