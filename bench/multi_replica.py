"""State affinity across replicas, measured: N demo replicas (real `semif-serve demo` processes,
each on its own loopback port) behind the gateway's HAProxy config, S states x Q questions over
C clients.

    uv run python bench/multi_replica.py                       # N=3, S=48, Q=4, C=6
    uv run python bench/multi_replica.py --states 96 --cache-mib 4

Each request is a /decide/shared with one question about one state. Reports, per routing mode,
the state reuse: the share of requests whose state came from the replica's state cache
(`timing.prefill` "cached" or "extended": stored, at most the question left to prefill) rather
than a fresh prefill; ideal (Q-1)/Q, every state's first question prefills and the rest reuse
it. Also the replicas' own /health state_cache counters (exact hits count only a repeated
state + question) and the requests per replica (max/mean). Modes, all through the same gateway:
  header     each request carries X-SemIf-State-Key (hex SHA-256 of the state)
  body       no header: the gateway hashes the JSON body's "state"
  leastconn  gzip bodies: the gateway cannot read the state, so least connections
Then: the share of states that move to another replica when one replica stops (ideal: the
1/N it held, and no other), and the requests lost (any answer but 200, or no answer) while that
replica drains under load (SIGTERM in the middle of a run). Not in CI: a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.gateway import REPLICA_HEADER, STATE_KEY_HEADER, Gateway, free_port, state_key
from harness.server import wait_healthy

TOKEN = "bench-multi-replica-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
QUESTIONS = [
    "Did the deployment succeed?",
    "Is a rollback needed?",
    "Should the on-call engineer be paged?",
    "Was the customer affected?",
    "Is the incident still open?",
    "Did the canary pass?",
]
OPTIONS = [
    {"id": "yes", "description": "Yes."},
    {"id": "no", "description": "No."},
    {"id": "unclear", "description": "It is unclear."},
]


def make_state(rng: random.Random, tag: str) -> str:
    """A ~150-word incident report; each one distinct from the first token on."""
    words = (
        "service latency error rollback canary zone deploy alert pager database cache queue "
        "timeout retry region replica upgrade config certificate node disk memory"
    ).split()
    body = " ".join(rng.choice(words) for _ in range(150))
    return f"Report {tag}: {body}."


class Replica:
    """One `semif-serve demo` process on a loopback port."""

    def __init__(self, index: int, cache_mib: int, demo_dir: Path, logs: Path) -> None:
        self.index = index
        self.port = free_port()
        env = {
            **os.environ,
            "SEMIF_PORT": str(self.port),
            "SEMIF_API_TOKEN": TOKEN,
            "SEMIF_STATE_CACHE_MIB": str(cache_mib),
            "SEMIF_DEMO_DIR": str(demo_dir),
            "SEMIF_SHUTDOWN_GRACE_SECONDS": "30",
        }
        self.log = (logs / f"replica{index}.log").open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "semif_serve.tools.cli", "demo"],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, seconds: float = 300) -> None:
        wait_healthy(
            self.url,
            self.process,
            seconds,
            lambda: f"replica {self.index} exited",
            f"replica {self.index} not ready",
        )

    def cache(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()["state_cache"]

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)


def request(client: httpx.Client, url: str, state: str, question: str, mode: str, rid: str):
    body = {"state": state, "decisions": [{"id": rid, "question": question, "options": OPTIONS}]}
    headers = dict(AUTH)
    if mode == "header":
        headers[STATE_KEY_HEADER] = state_key(state)
    if mode == "leastconn":
        content = gzip.compress(json.dumps(body).encode())
        headers.update({"Content-Encoding": "gzip", "Content-Type": "application/json"})
    else:
        content = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    try:
        response = client.post(f"{url}/decide/shared", content=content, headers=headers, timeout=120)
    except httpx.HTTPError as exc:
        return None, type(exc).__name__, None
    prefill = response.json()["timing"]["prefill"] if response.status_code == 200 else None
    return response.headers.get(REPLICA_HEADER), response.status_code, prefill


def workload(states: list[str], questions: int, rng: random.Random) -> list[tuple[str, str]]:
    """Q rounds; each round asks every state its next question, in a new random order."""
    jobs = []
    for q in range(questions):
        order = states[:]
        rng.shuffle(order)
        jobs.extend((state, QUESTIONS[q % len(QUESTIONS)]) for state in order)
    return jobs


def run(gateway: Gateway, jobs, mode: str, clients: int, on_progress=None):
    """Send `jobs` over `clients` connections; the (replica, status, prefill) of each, in job order."""
    results: list = [None] * len(jobs)
    done = [0]

    def worker(chunk):
        with httpx.Client() as client:
            for n, (state, question) in chunk:
                results[n] = request(client, gateway.url, state, question, mode, f"r{n}")
                done[0] += 1
                if on_progress:
                    on_progress(done[0])

    # Clients take jobs round-robin, so each state's questions come from different clients.
    chunks = [[(n, job) for n, job in enumerate(jobs) if n % clients == c] for c in range(clients)]
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(worker, chunks))
    return results


def totals(replicas) -> tuple[int, int]:
    caches = [r.cache() for r in replicas if r.process.poll() is None]
    return sum(c["hits"] for c in caches), sum(c["misses"] for c in caches)


def placement(gateway: Gateway, states: list[str]) -> dict[str, str]:
    with httpx.Client() as client:
        placed = {}
        for state in states:
            response = client.get(
                f"{gateway.url}/health", headers={STATE_KEY_HEADER: state_key(state)}, timeout=10
            )
            placed[state] = response.headers[REPLICA_HEADER]
    return placed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--states", type=int, default=48)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--cache-mib", type=int, default=2, help="each replica's SEMIF_STATE_CACHE_MIB")
    parser.add_argument("--balance", type=int, default=200, help="the gateway's hash-balance-factor")
    parser.add_argument("--seed", type=int, default=19)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    rng = random.Random(args.seed)

    from semif_serve.tools.cli import ensure_demo_checkpoint

    work = Path(tempfile.mkdtemp(prefix="semif-multi-"))
    demo_dir = ensure_demo_checkpoint(work / "demo-model")
    replicas = [Replica(i, args.cache_mib, demo_dir, work) for i in range(args.replicas)]
    report: dict = {
        "replicas": args.replicas,
        "states": args.states,
        "questions": args.questions,
        "clients": args.clients,
        "cache_mib": args.cache_mib,
        "balance": args.balance,
        "ideal_reuse": (args.questions - 1) / args.questions,
        "modes": {},
    }
    try:
        for replica in replicas:
            replica.wait_ready()
        with Gateway([r.port for r in replicas], work, balance=args.balance) as gateway:
            time.sleep(5)  # the first health checks (rise 2, every 2 s)
            # One state's bytes: what one fresh request adds to its replica's cache (the warm-up
            # leaves smaller entries of its own there).
            before = sum(r.cache()["bytes"] for r in replicas)
            request(httpx.Client(), gateway.url, make_state(rng, "probe"), QUESTIONS[0], "header", "probe")
            per_state = sum(r.cache()["bytes"] for r in replicas) - before
            report["state_bytes"] = per_state
            report["states_per_cache"] = int(args.cache_mib * 2**20 // per_state) if per_state else None
            print(
                f"one state: {per_state / 1024:.0f} KiB; a {args.cache_mib} MiB cache holds "
                f"{report['states_per_cache']} of the {args.states} states",
                flush=True,
            )

            for mode in ("header", "body", "leastconn"):
                states = [make_state(rng, f"{mode}-{i}") for i in range(args.states)]
                hits0, misses0 = totals(replicas)
                started = time.monotonic()
                jobs = workload(states, args.questions, rng)
                results = run(gateway, jobs, mode, args.clients)
                seconds = time.monotonic() - started
                hits, misses = totals(replicas)
                lookups = (hits - hits0) + (misses - misses0)
                per_replica = Counter(server.split("/")[1] for server, status, _ in results if status == 200)
                counts = [per_replica.get(f"semif{i}", 0) for i in range(args.replicas)]
                prefills = Counter(prefill for _, status, prefill in results if status == 200)
                # States whose questions were not all answered by one replica (bounded load spilled them).
                served_by: dict[str, set] = {}
                for (state, _), (server, _, _) in zip(jobs, results, strict=True):
                    served_by.setdefault(state, set()).add(server)
                spread = sum(1 for servers in served_by.values() if len(servers) > 1) / len(served_by)
                reuse = (prefills["cached"] + prefills["extended"]) / max(1, sum(prefills.values()))
                report["modes"][mode] = {
                    "reuse": reuse,
                    "reuse_of_ideal": reuse / report["ideal_reuse"],
                    "prefill": dict(prefills),
                    "states_on_several_replicas": spread,
                    "cache_hits_of_lookups": (hits - hits0) / lookups if lookups else None,
                    "requests_per_replica": counts,
                    "max_over_mean": max(counts) / statistics.mean(counts) if sum(counts) else None,
                    "failed": sum(1 for _, status, _ in results if status != 200),
                    "seconds": seconds,
                }
                print(mode, json.dumps(report["modes"][mode]), flush=True)

            # One replica stops while a header-mode run is under way.
            states = [make_state(rng, f"drain-{i}") for i in range(args.states)]
            before = placement(gateway, states)
            jobs = workload(states, args.questions, rng)
            victim = replicas[-1]
            stopped_at = {}

            def stop_midway(done: int) -> None:
                if done >= len(jobs) // 3 and not stopped_at:
                    stopped_at["request"] = done
                    victim.stop()

            log_mark = len(gateway.log.read_bytes())
            results = run(gateway, jobs, "header", args.clients, on_progress=stop_midway)
            victim.process.wait(timeout=60)
            time.sleep(5)
            after = placement(gateway, states)
            moved = [s for s in states if after[s] != before[s]]
            held = [s for s in states if before[s] == f"by_state/semif{victim.index}"]
            failures = Counter(str(status) for _, status, _ in results if status != 200)
            # HAProxy's log marks a request it resent to another replica with "+N" retries.
            log_tail = gateway.log.read_bytes()[log_mark:].decode(errors="replace")
            resent = len(re.findall(r" \d+/\d+/\d+/\d+/\+\d+ .*POST /decide/shared", log_tail))
            report["stop"] = {
                "stopped_after_requests": stopped_at.get("request"),
                "requests": len(results),
                "lost": sum(failures.values()),
                "lost_by_status": dict(failures),
                "resent_to_another_replica": resent,
                "victim_exit_code": victim.process.returncode,
                "states_moved_share": len(moved) / len(states),
                "states_held_by_stopped_share": len(held) / len(states),
                "moved_only_from_stopped": set(moved) == set(held),
            }
            print("stop", json.dumps(report["stop"]), flush=True)
    finally:
        for replica in replicas:
            replica.stop()
        for replica in replicas:
            try:
                replica.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                replica.process.kill()
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
