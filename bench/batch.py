"""Issue 40's measurements, side by side in one run on the bench checkpoint (CPU): items per second
of `semif-serve run-batch` against the service driven by 16 concurrent HTTP clients on the same
lines, and of run-batch on a file whose lines repeat a few states against a file of new states.

    python bench/batch.py                 # every file, 2 rounds, sides interleaved
    python bench/batch.py --rounds 3 --tokens 500 --lines 96

Files (native /decide lines, one yes/no question each, states of about `--tokens` tokens):
- tickets: `lines/4` states x 4 questions, shuffled (a dataset of tickets, each asked 4 things);
- new: every line a new state;
- few: 4 states, each asked `lines/4` questions, shuffled.
Every round writes new states (tagged by round and side), so no side finds a state cached by
an earlier round. run-batch runs as its own process with the service's settings; its figure is
the summary's (lines over the seconds from the first line read to the last written, startup
left out, as the service's startup is); the service's is its lines over the seconds from the
first request sent to the last answer. The sides take turns, the order swapped every round.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SENTENCE = "Ticket {t}: the service returned errors for {n} minutes after release {r}, then recovered. "
OPTIONS = [{"id": "yes", "description": "It succeeded."}, {"id": "no", "description": "It failed."}]
SETTINGS = {"device": "cpu", "max_input_tokens": 8192, "release_margin_mib": 64}
CLIENTS = 16
SUMMARY = re.compile(r"run-batch: (\d+) lines, .*?; ([\d.]+) s \(")


def state_of(tokens: int, tag: str) -> str:
    """A new state (unique by `tag`) of about `tokens` prompt tokens (~22 tokens a sentence)."""
    return f"[{tag}] " + "".join(SENTENCE.format(t=tag, n=i, r=i % 7) for i in range(max(1, tokens // 22)))


def batch_lines(kind: str, lines: int, tokens: int, tag: str) -> list[str]:
    """The file `kind` (tickets, new, few) as batch lines, its states unique to `tag`."""
    states = {"tickets": lines // 4, "new": lines, "few": 4}[kind]
    texts = [state_of(tokens, f"{tag} state {s}") for s in range(states)]
    rows = [(i % states, i) for i in range(lines)]
    if kind != "new":
        random.Random(tag).shuffle(rows)
    out = []
    for s, i in rows:
        body = {"id": f"q{i}", "state": texts[s], "question": f"Did step {i} succeed?", "options": OPTIONS}
        out.append(json.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": "/decide", "body": body}))
    return out


def service_rate(url: str, token: str, lines: list[str]) -> float:
    """Items/s of the service: 16 clients, each sending the next line as soon as its answer arrives."""
    bodies = iter([json.loads(text)["body"] for text in lines])
    lock = threading.Lock()
    headers = {"Authorization": f"Bearer {token}"}

    def client() -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            while True:
                with lock:
                    body = next(bodies, None)
                if body is None:
                    return
                reply = http.post("/decide", json=body, headers=headers)
                if reply.status_code != 200:
                    raise RuntimeError(f"{reply.status_code} {reply.text[:300]}")

    started = time.perf_counter()
    with ThreadPoolExecutor(CLIENTS) as pool:
        for done in [pool.submit(client) for _ in range(CLIENTS)]:
            done.result()
    return len(lines) / (time.perf_counter() - started)


def batch_rate(path: Path, lines: list[str], work: Path, name: str) -> float:
    """Items/s of `semif-serve run-batch` on `lines` (its own process, the service's settings)."""
    source, out = work / f"{name}.jsonl", work / f"{name}.out.jsonl"
    source.write_text("".join(f"{text}\n" for text in lines), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEMIF_")}
    env.update({f"SEMIF_{k.upper()}": str(v) for k, v in SETTINGS.items()})
    env.update(SEMIF_MODEL_PATH=str(path), SEMIF_MODEL_REVISION=revision(), PYTHONPATH=f"{ROOT}/src:{ROOT}")
    command = [sys.executable, "-m", "semif_serve.tools.cli", "run-batch", "-i", str(source), "-o", str(out)]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    found = SUMMARY.search(run.stderr)
    if run.returncode != 0 or found is None:
        raise RuntimeError(f"run-batch exited {run.returncode}: {run.stderr[-2000:]}")
    statuses = {json.loads(text)["response"]["status_code"] for text in out.read_text().splitlines()}
    if statuses != {200}:
        raise RuntimeError(f"run-batch answered {statuses}")
    return int(found[1]) / float(found[2])


def revision() -> str:
    from semif_serve.tools.demo import DEMO_REVISION

    return DEMO_REVISION


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--lines", type=int, default=96)
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here too")
    args = parser.parse_args()
    from bench.run import bench_checkpoint
    from harness.server import ServiceProcess

    path = bench_checkpoint()
    work = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    load = os.getloadavg()[0]
    rates: dict[str, list[float]] = {}
    with ServiceProcess(path, revision(), SETTINGS, work / "service") as service:
        warm = batch_lines("new", 2, 40, "warm")
        service_rate(service.url, service.token, warm)
        for r in range(args.rounds):
            for kind in ("tickets", "new"):
                sides = ["service", "batch"] if r % 2 == 0 else ["batch", "service"]
                for side in sides:
                    lines = batch_lines(kind, args.lines, args.tokens, f"r{r} {kind} {side}")
                    if side == "service":
                        rate = service_rate(service.url, service.token, lines)
                    else:
                        rate = batch_rate(path, lines, work, f"r{r}-{kind}")
                    rates.setdefault(f"{kind} {side}", []).append(rate)
                    print(f"round {r}: {kind:8} {side:8} {rate:6.2f} items/s", flush=True)
            lines = batch_lines("few", args.lines, args.tokens, f"r{r} few")
            rates.setdefault("few batch", []).append(batch_rate(path, lines, work, f"r{r}-few"))
            print(f"round {r}: few      batch    {rates['few batch'][-1]:6.2f} items/s", flush=True)
    median = {name: statistics.median(values) for name, values in rates.items()}
    figures: dict[str, Any] = {
        "load_before": round(load, 2),
        "load_after": round(os.getloadavg()[0], 2),
        "rounds": {name: [round(v, 2) for v in values] for name, values in rates.items()},
        "median": {name: round(v, 2) for name, v in median.items()},
        "tickets batch / service": round(median["tickets batch"] / median["tickets service"], 2),
        "new batch / service": round(median["new batch"] / median["new service"], 2),
        "few / new (batch, per item)": round(median["few batch"] / median["new batch"], 2),
    }
    print(json.dumps(figures, indent=2))
    print_table(args, median, rates)
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


def print_table(args: argparse.Namespace, median: dict[str, float], rates: dict[str, list[float]]) -> None:
    """The RESULTS.md table."""
    shown = {name: " / ".join(f"{v:.2f}" for v in values) for name, values in rates.items()}
    print(
        f"\n| file ({args.lines} lines, ~{args.tokens}-token states) | run-batch items/s | "
        f"service, {CLIENTS} HTTP clients, items/s | run-batch / service |"
    )
    print("|---|---|---|---|")
    for kind, label in (
        ("tickets", f"{args.lines // 4} tickets x 4 questions, shuffled"),
        ("new", "new states"),
    ):
        b, s = median[f"{kind} batch"], median[f"{kind} service"]
        batch, service = shown[f"{kind} batch"], shown[f"{kind} service"]
        print(f"| {label} | {b:.2f} ({batch}) | {s:.2f} ({service}) | {b / s:.2f}x |")
    few, new = median["few batch"], median["new batch"]
    print(
        f"| 4 states x {args.lines // 4} questions, shuffled | {few:.2f} ({shown['few batch']}) | | "
        f"{few / new:.2f}x new states (run-batch, per item) |"
    )


if __name__ == "__main__":
    sys.exit(main())
