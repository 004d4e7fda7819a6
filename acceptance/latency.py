"""`latency`: the spec's latency table (short /decide, ~2,000-token state, 3 rotations, 6
orderings, 3 rotations on the long state), N runs x M requests, median and p90 end to end and
server-side (the result's `total_seconds`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from harness.client import Client, ServiceCallError
from harness.report import log, print_table
from harness.stats import median, percentile
from harness.workloads import LATENCY_CASES, FittedStates, LatencyCase, fit_latency_states

from .common import CheckError, Gate, Outcome, add_connection_arguments, connect, finish


def add_latency(commands) -> None:
    p = commands.add_parser(
        "latency", help="the spec's latency table: median and p90, end to end and server-side"
    )
    add_connection_arguments(p)
    p.add_argument("--runs", type=int, default=3, help="runs (N)")
    p.add_argument("--requests", type=int, default=20, help="requests per run and row (M)")
    p.add_argument("--short-tokens", type=int, default=130, help="prompt tokens of the short decision")
    p.add_argument("--long-tokens", type=int, default=2000, help="state tokens of the long decision")
    p.add_argument(
        "--max-median-ms",
        action="append",
        default=[],
        metavar="ROW=MS",
        help="gate: a row's median end-to-end latency at most MS (ROW is its 1-based number); repeatable",
    )
    p.set_defaults(handler=run_latency)


def measure_latency(
    client: Client, states: FittedStates, cases: Sequence[LatencyCase], runs: int, requests: int
) -> list[dict[str, Any]]:
    """Runs interleave the rows (run 1 of every row, then run 2, ...) so drift hits all rows
    alike; each row gets one unrecorded warm-up request first."""
    samples: list[dict[str, list[float]]] = [{"e2e": [], "server": [], "run_medians": []} for _ in cases]
    tokens: list[int | None] = [None] * len(cases)
    errors: list[list[dict[str, Any]]] = [[] for _ in cases]
    for i, case in enumerate(cases):
        try:
            result, _ = client.decide(case.body(states.state(case), "warm-up"))
            tokens[i] = result["input_tokens"]
        except ServiceCallError as exc:
            errors[i].append(exc.as_dict())
    for run in range(runs):
        for i, case in enumerate(cases):
            run_e2e = []
            for k in range(requests):
                try:
                    result, elapsed = client.decide(case.body(states.state(case), f"r{run}-{k}"))
                except ServiceCallError as exc:
                    errors[i].append(exc.as_dict())
                    continue
                run_e2e.append(elapsed)
                samples[i]["server"].append(float(result["total_seconds"]))
            samples[i]["e2e"].extend(run_e2e)
            if run_e2e:
                samples[i]["run_medians"].append(median(run_e2e))
        log(f"latency: run {run + 1}/{runs} done")
    rows = []
    for i, case in enumerate(cases):
        e2e, server = samples[i]["e2e"], samples[i]["server"]
        rows.append(
            {
                "row": i + 1,
                "name": case.name,
                "orderings": case.orderings,
                "input_tokens": tokens[i],
                "requests": len(e2e),
                "e2e_median_ms": 1000 * median(e2e) if e2e else None,
                "e2e_p90_ms": 1000 * percentile(e2e, 90) if e2e else None,
                "server_median_ms": 1000 * median(server) if server else None,
                "server_p90_ms": 1000 * percentile(server, 90) if server else None,
                "run_median_ms": [1000 * m for m in samples[i]["run_medians"]],
                "errors": errors[i],
            }
        )
    return rows


WAIT_METRIC = "semif_engine_wait_seconds"
WAIT_BUDGET_MS = 5.0  # a request sent with nothing in flight waits a few ms for the engine at most


def engine_waits(client: Client) -> tuple[float, float]:
    """The service's engine-wait histogram now: (seconds summed, requests counted)."""
    from prometheus_client.parser import text_string_to_metric_families

    seconds = count = 0.0
    for family in text_string_to_metric_families(client.metrics()):
        if family.name != WAIT_METRIC:
            continue
        for sample in family.samples:
            if sample.name == f"{WAIT_METRIC}_sum":
                seconds = sample.value
            elif sample.name == f"{WAIT_METRIC}_count":
                count = sample.value
    return seconds, count


def waits_between(before: tuple[float, float], after: tuple[float, float]) -> dict[str, Any]:
    """The requests answered between two reads of `engine_waits`, and their mean wait in ms."""
    requests = after[1] - before[1]
    mean = 1000 * (after[0] - before[0]) / requests if requests else None
    return {"requests": int(requests), "mean_ms": mean}


