"""Issue 39's thread measurements, side by side in one run.

    uv run python bench/threads.py                      # all three parts, ~12 min here
    uv run python bench/threads.py --only crossover     # forwards at 1, 2, ... threads
    uv run python bench/threads.py --only contention    # the same beside another process
    uv run python bench/threads.py --only servers       # the servers, at their defaults and pinned

1. `crossover`: one forward (the engine's `logits_over`, no cache) of R rows x T tokens on the
   peers' checkpoint (hidden 256, 8 layers, float32), at each fixed thread count (1, 2 and every
   core where the machine has more), interleaved per round; the median per cell and the ratio to
   one thread; and what `torch.set_num_threads` costs per call. `engine.threads.PARALLEL_TOKENS`
   is the smallest R x T at which two threads beat one here on free cores.
2. `contention`: the same forwards at 1 and 2 threads while another process keeps one core busy
   part of every 20 ms (0 to 100%), with what the engine's sampler reads of it: where one thread
   starts to beat two is `engine.threads.BUSY_CORE`.
3. `servers`: semif-serve at its defaults (nothing pinned: `engine.threads` chooses) against the
   same server pinned (`OMP_NUM_THREADS` = 1, 2, ...), and upstream SemIf's `semif_api`
   (`--semif-api-dir`, as `bench/peers.py` starts it; skipped with a line when absent) at its
   defaults and pinned to one thread, each a process of its own, on the work of
   `bench/peers.py` (8 choices over a new ~1k-token state; one short noul over a new state; the
   8 choices again while another process spins on one core), many short cells (`--cell-seconds`)
   interleaved round by round, the others stopped while one is measured (`TakingTurns`: none
   continued between turns). This VM's two cores have slow stretches of seconds to a minute in
   which two threads run no faster than one (every two-thread server alike); short cells put both
   sides of a ratio in the same stretches.
   Reported: each setting's req/s pooled over its cells; semif-serve's defaults / each pinned
   count and semif-serve / upstream at the defaults and at one thread, as the ratio of pooled
   req/s, with the quartiles of the per-round ratios and the rounds behind.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx

from bench.peers import (
    DEFAULT_MODEL_DIR,
    MATCH_NONE,
    STATE_TOKENS,
    PeerProcess,
    TakingTurns,
    Workload,
    ensure_checkpoint,
    fit_state_words,
    measure,
    semif_api_peer,
    thread_env,
)
from harness.report import format_table, log
from harness.server import ServiceProcess

# Two of `engine.threads.SAMPLE_SECONDS`: every server's sampler has seen a spinning process.
HOG_SETTLE_SECONDS = 1.0
SHAPES = ((1, 8), (1, 16), (1, 40), (1, 150), (1, 300), (1, 600), (1, 1100), (8, 40), (8, 150), (1, 2000))


def thread_counts() -> list[int]:
    """1, 2 and every core (where the machine has more)."""
    from semif_serve.engine.threads import usable_cores

    cores = usable_cores()
    return sorted({1, min(2, cores), cores})


def forward_timer(model_dir: Path) -> Callable[[int, int, int], float]:
    """`timed(rows, tokens, threads)`: seconds of one forward (the engine's `logits_over`, no cache)
    of rows x tokens on `threads` intra-op threads, on the checkpoint loaded once."""
    import torch

    from semif_serve.engine.forwards import logits_over
    from semif_serve.engine.loader import CheckpointSpec, load_model

    loaded = load_model(CheckpointSpec(model_dir, "bench", "bench", "float32", "cpu"))
    columns = torch.tensor(loaded.codec.slots[:3])

    def timed(rows: int, tokens: int, threads: int) -> float:
        torch.set_num_threads(threads)
        ids = [[(7 * i + 13 * r) % 50_000 + 100 for i in range(tokens)] for r in range(rows)]
        started = time.perf_counter()
        with torch.inference_mode():
            logits_over(loaded.model, None, 0, ids, 0, None, columns=columns)
        return time.perf_counter() - started

    return timed


def interleaved_ms(
    timed: Callable[[int, int, int], float], rows: int, tokens: int, rounds: int
) -> dict[int, float]:
    """The median ms of a rows x tokens forward at each thread count, the counts interleaved."""
    counts = thread_counts()
    for n in counts:  # warm each count's pool on this shape
        timed(rows, tokens, n)
    times: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(rounds):
        for n in counts:
            times[n].append(timed(rows, tokens, n))
    return {n: 1000 * statistics.median(v) for n, v in times.items()}


def crossover(model_dir: Path, rounds: int) -> dict[str, Any]:
    """Each shape's forward at each fixed thread count, interleaved; medians in ms."""
    import torch

    timed = forward_timer(model_dir)
    calls = 20_000
    t0 = time.perf_counter()
    for i in range(calls):
        torch.set_num_threads(1 + i % 2)
    switch_us = (time.perf_counter() - t0) / calls * 1e6
    cells: dict[str, Any] = {}
    for rows, tokens in SHAPES:
        ms = interleaved_ms(timed, rows, tokens, rounds)
        cells[f"{rows}x{tokens}"] = {"rows": rows, "tokens": tokens, "ms": ms}
        log("threads: " + f"{rows} x {tokens}: " + ", ".join(f"{n}t {m:.1f} ms" for n, m in ms.items()))
    return {"threads": thread_counts(), "set_num_threads_us": switch_us, "cells": cells}


# Another process's share of one core in the contention part, and its spin/sleep period.
DUTIES = (0.0, 0.2, 0.35, 0.5, 0.65, 0.8, 1.0)
DUTY_PERIOD_S = 0.02
CONTENTION_SHAPES = ((1, 16), (1, 40), (1, 116), (1, 300), (1, 1100))
# The other process: busy `duty` of every period, asleep the rest.
SPINNER = """
import sys, time
duty, period = float(sys.argv[1]), float(sys.argv[2])
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < duty * period:
        pass
    time.sleep((1 - duty) * period)
"""


@contextmanager
def other_process(duty: float) -> Iterator[None]:
    """A process of its own keeping one core busy `duty` of the time (none at 0)."""
    if duty <= 0:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", SPINNER, str(duty), str(DUTY_PERIOD_S)])
    try:
        time.sleep(HOG_SETTLE_SECONDS)
        yield
    finally:
        spinner.kill()
        spinner.wait()


def reading_after(
    timed: Callable[[int, int, int], float], busy_cores: Callable[[], float], readings: list[float]
) -> Callable[[int, int, int], float]:
    """`timed`, appending the sampler's reading of other processes after each forward."""

    def timed_and_read(rows: int, tokens: int, threads: int) -> float:
        seconds = timed(rows, tokens, threads)
        readings.append(busy_cores())
        return seconds

    return timed_and_read


def contention(model_dir: Path, rounds: int) -> dict[str, Any]:
    """Forwards at each thread count while another process keeps one core busy part of the time,
    and the cores the engine's sampler (`engine.threads.SampledLoad`) reads it as (the median over
    the cell): where one thread starts to beat two is where `engine.threads.BUSY_CORE` belongs."""
    from semif_serve.engine.threads import SampledLoad

    timed = forward_timer(model_dir)
    sampler = SampledLoad()
    cells: dict[str, Any] = {}
    for duty in DUTIES:
        readings: list[float] = []
        read_after = reading_after(timed, sampler.busy_cores, readings)
        with other_process(duty):
            ms = {f"{r}x{t}": interleaved_ms(read_after, r, t, rounds) for r, t in CONTENTION_SHAPES}
        read = statistics.median(readings)
        cells[f"{duty:.2f}"] = {"duty": duty, "others_read": read, "ms": ms}
        log(
            f"threads: other process at {duty:.2f} (read {read:.2f}): "
            + ", ".join(f"{shape} 1t/2t {m[1] / m[2]:.2f}" for shape, m in ms.items())
        )
    return {"threads": thread_counts(), "cells": cells}


Server = tuple[Any, dict[str, str]]  # a started server (pid, url) and the headers its requests carry


def start_servers(
    stack: ExitStack, model_dir: Path, work: Path, semif_api_dir: Path | None
) -> dict[str, Server]:
    """semif-serve at its defaults and pinned to each count; upstream at its defaults and pinned
    to one thread where its directory is given."""
    from semif_serve.tools.demo import DEMO_REVISION

    settings = {"device": "cpu", "dtype": "float32", "systemone_orderings": MATCH_NONE}
    setups: dict[str, dict[str, str]] = {DEFAULTS_CELL: {}} | {
        f"pinned {n}": thread_env(n) for n in thread_counts()
    }
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


# The contested workload: (a) again while another process keeps one core busy (`other_process`),
# as a CPU shared with other services does.
CONTESTED = "eight-contested"


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
            load = Workload(workload.removesuffix("-contested"), words)
            cells: dict[str, list[dict[str, Any]]] = {name: [] for name in procs}
            with (
                other_process(1.0 if workload == CONTESTED else 0.0),
                TakingTurns(list(pids.values())) as turns,
            ):
                for name, (proc, _) in procs.items():
                    turns.turn(pids[name])
                    measure(clients[name], proc.url, load, 1)  # warm-up, not counted
                for r in range(rounds):
                    order = list(procs) if r % 2 == 0 else list(reversed(procs))
                    for name in order:
                        turns.turn(pids[name])
                        cells[name].append(measure(clients[name], procs[name][0].url, load, n, budget))
                    log(
                        f"threads: {workload} round {r + 1}: "
                        + ", ".join(f"{k} {v[-1]['rps']:.2f}" for k, v in cells.items())
                    )
            pairs = [(DEFAULTS_CELL, name) for name in cells if name.startswith("pinned")]
            pairs += [pair for pair in UPSTREAM_PAIRS if pair[1] in cells]
            out[workload] = {
                "rps": {name: pooled(v) for name, v in cells.items()},
                "ratios": {label(ours, theirs): paired(cells[ours], cells[theirs]) for ours, theirs in pairs},
            }
    return out


def label(ours: str, theirs: str) -> str:
    """`defaults / pinned 2`, `semif-serve defaults / upstream`."""
    return f"{ours} / {theirs}" if theirs.startswith("pinned") else f"semif-serve {ours} / upstream"


def pooled(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """One setting's req/s over all its cells (requests / seconds) and per round."""
    return {
        "rps": sum(c["requests"] for c in cells) / sum(c["seconds"] for c in cells),
        "per_round": [c["rps"] for c in cells],
    }


def paired(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> dict[str, Any]:
    """Two settings measured round by round: the ratio of their pooled req/s (the cells of a round
    ran seconds apart, so the host's slow and fast stretches fall on both alike), and the
    quartiles of the per-round ratios."""
    ratios = sorted(a["rps"] / b["rps"] for a, b in zip(ours, theirs, strict=True))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {
        "pooled": pooled(ours)["rps"] / pooled(theirs)["rps"],
        "quartiles": quartiles,
        "behind": sum(r < 1.0 for r in ratios),
        "rounds": len(ratios),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR, help="checkpoint (built if absent)")
    parser.add_argument("--only", default="crossover,contention,servers")
    parser.add_argument(
        "--semif-api-dir",
        type=Path,
        default=Path(os.environ.get("SEMIF_PEER_SEMIF_API_DIR") or "/work/peers/semif"),
        help="upstream semif_api's scratch directory (bench/README.md, Peers); skipped when absent",
    )
    parser.add_argument("--rounds", type=int, default=3, help="crossover, contention: rounds per shape")
    parser.add_argument("--server-rounds", type=int, default=20, help="servers: rounds of short cells")
    parser.add_argument("--requests-eight", type=int, default=4)
    parser.add_argument("--requests-noul", type=int, default=40)
    parser.add_argument("--cell-seconds", type=float, default=1.5)
    parser.add_argument("--no-contested", action="store_true", help="servers: skip (a) with one core held")
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
    if "contention" in only:
        result = contention(model, args.rounds)
        shapes = [f"{r}x{t}" for r, t in CONTENTION_SHAPES]
        rows = [
            [f"{cell['duty']:.2f}", f"{cell['others_read']:.2f}"]
            + [f"{m[1]:.1f} / {m[2]:.1f} ({m[1] / m[2]:.2f}x)" for m in (cell["ms"][s] for s in shapes)]
            for cell in result["cells"].values()
        ]
        print(
            f"\nforwards beside another process (one core, busy part of each {DUTY_PERIOD_S * 1000:.0f} ms)"
        )
        print(format_table(["other's duty", "OtherLoad read"] + [f"{s}: 1t / 2t ms" for s in shapes], rows))
    if "servers" in only:
        workloads = {"eight": args.requests_eight, "noul": args.requests_noul}
        if not args.no_contested:
            workloads[CONTESTED] = args.requests_eight
        measured = servers(model, args.server_rounds, workloads, args.cell_seconds, args.semif_api_dir)
        rows = [
            [workload, name, f"{rps['rps']:.2f}", " ".join(f"{x:.1f}" for x in rps["per_round"])]
            for workload, cell in measured.items()
            for name, rps in cell["rps"].items()
        ]
        print(format_table(["workload", "server, setting", "req/s (pooled)", "per round"], rows))
        rows = [
            [
                workload,
                name,
                f"{ratio['pooled']:.2f}x",
                " / ".join(f"{q:.2f}" for q in ratio["quartiles"]),
                f"{ratio['behind']} of {ratio['rounds']}",
            ]
            for workload, cell in measured.items()
            for name, ratio in cell["ratios"].items()
        ]
        print()
        print(format_table(["workload", "ratio", "pooled", "rounds' quartiles", "rounds behind"], rows))
    print(
        f"\n{os.cpu_count()} CPUs; {time.perf_counter() - started:.0f} s; load average "
        f"{load:.2f}/{os.getloadavg()[0]:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
