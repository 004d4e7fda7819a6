"""System One over HTTP, side by side in one run, printed as one table.

    uv run python bench/systemone.py                 # the bench checkpoint (hidden 384, 8 layers)
    uv run python bench/systemone.py --shape demo    # the tiny demo checkpoint (seconds)

It starts the real service as a child process on a loopback port (fp32 on CPU, the default
orderings policy) and measures, end to end through `POST /v1/systemone`:

1. 8 questions (4 noul, 2 choice of 4 options, 2 score of 5 levels) in ONE request vs the same
   8 as 8 single-question requests in a row, over a ~1,000-token state (goal >= 4x), in the
   default orderings policy (20 rows) and with every question asked once (8 rows);
2. a 255-option choice vs a 5-option choice on the same state, each one row in one forward
   (`x_orderings: none`), and the 255-option one in the default policy (`shifts`).

Rounds are interleaved so drift on a shared machine hits every side alike; medians.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.run import bench_checkpoint, environment
from harness.client import Client
from harness.report import format_table, log, write_result
from harness.server import ServiceProcess
from harness.stats import median
from harness.workloads import filler, fit_words, prefix_tokens_probe

SYSTEMONE = "/v1/systemone"
GOAL_SPEEDUP = 4.0
EIGHT_QUESTIONS: dict[str, dict[str, Any]] = {
    "outage": {"type": "noul", "instructions": "Does the evidence describe an outage?"},
    "rollback": {"type": "noul", "instructions": "Was a rollback performed?"},
    "customer-impact": {"type": "noul", "instructions": "Were customers affected?"},
    "resolved": {"type": "noul", "instructions": "Is the incident resolved?"},
    "team": {
        "type": "choice",
        "instructions": "Which team owns the follow-up?",
        "criteria": {
            "platform": "Infrastructure and deploys.",
            "payments": None,
            "search": None,
            "mobile": None,
        },
    },
    "cause": {
        "type": "choice",
        "instructions": "What was the main cause?",
        "criteria": {
            "config": "A configuration change.",
            "capacity": None,
            "code": "A code defect.",
            "unknown": None,
        },
    },
    "severity": {
        "type": "score",
        "instructions": "How severe was the incident?",
        "criteria": ["none", "minor", "moderate", "major", "critical"],
    },
    "confidence-in-fix": {
        "type": "score",
        "instructions": "How sure are the engineers that the fix holds?",
        "criteria": ["not at all", "a little", "somewhat", "mostly", "fully"],
    },
}


def ask(client: Client, state: str, questions: dict[str, Any]) -> tuple[dict[str, Any], float]:
    return client.post(SYSTEMONE, {"model": "jev-latest", "state": state, "questions": questions})


def one_vs_eight(client: Client, state: str, rounds: int, orderings: str | None) -> dict[str, Any]:
    """The 8 questions in one request vs 8 single-question requests in a row (every question in
    `orderings` when given, else in the service's policy)."""
    questions = {
        qid: {**q, "x_orderings": orderings} if orderings is not None else q
        for qid, q in EIGHT_QUESTIONS.items()
    }
    ask(client, state, questions)  # warm
    together, apart = [], []
    reply: dict[str, Any] = {}
    singles: list[dict[str, Any]] = []
    for _ in range(rounds):
        reply, elapsed = ask(client, state, questions)
        together.append(elapsed)
        started = time.perf_counter()
        singles = [ask(client, state, {qid: q})[0] for qid, q in questions.items()]
        apart.append(time.perf_counter() - started)
    rows = sum(a["x_semif"]["rows"] for a in reply["answers"].values())
    return {
        "questions": len(EIGHT_QUESTIONS),
        "rows": rows,
        "one_request_s": together,
        "eight_requests_s": apart,
        "one_request_median_s": median(together),
        "eight_requests_median_s": median(apart),
        "speedup": median(apart) / median(together),
        "input_tokens_one": reply["usage"]["input_tokens"],
        "input_tokens_eight": sum(s["usage"]["input_tokens"] for s in singles),
        "met": median(apart) / median(together) >= GOAL_SPEEDUP,
    }


def choice_of(n: int, orderings: str | None) -> dict[str, Any]:
    question: dict[str, Any] = {
        "type": "choice",
        "instructions": "Which runbook entry matches the evidence best?",
        "criteria": {f"runbook {i:03d}": None for i in range(n)},
    }
    if orderings is not None:
        question["x_orderings"] = orderings
    return {"pick": question}


def wide_vs_narrow(client: Client, state: str, rounds: int) -> dict[str, Any]:
    """A 255-option choice vs a 5-option one on the same state (one row each), and 255 with shifts."""
    cases = {"5 options": choice_of(5, "none"), "255 options": choice_of(255, "none")}
    cases["255 options, default policy"] = choice_of(255, None)
    for questions in cases.values():
        ask(client, state, questions)  # warm
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    replies: dict[str, dict[str, Any]] = {}
    for _ in range(rounds):
        for name, questions in cases.items():
            replies[name], elapsed = ask(client, state, questions)
            seconds[name].append(elapsed)
    out: dict[str, Any] = {}
    for name, reply in replies.items():
        pick = reply["answers"]["pick"]
        out[name] = {
            "median_s": median(seconds[name]),
            "seconds": seconds[name],
            "rows": pick["x_semif"]["rows"],
            "orderings": pick["x_semif"]["orderings"],
            "prompt_tokens": pick["x_semif"]["input_tokens"],
            "evaluated_tokens": reply["usage"]["input_tokens"],
            "options": len(pick["probabilities"]),
        }
    out["ratio"] = out["255 options"]["median_s"] / out["5 options"]["median_s"]
    return out


def table_rows(r: dict[str, Any]) -> list[list[str]]:
    rows = []
    for policy, s in r.get("one_vs_eight", {}).items():
        rows.append(
            [
                f"8 questions, {policy}: 1 request vs 8 (~{r['state_tokens']}-token state, {s['rows']} rows)",
                f"{1000 * s['one_request_median_s']:.0f} ms vs {1000 * s['eight_requests_median_s']:.0f} ms "
                f"= {s['speedup']:.1f}x (tokens {s['input_tokens_one']} vs {s['input_tokens_eight']})",
                f">= {GOAL_SPEEDUP:g}x",
                "yes" if s["met"] else "NO",
            ]
        )
    if "wide_vs_narrow" not in r:
        return rows
    w = r["wide_vs_narrow"]
    for name in ("5 options", "255 options", "255 options, default policy"):
        c = w[name]
        rows.append(
            [
                f"choice of {name} ({c['rows']} row(s), {c['prompt_tokens']}-token prompt)",
                f"{1000 * c['median_s']:.0f} ms"
                + (f" = {w['ratio']:.2f}x the 5-option one" if name == "255 options" else ""),
                "(report)",
                "-",
            ]
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("bench", "demo"), default="bench", help="the checkpoint to serve")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per measurement")
    parser.add_argument(
        "--only",
        choices=("eight", "wide", "eight,wide"),
        default="eight,wide",
        help="the measurements to run",
    )
    parser.add_argument("--cache", type=Path, default=None, help="bench checkpoint cache directory")
    parser.add_argument("--out", type=Path, default=None, help="also write the raw results as JSON")
    args = parser.parse_args(argv)
    wall = time.perf_counter()
    from semif_serve.tools.demo import DEMO_REVISION, write_checkpoint

    work = Path(tempfile.mkdtemp(prefix="semif-bench-s1-"))
    if args.shape == "bench":
        model = bench_checkpoint(args.cache)
    else:
        model = write_checkpoint(work / "demo-model")
    results: dict[str, Any] = {"shape": args.shape, "rounds": args.rounds, "environment": environment()}
    results["load_average_before"] = os.getloadavg()
    try:
        with ServiceProcess(model, DEMO_REVISION, {"device": "cpu", "dtype": "float32"}, work) as service:
            with Client(service.url, service.token) as client:
                results["orderings_policy"] = "noul=rotations,choice=shifts,score=reversal (default)"
                words, tokens = fit_words(prefix_tokens_probe(client), 1000)
                state = filler(words)
                results["state_tokens"] = tokens
                if "eight" in args.only:
                    log("bench: 8 questions in one request vs 8 requests")
                    results["one_vs_eight"] = {
                        "default policy": one_vs_eight(client, state, args.rounds, None),
                        "asked once each": one_vs_eight(client, state, args.rounds, "none"),
                    }
                if "wide" in args.only:
                    log("bench: 255 options vs 5")
                    results["wide_vs_narrow"] = wide_vs_narrow(client, state, args.rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["load_average_after"] = os.getloadavg()
    results["wall_seconds"] = time.perf_counter() - wall
    env = results["environment"]
    shape = (
        "bench checkpoint (hidden 384, 8 layers, vocab 248,320)"
        if args.shape == "bench"
        else "demo checkpoint"
    )
    print(
        f"semif-serve System One bench: {shape}, float32 on {env['cpus']} CPUs, torch {env['torch']} "
        f"({env['torch_threads']} threads); {args.rounds} rounds; {results['wall_seconds']:.0f} s; "
        f"load average before/after {results['load_average_before'][0]:.2f}/"
        f"{results['load_average_after'][0]:.2f}"
    )
    print(format_table(["measurement", "measured", "target", "met"], table_rows(results)))
    if args.out:
        write_result(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
