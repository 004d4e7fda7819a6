"""Issue 39's thread measurements, side by side in one run.

    uv run python bench/threads.py                      # both parts, ~5 min here
    uv run python bench/threads.py --only crossover     # forwards at 1, 2, ... threads
    uv run python bench/threads.py --only servers --rounds 4

1. `crossover`: one forward (the engine's `logits_over`, no cache) of R rows x T tokens on the
   peers' checkpoint (hidden 256, 8 layers, float32), at each fixed thread count (1, 2 and every
   core where the machine has more), interleaved per round; the median per cell and the ratio to
   one thread; and what `torch.set_num_threads` costs per call. `engine.threads.PARALLEL_TOKENS`
   is the smallest R x T at which two threads beat one here on free cores.
2. `servers`: semif-serve at its defaults (nothing pinned: `engine.threads` chooses) against the
   same server pinned (`OMP_NUM_THREADS` = 1, 2, ...), and upstream SemIf's `semif_api`
   (`--semif-api-dir`, as `bench/peers.py` starts it; skipped with a line when absent) at its
   defaults and pinned to one thread, each a process of its own, on the work of
   `bench/peers.py` (8 choices over a new ~1k-token state; one short noul over a new state), the
   cells interleaved, the others stopped (SIGSTOP) while one is measured. Reported: req/s per
   setting, semif-serve's defaults / each pinned count, and semif-serve / upstream at the
   defaults and at one thread, per round, median and spread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx

from bench.peers import (
    DEFAULT_MODEL_DIR,
    MATCH_NONE,
    STATE_TOKENS,
    PeerProcess,
    Workload,
    ensure_checkpoint,
    fit_state_words,
    measure,
    only_running,
    semif_api_peer,
    thread_env,
)
from harness.report import format_table, log
from harness.server import ServiceProcess

SHAPES = ((1, 8), (1, 16), (1, 40), (1, 150), (1, 300), (1, 600), (1, 1100), (8, 40), (8, 150), (1, 2000))


def thread_counts() -> list[int]:
    """1, 2 and every core (where the machine has more)."""
    from semif_serve.engine.threads import usable_cores

    cores = usable_cores()
    return sorted({1, min(2, cores), cores})


def crossover(model_dir: Path, rounds: int) -> dict[str, Any]:
    """Each shape's forward at each fixed thread count, interleaved; medians in ms."""
    import torch

    from semif_serve.engine.forwards import logits_over
    from semif_serve.engine.loader import CheckpointSpec, load_model

    loaded = load_model(CheckpointSpec(model_dir, "bench", "bench", "float32", "cpu"))
    columns = torch.tensor(loaded.codec.slots[:3])
    calls = 20_000
    t0 = time.perf_counter()
    for i in range(calls):
        torch.set_num_threads(1 + i % 2)
    switch_us = (time.perf_counter() - t0) / calls * 1e6

    def forward(rows: int, tokens: int) -> float:
        ids = [[(7 * i + 13 * r) % 50_000 + 100 for i in range(tokens)] for r in range(rows)]
        started = time.perf_counter()
        with torch.inference_mode():
            logits_over(loaded.model, None, 0, ids, 0, None, columns=columns)
        return time.perf_counter() - started

    counts = thread_counts()
    cells: dict[str, Any] = {}
    for rows, tokens in SHAPES:
        times: dict[int, list[float]] = {n: [] for n in counts}
        for n in counts:  # warm each count's pool on this shape
            torch.set_num_threads(n)
            forward(rows, tokens)
        for _ in range(rounds):
            for n in counts:
                torch.set_num_threads(n)
                times[n].append(forward(rows, tokens))
        ms = {n: 1000 * statistics.median(v) for n, v in times.items()}
        cells[f"{rows}x{tokens}"] = {"rows": rows, "tokens": tokens, "ms": ms}
        log("threads: " + f"{rows} x {tokens}: " + ", ".join(f"{n}t {m:.1f} ms" for n, m in ms.items()))
    return {"threads": counts, "set_num_threads_us": switch_us, "cells": cells}


Server = tuple[Any, dict[str, str]]  # a started server (pid, url) and the headers its requests carry


def start_servers(
    stack: ExitStack, model_dir: Path, work: Path, semif_api_dir: Path | None
) -> dict[str, Server]:
    """semif-serve at its defaults and pinned to each count; upstream at its defaults and pinned
    to one thread where its directory is given."""
    from semif_serve.tools.demo import DEMO_REVISION

    settings = {"device": "cpu", "dtype": "float32", "systemone_orderings": MATCH_NONE}
    setups = {DEFAULTS_CELL: {}} | {f"pinned {n}": thread_env(n) for n in thread_counts()}
    started: dict[str, Server] = {}
    for name, env in setups.items():
        proc = stack.enter_context(
            ServiceProcess(model_dir, DEMO_REVISION, settings, work / name.replace(" ", "-"), extra_env=env)
        )
        started[name] = (proc, {"authorization": f"Bearer {proc.token}"})
    if semif_api_dir is None:
        return started
    if not (semif_api_dir / ".venv/bin/python").exists():
        log(f"threads: no upstream semif_api in {semif_api_dir} (bench/README.md, Peers): skipped")
        return started
    for name, threads in ((UPSTREAM_DEFAULTS, None), (UPSTREAM_PINNED, 1)):
        peer_work = work / name.replace(" ", "-")
        peer_work.mkdir(parents=True, exist_ok=True)
        peer: PeerProcess = stack.enter_context(semif_api_peer(semif_api_dir, model_dir, peer_work, threads))
        started[name] = (peer, {})
    return started


