"""The service benchmarks on this machine's CPU, side by side in one run, printed as one table.

    uv run python bench/run.py            # the full run (a few minutes on 2 cores)
    uv run python bench/run.py --quick    # a smoke version

It builds (once, then cached) the "bench" checkpoint: random weights, Qwen3.5's layer mix,
hidden 384, 8 layers and the real 248,320-token vocabulary, so the embedding and the logits
projection cost what they cost. It starts the real service as a child process on a loopback
port (its own GIL, its own RSS) and measures, over HTTP:

1. /decide/shared with 21 binary criteria over a ~1,000-token state vs 21 sequential /decide
   (target >= 8x);
2. service overhead: median end-to-end /decide minus the engine's own forward time for the
   same ~500-token row (targets <= 5 ms and <= 5 % of the total);
3. 3 rotations on a ~2,000-token state vs one order (target <= 1.3x);
4. memory: RSS before, at the peak of, and after a burst of the largest allowed requests
   (settled within 5 % of the pre-burst baseline);
5. concurrency: 16 clients vs 1 client on short decisions (requests/s, p50/p99).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from harness.client import Client
from harness.report import format_table, log, write_result
from harness.server import ServiceProcess, read_rss, reset_peak_rss
from harness.stats import median, percentile
from harness.workloads import (
    DEPLOYMENT_OPTIONS,
    DEPLOYMENT_QUESTION,
    QUEUE_OPTIONS,
    QUEUE_QUESTION,
    binary_criteria,
    filler,
    fit_words,
    input_tokens_probe,
    prefix_tokens_probe,
)
from semif_serve.domain.numerics import MIB


@dataclass(frozen=True)
class Plan:
    """How much of each measurement to run."""

    shared_runs: int = 3
    overhead_requests: int = 30
    rotation_requests: int = 10
    burst_requests: int = 4
    serial_requests: int = 48
    concurrent_clients: int = 16
    concurrent_requests_each: int = 6


FULL = Plan()
QUICK = Plan(
    shared_runs=1,
    overhead_requests=8,
    rotation_requests=3,
    burst_requests=2,
    serial_requests=16,
    concurrent_clients=16,
    concurrent_requests_each=2,
)


# -- the checkpoint -----------------------------------------------------------------------


def bench_checkpoint(cache: Path | None = None) -> Path:
    """The bench checkpoint, built once into the cache (keyed by its shape) and reused."""
    from semif_serve.tools.demo import BENCH_SHAPE, DEMO_REVISION, write_checkpoint

    key = hashlib.sha256(repr((BENCH_SHAPE, DEMO_REVISION)).encode()).hexdigest()[:12]
    base = cache or Path(
        os.environ.get("SEMIF_BENCH_DIR") or Path(tempfile.gettempdir()) / "semif-serve-bench"
    )
    directory = base / f"bench-model-{key}"
    if (directory / "DEMO.json").exists():
        return directory
    log(f"bench: building the bench checkpoint in {directory} (once) ...")
    staging = Path(tempfile.mkdtemp(prefix="bench-model-", dir=base if base.exists() else None))
    write_checkpoint(staging, BENCH_SHAPE)
    base.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(directory, ignore_errors=True)
    shutil.move(str(staging), str(directory))
    return directory


# -- measurements -------------------------------------------------------------------------


def shared_vs_sequential(client: Client, state: str, runs: int) -> dict[str, Any]:
    """21 binary criteria over one state: one /decide/shared vs 21 sequential /decide, end to end
    (the server-side sums are kept beside them)."""
    criteria = binary_criteria(21)
    shared, sequential, shared_server, sequential_server = [], [], [], []
    timing: dict[str, Any] = {}
    for _ in range(runs):
        reply, elapsed = client.decide_shared(state, criteria)
        timing = reply["timing"]
        shared.append(elapsed)
        shared_server.append(reply["results"][0]["total_seconds"])
        started = time.perf_counter()
        server = 0.0
        for c in criteria:
            result, _ = client.decide({**c, "state": state})
            server += result["total_seconds"]
        sequential.append(time.perf_counter() - started)
        sequential_server.append(server)
    ratio = median(sequential) / median(shared)
    # Diagnostic: the same 21 decisions with terse questions, so every suffix fits in one
    # 64-token chunk of the reference (CPU) gated delta rule, which pads each row's suffix up
    # to a multiple of 64 tokens.
    terse = [{**c, "question": f"Q{i + 1}?"} for i, c in enumerate(criteria)]
    terse_sequential = 0.0
    for c in terse:
        terse_sequential += client.decide({**c, "state": state})[1]
    reply, terse_shared = client.decide_shared(state, terse)
    return {
        "prefix_tokens": timing.get("prefix_tokens"),
        "shared_timing": timing,
        "shared_s": shared,
        "sequential_s": sequential,
        "shared_server_s": shared_server,
        "sequential_server_s": sequential_server,
        "shared_median_s": median(shared),
        "sequential_median_s": median(sequential),
        "speedup": ratio,
        "server_speedup": median(sequential_server) / median(shared_server),
        "met": ratio >= 8.0,
        "terse_timing": reply["timing"],
        "terse_shared_s": terse_shared,
        "terse_sequential_s": terse_sequential,
        "terse_speedup": terse_sequential / terse_shared,
    }


def overhead(client: Client, state: str, requests: int) -> dict[str, Any]:
    body = {"id": "overhead", "state": state, "question": DEPLOYMENT_QUESTION, "options": DEPLOYMENT_OPTIONS}
    client.decide(body)  # warm
    e2e, forward, total = [], [], []
    tokens = None
    for _ in range(requests):
        result, elapsed = client.decide(body)
        e2e.append(elapsed)
        forward.append(result["forward_seconds"])
        total.append(result["total_seconds"])
        tokens = result["input_tokens"]
    floor = []
    for _ in range(requests):  # the HTTP floor: an open GET through the same client and app
        started = time.perf_counter()
        client.health()
        floor.append(time.perf_counter() - started)
    over = median(e2e) - median(forward)
    paired = median([a - b for a, b in zip(e2e, forward, strict=True)])
    share = over / median(e2e)
    return {
        "input_tokens": tokens,
        "e2e_median_ms": 1000 * median(e2e),
        "forward_median_ms": 1000 * median(forward),
        "server_total_median_ms": 1000 * median(total),
        "overhead_ms": 1000 * over,
        "overhead_paired_median_ms": 1000 * paired,
        "in_server_outside_forward_ms": 1000 * (median(total) - median(forward)),
        "health_round_trip_ms": 1000 * median(floor),
        "overhead_share": share,
        "met": over <= 0.005 and share <= 0.05,
    }


def rotations_vs_single(client: Client, state: str, requests: int) -> dict[str, Any]:
    single = {"id": "one", "state": state, "question": QUEUE_QUESTION, "options": QUEUE_OPTIONS}
    rotated = {**single, "id": "rot", "orderings": "rotations"}
    client.decide(single)
    client.decide(rotated)
    e2e = {"single": [], "rotations": []}
    server = {"single": [], "rotations": []}
    tokens = None
    for _ in range(requests):  # interleaved, so drift hits both alike
        for name, body in (("single", single), ("rotations", rotated)):
            result, elapsed = client.decide(body)
            e2e[name].append(elapsed)
            server[name].append(result["total_seconds"])
            tokens = result["input_tokens"]
    ratio = median(e2e["rotations"]) / median(e2e["single"])
    return {
        "input_tokens": tokens,
        "single_median_ms": 1000 * median(e2e["single"]),
        "rotations_median_ms": 1000 * median(e2e["rotations"]),
        "ratio": ratio,
        "server_ratio": median(server["rotations"]) / median(server["single"]),
        "met": ratio <= 1.3,
    }


def concurrency(client_factory, state: str, serial: int, clients: int, each: int) -> dict[str, Any]:
    """Requests/s and latency percentiles with 1 and with `clients` concurrent clients. Each client
    connects and sends one untimed request first; the clock starts when all are ready."""
    body = {"id": "c", "state": state, "question": DEPLOYMENT_QUESTION, "options": DEPLOYMENT_OPTIONS}
    out: dict[str, Any] = {}
    for label, n_clients, n_each in (("1 client", 1, serial), (f"{clients} clients", clients, each)):
        ready = threading.Barrier(n_clients + 1)

        def worker(n: int, ready: threading.Barrier) -> list[float]:
            with client_factory() as client:
                client.decide(body)
                ready.wait()
                return [client.decide(body)[1] for _ in range(n)]

        with ThreadPoolExecutor(max_workers=n_clients) as pool:
            futures = [pool.submit(worker, n_each, ready) for _ in range(n_clients)]
            ready.wait()
            started = time.perf_counter()
            latencies = [x for f in futures for x in f.result()]
            wall = time.perf_counter() - started
        out[label] = {
            "requests": len(latencies),
            "requests_per_s": len(latencies) / wall,
            "p50_ms": 1000 * median(latencies),
            "p99_ms": 1000 * percentile(latencies, 99),
        }
    out["throughput_ratio"] = out[f"{clients} clients"]["requests_per_s"] / out["1 client"]["requests_per_s"]
    return out


def memory_burst(
    service: ServiceProcess, client_factory, health: dict[str, Any], requests: int
) -> dict[str, Any]:
    """A burst of the largest allowed requests: max_rows binary decisions over a state that
    brings each prompt close to max_input_tokens, sent concurrently."""
    limits = health["limits"]
    with client_factory() as client:
        words, prefix_tokens = fit_words(
            prefix_tokens_probe(client, seed=7), int(limits["max_input_tokens"]) - 200
        )
        state = filler(words, seed=7)
        decisions = [{**c, "id": f"m{i:03d}"} for i, c in enumerate(binary_criteria(50))]
        decisions = (decisions * (limits["max_rows"] // len(decisions) + 1))[: limits["max_rows"]]
        decisions = [{**d, "id": f"m{i:03d}"} for i, d in enumerate(decisions)]
        for _ in range(3):  # ordinary traffic before the baseline
            client.decide(
                {
                    "id": "pre",
                    "state": "A short state.",
                    "question": DEPLOYMENT_QUESTION,
                    "options": DEPLOYMENT_OPTIONS,
                }
            )
    time.sleep(1.0)
    baseline = read_rss(service.pid)["VmRSS"]
    hwm_reset = reset_peak_rss(service.pid)
    sampled = [baseline]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            sampled.append(read_rss(service.pid)["VmRSS"])
            stop.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    max_prompt = 0

    def send(_: int) -> int:
        with client_factory() as client:
            reply, _ = client.decide_shared(state, decisions)
            return max(r["input_tokens"] for r in reply["results"])

    with ThreadPoolExecutor(max_workers=requests) as pool:
        max_prompt = max(pool.map(send, range(requests)))
    burst_s = time.perf_counter() - started
    stop.set()
    sampler.join()
    peak = max(max(sampled), read_rss(service.pid)["VmHWM"] if hwm_reset else 0)
    time.sleep(2.0)
    settled = read_rss(service.pid)["VmRSS"]
    with client_factory() as client:
        for _ in range(5):
            client.decide(
                {
                    "id": "post",
                    "state": "A short state.",
                    "question": DEPLOYMENT_QUESTION,
                    "options": DEPLOYMENT_OPTIONS,
                }
            )
    time.sleep(1.0)
    after_traffic = read_rss(service.pid)["VmRSS"]
    growth = settled / baseline - 1.0
    return {
        "requests": requests,
        "rows_per_request": len(decisions),
        "prefix_tokens": prefix_tokens,
        "max_prompt_tokens": max_prompt,
        "burst_seconds": burst_s,
        "baseline_mib": baseline / MIB,
        "peak_mib": peak / MIB,
        "settled_mib": settled / MIB,
        "after_traffic_mib": after_traffic / MIB,
        "settled_growth": growth,
        "after_traffic_growth": after_traffic / baseline - 1.0,
        "peak_from": "VmHWM after clear_refs, and 20 ms samples" if hwm_reset else "20 ms samples",
        "met": growth <= 0.05,
    }


# -- the table ----------------------------------------------------------------------------


def yes(met: bool | None) -> str:
    return "-" if met is None else ("yes" if met else "NO")


def table_rows(r: dict[str, Any]) -> list[list[str]]:
    """One table row per measurement that ran: what, measured, target, met."""
    rows: list[list[str]] = []
    if "shared" in r:
        s = r["shared"]
        shared_ms, sequential_ms = 1000 * s["shared_median_s"], 1000 * s["sequential_median_s"]
        rows.append(
            [
                f"shared 21 binary vs 21 sequential (~{s['prefix_tokens']}-token state)",
                f"{shared_ms:.0f} ms vs {sequential_ms:.0f} ms = {s['speedup']:.1f}x "
                f"(server {s['server_speedup']:.1f}x)",
                ">= 8x",
                yes(s["met"]),
            ]
        )
        t, terse = s["shared_timing"], s["terse_timing"]
        rows.append(
            [
                f"  suffixes {t['true_suffix_tokens'] // t['batch_size']} tok/row; terse questions "
                f"({terse['true_suffix_tokens'] // terse['batch_size']} tok/row)",
                f"{1000 * s['terse_shared_s']:.0f} ms vs {1000 * s['terse_sequential_s']:.0f} ms "
                f"= {s['terse_speedup']:.1f}x",
                "(diagnostic)",
                "-",
            ]
        )
    if "overhead" in r:
        o = r["overhead"]
        rows.append(
            [
                f"service overhead, /decide of {o['input_tokens']} tokens",
                f"e2e {o['e2e_median_ms']:.1f} - forward {o['forward_median_ms']:.1f} "
                f"= {o['overhead_ms']:.1f} ms ({100 * o['overhead_share']:.1f}%; in server "
                f"{o['in_server_outside_forward_ms']:.1f}, GET /health {o['health_round_trip_ms']:.1f})",
                "<= 5 ms and <= 5%",
                yes(o["met"]),
            ]
        )
    if "rotations" in r:
        q = r["rotations"]
        rows.append(
            [
                f"3 rotations vs one order ({q['input_tokens']}-token prompt)",
                f"{q['rotations_median_ms']:.0f} vs {q['single_median_ms']:.0f} ms = {q['ratio']:.2f}x "
                f"(server {q['server_ratio']:.2f}x)",
                "<= 1.3x",
                yes(q["met"]),
            ]
        )
    if "memory" in r:
        m = r["memory"]
        rows.append(
            [
                f"RSS around {m['requests']} x {m['rows_per_request']} rows at {m['max_prompt_tokens']} tok",
                f"base {m['baseline_mib']:.0f} MiB, peak {m['peak_mib']:.0f}, settled {m['settled_mib']:.0f} "
                f"({100 * m['settled_growth']:+.1f}%; after 5 more requests "
                f"{100 * m['after_traffic_growth']:+.1f}%)",
                "settled <= +5%",
                yes(m["met"]),
            ]
        )
    if "concurrency" in r:
        c = r["concurrency"]
        many = next(k for k in c if k.endswith("clients"))
        one = c["1 client"]
        rows.append(
            [
                f"concurrency {many} vs 1 (short /decide)",
                f"{c[many]['requests_per_s']:.1f} vs {one['requests_per_s']:.1f} req/s; p50/p99 "
                f"{c[many]['p50_ms']:.0f}/{c[many]['p99_ms']:.0f} "
                f"vs {one['p50_ms']:.0f}/{one['p99_ms']:.0f} ms",
                "(report)",
                "-",
            ]
        )
    return rows


def environment() -> dict[str, Any]:
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }


MEASUREMENTS = ("shared", "overhead", "rotations", "concurrency", "memory")


def run_measurements(service: ServiceProcess, plan: Plan, only: tuple[str, ...]) -> dict[str, Any]:
    def client_factory() -> Client:
        return Client(service.url, service.token)

    results: dict[str, Any] = {}
    with client_factory() as client:
        health = client.health()
        results["service"] = {k: health.get(k) for k in ("version", "device", "dtype", "limits")}
        log("bench: fitting states to the service's tokenizer")
        if "shared" in only:
            words_1k, _ = fit_words(prefix_tokens_probe(client), 1000)
            log("bench: shared vs sequential")
            results["shared"] = shared_vs_sequential(client, filler(words_1k), plan.shared_runs)
        if "overhead" in only:
            words_500, _ = fit_words(input_tokens_probe(client, seed=3), 500)
            log("bench: service overhead")
            results["overhead"] = overhead(client, filler(words_500, seed=3), plan.overhead_requests)
        if "rotations" in only:
            base = input_tokens_probe(client)(1)
            words_2k, _ = fit_words(
                input_tokens_probe(client, QUEUE_QUESTION, QUEUE_OPTIONS, seed=5), base + 2000
            )
            log("bench: 3 rotations vs one order")
            results["rotations"] = rotations_vs_single(
                client, filler(words_2k, seed=5), plan.rotation_requests
            )
        words_short, _ = fit_words(input_tokens_probe(client, seed=9), 130)
    if "concurrency" in only:
        log("bench: concurrency")
        results["concurrency"] = concurrency(
            client_factory,
            filler(words_short, seed=9),
            plan.serial_requests,
            plan.concurrent_clients,
            plan.concurrent_requests_each,
        )
    if "memory" in only:
        log("bench: memory burst")
        results["memory"] = memory_burst(service, client_factory, health, plan.burst_requests)
    return results


def parse_env(values: list[str]) -> dict[str, str]:
    env = {}
    for value in values:
        key, sep, val = value.partition("=")
        if not sep or not key:
            raise SystemExit(f"--service-env {value!r}: expected KEY=VALUE")
        env[key] = val
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke version")
    parser.add_argument(
        "--only", default=",".join(MEASUREMENTS), help=f"comma-separated subset of {','.join(MEASUREMENTS)}"
    )
    parser.add_argument(
        "--service-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment of the service process (e.g. MALLOC_* tuning); repeatable",
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="checkpoint cache directory (default: $SEMIF_BENCH_DIR or the temp dir)",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the raw results as JSON")
    args = parser.parse_args(argv)
    only = tuple(m.strip() for m in args.only.split(",") if m.strip())
    unknown = set(only) - set(MEASUREMENTS)
    if unknown:
        parser.error(f"unknown measurements: {', '.join(sorted(unknown))}")
    plan = QUICK if args.quick else FULL
    wall = time.perf_counter()
    model = bench_checkpoint(args.cache)
    from semif_serve.tools.demo import DEMO_REVISION

    work = Path(tempfile.mkdtemp(prefix="semif-bench-"))
    results: dict[str, Any] = {"plan": asdict(plan), "quick": args.quick, "environment": environment()}
    results["load_average_before"] = os.getloadavg()
    service_env = parse_env(args.service_env)
    try:
        with ServiceProcess(
            # On a CPU host a release is malloc_trim (cheap), so the bench runs with a small margin.
            model,
            DEMO_REVISION,
            {"device": "cpu", "dtype": "float32", "release_margin_mib": 64},
            work,
            extra_env=service_env,
        ) as service:
            results.update(run_measurements(service, plan, only))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["load_average_after"] = os.getloadavg()
    results["service_env"] = service_env
    results["wall_seconds"] = time.perf_counter() - wall
    env = results["environment"]
    print(
        f"semif-serve bench ({'quick' if args.quick else 'full'}): bench checkpoint (hidden 384, 8 layers, "
        f"vocab 248,320, float32) on {env['cpus']} CPUs, torch {env['torch']} "
        f"({env['torch_threads']} threads); "
        f"{results['wall_seconds']:.0f} s; load average before/after "
        f"{results['load_average_before'][0]:.2f}/{results['load_average_after'][0]:.2f}"
        + (f"; service env {service_env}" if service_env else "")
    )
    print(format_table(["measurement", "measured", "target", "met"], table_rows(results)))
    if args.out:
        write_result(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