def short_after_lone_long(client: Client, states: FittedStates, tag: str) -> dict[str, Any]:
    """A lone question on a NEW long state, then at once a short `/decide`: the short one's
    end-to-end latency and its wait for the engine (nothing of the long one may still hold the
    engine: it has answered). One `/metrics` read sits between the two."""
    case = LATENCY_CASES[0]
    long_reply, long_elapsed = client.decide(case.body(f"Run {tag}. {states.long}", f"{tag}-long"))
    before = engine_waits(client)
    short_reply, short_elapsed = client.decide(case.body(f"Run {tag}. {states.short}", f"{tag}-short"))
    waited = waits_between(before, engine_waits(client))
    return {
        "long_input_tokens": long_reply["input_tokens"],
        "long_e2e_ms": 1000 * long_elapsed,
        "short_e2e_ms": 1000 * short_elapsed,
        "short_server_ms": 1000 * float(short_reply["total_seconds"]),
        "short_wait_ms": waited["mean_ms"],
    }


def wait_gates(waits: dict[str, Any], follow_ups: list[dict[str, Any]]) -> list[Gate]:
    """Requests sent one at a time waited no more than WAIT_BUDGET_MS for the engine on average,
    and no short request sent right after a lone long question more than that."""
    mean = waits.get("mean_ms")
    worst = max((f["short_wait_ms"] or 0.0 for f in follow_ups), default=0.0)
    return [
        Gate(
            "latency rows wait little for the engine",
            mean is not None and mean <= WAIT_BUDGET_MS,
            f"mean {mean} ms (budget {WAIT_BUDGET_MS} ms)",
        ),
        Gate(
            "a short request after a lone long one waits little for the engine",
            bool(follow_ups) and worst <= WAIT_BUDGET_MS,
            f"worst {worst:.2f} ms over {len(follow_ups)} (budget {WAIT_BUDGET_MS} ms)",
        ),
    ]


def print_latency(
    rows: list[dict[str, Any]], states: FittedStates, runs: int, requests: int, title: str = "latency"
) -> None:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    print_table(
        ["#", "request", "input tok", "e2e median ms", "e2e p90 ms", "server median ms", "server p90 ms"],
        [
            [
                r["row"],
                r["name"],
                r["input_tokens"],
                ms(r["e2e_median_ms"]),
                ms(r["e2e_p90_ms"]),
                ms(r["server_median_ms"]),
                ms(r["server_p90_ms"]),
            ]
            for r in rows
        ],
        title=f"{title}: {runs} runs x {requests} requests; short prompt ~{states.short_input_tokens} tok, "
        f"long state ~{states.long_state_tokens} tok",
    )


def parse_budgets(values: list[str], rows: int) -> dict[int, float]:
    budgets = {}
    for value in values:
        row, sep, limit = value.partition("=")
        if not sep or not row.isdigit() or not 1 <= int(row) <= rows:
            raise CheckError(f"--max-median-ms {value!r}: expected ROW=MS with ROW in 1..{rows}")
        budgets[int(row)] = float(limit)
    return budgets


def latency_gates(rows: list[dict[str, Any]], budgets: dict[int, float]) -> list[Gate]:
    failed = sum(len(r["errors"]) for r in rows)
    gates = [
        Gate("answered", failed == 0, f"{sum(r['requests'] for r in rows)} requests timed, {failed} refused")
    ]
    for row, limit in sorted(budgets.items()):
        value = rows[row - 1]["e2e_median_ms"]
        gates.append(
            Gate(
                f"row {row} median",
                value is not None and value <= limit,
                f"{value if value is None else round(value, 1)} ms (limit {limit:g})",
            )
        )
    return gates


def run_latency(args: argparse.Namespace) -> int:
    budgets = parse_budgets(args.max_median_ms, len(LATENCY_CASES))
    client, service = connect(args)
    with client:
        log("latency: fitting the short and long states to the service's tokenizer")
        states = fit_latency_states(client, args.short_tokens, args.long_tokens)
        rows = measure_latency(client, states, LATENCY_CASES, args.runs, args.requests)
    print_latency(rows, states, args.runs, args.requests)
    summary = {
        "runs": args.runs,
        "requests": args.requests,
        "short_input_tokens": states.short_input_tokens,
        "long_state_tokens": states.long_state_tokens,
        "rows": rows,
    }
    return finish(Outcome("latency", summary, latency_gates(rows, budgets)), args, service)