DEFAULTS_CELL = "defaults"
UPSTREAM_DEFAULTS = "upstream defaults"
UPSTREAM_PINNED = "upstream pinned 1"
# The ratios reported beside the req/s: semif-serve's defaults over each pinned count, and
# semif-serve over upstream, each at its defaults and both pinned to one thread.
UPSTREAM_PAIRS = ((DEFAULTS_CELL, UPSTREAM_DEFAULTS), ("pinned 1", UPSTREAM_PINNED))


def servers(
    model_dir: Path, rounds: int, counts: dict[str, int], budget: float, semif_api_dir: Path | None = None
) -> dict[str, Any]:
    """Every server's cells, interleaved per round (the order reversed every other round)."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.pop(name, None)  # the defaults cells inherit nothing pinned
    words = fit_state_words(model_dir, STATE_TOKENS)
    work = Path(tempfile.mkdtemp(prefix="semif-bench-threads-"))
    out: dict[str, Any] = {}
    with ExitStack() as stack:
        procs = start_servers(stack, model_dir, work, semif_api_dir)
        pids = {name: p.pid for name, (p, _) in procs.items()}
        clients = {
            name: stack.enter_context(httpx.Client(timeout=600.0, headers=headers))
            for name, (_, headers) in procs.items()
        }
        for workload, n in counts.items():
            load = Workload(workload, words)
            cells: dict[str, list[float]] = {name: [] for name in procs}
            for name, (proc, _) in procs.items():
                with only_running(pids[name], [pid for other, pid in pids.items() if other != name]):
                    measure(clients[name], proc.url, load, 1)  # warm-up, not counted
            for r in range(rounds):
                order = list(procs) if r % 2 == 0 else list(reversed(procs))
                for name in order:
                    with only_running(pids[name], [pid for other, pid in pids.items() if other != name]):
                        cells[name].append(measure(clients[name], procs[name][0].url, load, n, budget)["rps"])
                log(
                    f"threads: {workload} round {r + 1}: "
                    + ", ".join(f"{k} {v[-1]:.2f}" for k, v in cells.items())
                )
            ratios = {
                f"defaults / {name}": per_round(cells[DEFAULTS_CELL], cells[name])
                for name in cells
                if name.startswith("pinned")
            } | {
                f"semif-serve {ours} / upstream": per_round(cells[ours], cells[theirs])
                for ours, theirs in UPSTREAM_PAIRS
                if theirs in cells
            }
            out[workload] = {
                "rps": {name: {"median": statistics.median(v), "per_round": v} for name, v in cells.items()},
                "ratios": ratios,
            }
    return out


def per_round(ours: list[float], theirs: list[float]) -> dict[str, Any]:
    """Ratios of two settings' req/s round by round, and their median."""
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    return {"median": statistics.median(ratios), "per_round": ratios}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR, help="checkpoint (built if absent)")
    parser.add_argument("--only", default="crossover,servers")
    parser.add_argument(
        "--semif-api-dir",
        type=Path,
        default=Path(os.environ.get("SEMIF_PEER_SEMIF_API_DIR") or "/work/peers/semif"),
        help="upstream semif_api's scratch directory (bench/README.md, Peers); skipped when absent",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests-eight", type=int, default=10)
    parser.add_argument("--requests-noul", type=int, default=30)
    parser.add_argument("--cell-seconds", type=float, default=8.0)
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    model = ensure_checkpoint(args.model.resolve())
    load = os.getloadavg()[0]
    started = time.perf_counter()
    if "crossover" in only:
        result = crossover(model, args.rounds)
        counts = result["threads"]
        rows = []
        for name, cell in result["cells"].items():
            ms = cell["ms"]
            rows.append(
                [name, str(cell["rows"] * cell["tokens"])]
                + [f"{ms[n]:.1f}" for n in counts]
                + [f"{ms[1] / ms[n]:.2f}x" for n in counts[1:]]
            )
        headers = ["rows x tokens", "tokens"] + [f"{n} thr ms" for n in counts]
        headers += [f"{n} thr speed-up" for n in counts[1:]]
        print(
            f"\nforwards, median of {args.rounds}; set_num_threads {result['set_num_threads_us']:.2f} us/call"
        )
        print(format_table(headers, rows))
    if "servers" in only:
        measured = servers(
            model,
            args.rounds,
            {"eight": args.requests_eight, "noul": args.requests_noul},
            args.cell_seconds,
            args.semif_api_dir,
        )
        rows = []
        for workload, cell in measured.items():
            for name, rps in cell["rps"].items():
                rows.append(
                    [workload, name, f"{rps['median']:.2f}", " ".join(f"{x:.2f}" for x in rps["per_round"])]
                )
        print(format_table(["workload", "server, setting", "req/s", "per round"], rows))
        rows = [
            [workload, name, f"{ratio['median']:.2f}x", " ".join(f"{x:.2f}" for x in ratio["per_round"])]
            for workload, cell in measured.items()
            for name, ratio in cell["ratios"].items()
        ]
        print()
        print(format_table(["workload", "ratio", "median", "per round"], rows))
    print(
        f"\n{os.cpu_count()} CPUs; {time.perf_counter() - started:.0f} s; load average "
        f"{load:.2f}/{os.getloadavg()[0]:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
