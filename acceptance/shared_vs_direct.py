"""`shared-vs-direct`: rows that share a state, sent together through /decide/shared, must
answer as they do one by one through /decide."""

from __future__ import annotations

import argparse
from typing import Any

from harness.client import Client, ServiceCallError
from harness.report import log

from .common import (
    CheckError,
    add_connection_arguments,
    connect,
    finish,
    score_rows,
    shared_question,
    state_key,
)
from .parity import compare_against, comparison_arguments, fixture_argument, load_fixture, print_comparison


def add_shared_vs_direct(commands) -> None:
    p = commands.add_parser("shared-vs-direct", help="group rows by state: /decide/shared vs /decide per row")
    add_connection_arguments(p)
    fixture_argument(p)
    comparison_arguments(p)
    p.add_argument("--min-group", type=int, default=2, help="only states shared by at least this many rows")
    p.set_defaults(handler=run_shared_vs_direct)


def group_by_state(rows: list[dict[str, Any]], min_group: int) -> list[list[dict[str, Any]]]:
    """Rows grouped by exact state (as rendered), in fixture order; groups under `min_group` dropped."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(state_key(row["state"]), []).append(row)
    return [g for g in groups.values() if len(g) >= min_group]


def score_shared(
    client: Client, groups: list[list[dict[str, Any]]], max_rows: int
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Each group through /decide/shared, split into requests of at most `max_rows` decisions."""
    results: dict[str, dict[str, Any]] = {}
    errors: dict[str, dict[str, Any]] = {}
    timings = []
    for n, group in enumerate(groups, 1):
        for start in range(0, len(group), max_rows):
            chunk = group[start : start + max_rows]
            try:
                reply, _ = client.decide_shared(chunk[0]["state"], [shared_question(r) for r in chunk])
            except ServiceCallError as exc:
                errors.update({r["id"]: exc.as_dict() for r in chunk})
                continue
            timings.append(reply.get("timing", {}))
            for result in reply["results"]:
                results[result["id"]] = result
        if n % 10 == 0 or n == len(groups):
            log(f"shared: {n}/{len(groups)} states")
    return results, errors, timings


def run_shared_vs_direct(args: argparse.Namespace) -> int:
    rows = load_fixture(args)
    groups = group_by_state(rows, args.min_group)
    if not groups:
        raise CheckError(f"no state is shared by {args.min_group} or more rows")
    members = [r for g in groups for r in g]
    client, service = connect(args)
    max_rows = int((service.get("limits") or {}).get("max_rows", 64))
    with client:
        shared, shared_errors, timings = score_shared(client, groups, max_rows)
        direct, direct_errors = score_rows(client, members, label="direct")
    outcome = compare_against(
        "shared-vs-direct",
        [r["id"] for r in members],
        shared,
        direct,
        {**shared_errors, **direct_errors},
        args.tie_margin,
        args.max_gap,
        reference_name="direct",
    )
    outcome.summary["states"] = len(groups)
    outcome.details["shared_timings"] = timings
    print_comparison(outcome, ours="shared", theirs="direct")
    return finish(outcome, args, service)


__all__ = ["group_by_state", "score_shared"]
