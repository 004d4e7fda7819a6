"""Issue 29's measurements, side by side in one run: the default (`SEMIF_DIRECT_PATH=reuse`)
against `SEMIF_DIRECT_PATH=plain` (and, given `--before`, the service at another checkout) on
the workloads real traffic brings; clients send the next request as soon as the answer arrives.

    python bench/traffic.py                      # every workload, default vs plain
    python bench/traffic.py --before /work/main  # ... and the service at that checkout beside them
    python bench/traffic.py --only keep          # the keep threshold: plain vs prefill+store+suffix

Workloads (each a ratio default/plain of throughput or latency, measured in one run):
- keep: engine seconds of a lone row on a new state of N tokens, plain forward vs the pass that
  ends at the state, stores it and goes on to the suffix (the threshold `keep_state_tokens`);
- sequential: one short noul per request, each over a new state (~40 and ~1,000 tokens);
- follow-up: a ~2,000-token state, the second question sent as soon as the first answer arrives;
- pause: the same, the second question 0.3 s after the first answer;
- eight: 8 concurrent /decide on one new ~2,000-token state vs one cold call;
- interleaved: 6 states x 4 questions in a random order under a cache of 3 states;
- clients16: 16 clients sending short /decide in a loop;
- stages: where a short request's time goes (parse, plan, encode, wait, forwards, readout, reply).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SENTENCE = "The service returned errors for ten minutes after release {n}, then recovered in zone {z}. "
OPTIONS = [{"id": "yes", "description": "It succeeded."}, {"id": "no", "description": "It failed."}]
QUESTIONS = [f"Did step {i} of the rollout succeed?" for i in range(32)]


def state_of(tokens: int, tag: str) -> str:
    """A new state (unique by `tag`) of about `tokens` prompt tokens (~22 tokens a sentence)."""
    return f"[{tag}] " + "".join(SENTENCE.format(n=i, z=i % 5) for i in range(max(1, tokens // 22)))


def med_ms(values: list[float]) -> float:
    return round(1000 * statistics.median(values), 1)


# -- keep: the threshold, in process --------------------------------------------------------------


def keep_threshold(path: Path, sizes: list[int], rounds: int) -> dict[str, Any]:
    """Engine ms of one lone row on a new state of each size: plain vs the keeping pass."""
    from semif_serve.domain.requests import RowsRequest
    from semif_serve.domain.types import PromptRow
    from semif_serve.engine.state_cache import StateCache
    from semif_serve.service.settings import Settings
    from semif_serve.service.startup import load_engine
    from semif_serve.tools.demo import DEMO_REVISION

    settings = Settings(model_path=path, model_revision=DEMO_REVISION, device="cpu", api_token="x" * 24)
    base = load_engine(settings)
    plain = base.with_options(cache=StateCache(0), prefill_chunk_tokens=2048, direct_path="plain")
    keep = base.with_options(cache=StateCache(1 << 33), prefill_chunk_tokens=2048, keep_state_tokens=1)
    row = PromptRow("Did the deployment succeed?", ("It succeeded.", "It failed."))
    out: dict[str, Any] = {}
    for size in sizes:
        seconds: dict[str, list[float]] = {"plain": [], "keep": []}
        for r in range(rounds + 1):
            state = state_of(size, f"keep {size} {r}")
            for name, engine in (
                (("plain", plain), ("keep", keep)) if r % 2 else (("keep", keep), ("plain", plain))
            ):
                t0 = time.perf_counter()
                engine.read(RowsRequest.of(state, [row], shared=False, max_input_tokens=8192))
                if r:
                    seconds[name].append(time.perf_counter() - t0)
            keep.cache.clear()
        tokens = len(base.codec.encode(state_of(size, "x")))
        p, k = med_ms(seconds["plain"]), med_ms(seconds["keep"])
        out[str(tokens)] = {"plain_ms": p, "keep_ms": k, "ratio": round(k / p, 3)}
        print("keep", tokens, out[str(tokens)], flush=True)
    return out


# -- the services, side by side -----------------------------------------------------------------


class Side:
    """One service (a child process) and a client of it."""

    def __init__(self, name: str, service: Any) -> None:
        self.name = name
        self.service = service
        self.client = httpx.Client(base_url=service.url, timeout=600)
        self.auth = {"Authorization": f"Bearer {service.token}"}

    def decide(
        self, state: str, question: str, client: httpx.Client | None = None, quiet: bool = True
    ) -> tuple[dict, float]:
        """One /decide and its seconds (after the other sides' idle work, unless `quiet` is off)."""
        if quiet:
            self.quiet()
        body = {"id": "d", "state": state, "question": question, "options": OPTIONS}
        t0 = time.perf_counter()
        reply = (client or self.client).post("/decide", json=body, headers=self.auth)
        elapsed = time.perf_counter() - t0
        if reply.status_code != 200:
            raise RuntimeError(f"{self.name}: {reply.status_code} {reply.text[:300]}")
        return reply.json(), elapsed

    def quiet(self) -> None:
        """Wait for every other side's idle work to finish (never timed as this side's)."""
        for other in BACKGROUND:
            if other is not self:
                other.settle()

    def settle(self) -> None:
        """Wait until this side's engine has no idle prefill left (the service before #29)."""
        with httpx.Client(base_url=self.service.url, timeout=60) as client:
            for _ in range(3000):
                # a tree before #29 reports its queued idle prefills; this one has none
                if client.get("/health").json()["state_cache"].get("deferred_prefills", 0) == 0:
                    return
                time.sleep(0.01)

    def logged(self, after: int) -> list[dict]:
        """The request log lines after line `after`."""
        lines = self.service.log_path.read_text(encoding="utf-8").splitlines()[after:]
        records = [json.loads(line) for line in lines if line.startswith("{")]
        return [r for r in records if r.get("message") == "request" and r.get("route") == "/decide"]

    def lines(self) -> int:
        return len(self.service.log_path.read_text(encoding="utf-8").splitlines())


# Sides whose engine works while idle (the service before #29): the others' requests wait for it
# to finish, so that its background work is never measured as theirs.
BACKGROUND: list[Side] = []


def start_sides(
    path: Path, work: Path, names: list[str], before: str | None, extra: dict[str, Any]
) -> list[Side]:
    from harness.server import ServiceProcess
    from semif_serve.tools.demo import DEMO_REVISION

    sides = []
    for name in names:
        settings = {"device": "cpu", "max_input_tokens": 8192, "release_margin_mib": 64, **extra}
        env: dict[str, str] = {}
        if name == "plain":
            settings["direct_path"] = "plain"
        if name == "before":
            env["PYTHONPATH"] = f"{before}/src:{before}"
        else:
            env["PYTHONPATH"] = f"{ROOT}/src:{ROOT}"
        process = ServiceProcess(path, DEMO_REVISION, settings, work / name, extra_env=env)
        try:
            sides.append(Side(name, process.__enter__()))
            if name == "before":
                BACKGROUND.append(sides[-1])
        except BaseException:
            stop_sides(sides)  # no service outlives a failed start
            raise
    return sides


def warm(sides: list[Side]) -> None:
    """One short request each, background sides first: the service before #29 leaves its
    warm-up's state queued for an idle prefill until a request wakes its batcher."""
    for side in sorted(sides, key=lambda side: side not in BACKGROUND):
        side.decide(state_of(40, f"warm {side.name}"), QUESTIONS[0], quiet=False)
    for side in BACKGROUND:
        side.settle()


def stop_sides(sides: list[Side]) -> None:
    BACKGROUND.clear()
    for side in sides:
        side.client.close()
        side.service.__exit__(None, None, None)


def interleave(sides: list[Side], rounds: int, run) -> dict[str, list[Any]]:
    """`run(side, round)` for each side in turn, the order rotated every round."""
    out: dict[str, list[Any]] = {side.name: [] for side in sides}
    for r in range(rounds):
        for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
            out[side.name].append(run(side, r))
    return out


def sequential(sides: list[Side], tokens: int, requests: int, rounds: int) -> dict[str, Any]:
    """Requests a second, one short noul per request over a new state each, back to back; the
    sides take turns request by request (the machine's load falls on all of them alike)."""
    seconds = {side.name: 0.0 for side in sides}
    for i in range(requests * rounds):
        for side in sides[i % len(sides) :] + sides[: i % len(sides)]:
            _, elapsed = side.decide(state_of(tokens, f"seq {tokens} {side.name} {i}"), QUESTIONS[i % 8])
            seconds[side.name] += elapsed
    return {name: round(requests * rounds / total, 2) for name, total in seconds.items()}


def summary(got: dict[str, list[tuple[float, float]]], **fields: Any) -> dict[str, Any]:
    """Per side, the median of each field computed from every round's pair (`_ms` in ms)."""
    out: dict[str, Any] = {}
    for name, pairs in got.items():
        values = {key: statistics.median(f(a, b) for a, b in pairs) for key, f in fields.items()}
        out[name] = {k: round(1000 * v, 1) if k.endswith("_ms") else round(v, 2) for k, v in values.items()}
    return out


def follow_up(sides: list[Side], tokens: int, pause: float, rounds: int) -> dict[str, Any]:
    """A new state's first question, then a second one `pause` s after the first answer."""

    def run(side: Side, r: int) -> tuple[float, float]:
        state = state_of(tokens, f"follow {pause} {side.name} {r}")
        _, first = side.decide(state, QUESTIONS[0])
        time.sleep(pause)
        _, second = side.decide(state, QUESTIONS[1])
        return first, second

    return summary(
        interleave(sides, rounds, run),
        first_ms=lambda f, s: f,
        second_ms=lambda f, s: s,
        speedup=lambda f, s: f / s,
        pair_ms=lambda f, s: f + s,
    )


def eight(sides: list[Side], tokens: int, rounds: int) -> dict[str, Any]:
    """8 concurrent /decide on one new state vs one cold call."""

    def run(side: Side, r: int) -> tuple[float, float]:
        _, one = side.decide(state_of(tokens, f"cold {side.name} {r}"), QUESTIONS[0])
        state = state_of(tokens, f"eight {side.name} {r}")
        clients = [httpx.Client(base_url=side.service.url, timeout=600) for _ in range(8)]
        try:
            side.quiet()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda k: side.decide(state, QUESTIONS[k], clients[k], quiet=False), range(8)))
            return one, time.perf_counter() - t0
        finally:
            for c in clients:
                c.close()

    return summary(
        interleave(sides, rounds, run),
        one_ms=lambda o, e: o,
        eight_ms=lambda o, e: e,
        ratio=lambda o, e: e / o,
    )


def interleaved(sides: list[Side], tokens: int, states: int, questions: int) -> dict[str, Any]:
    """`states` states x `questions` questions in one random order (the same for every side)."""
    order = [s for s in range(states) for _ in range(questions)]
    random.Random(29).shuffle(order)

    def run(side: Side, r: int) -> float:
        asked = [0] * states
        total = 0.0
        for s in order:
            _, elapsed = side.decide(state_of(tokens, f"inter {side.name} {s}"), QUESTIONS[asked[s]])
            total += elapsed
            asked[s] += 1
        return len(order) / total

    got = interleave(sides, 1, run)
    return {name: round(v[0], 2) for name, v in got.items()}


def clients16(sides: list[Side], tokens: int, each: int, rounds: int = 1) -> dict[str, Any]:
    """16 clients, each sending `each` short /decide back to back (a new state each); `rounds`
    bursts per side, the sides' order rotated every round; the median burst's req/s, and each."""

    def run(side: Side, r: int) -> float:
        clients = [httpx.Client(base_url=side.service.url, timeout=600) for _ in range(16)]

        def one(k: int) -> None:
            for i in range(each):
                side.decide(
                    state_of(tokens, f"c16 {side.name} {k} {i}"), QUESTIONS[i], clients[k], quiet=False
                )

        try:
            side.quiet()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(one, range(16)))
            return 16 * each / (time.perf_counter() - t0)
        finally:
            for c in clients:
                c.close()

    got = interleave(sides, rounds, run)
    return {
        name: {"median": round(statistics.median(v), 2), "bursts": [round(x, 2) for x in v]}
        for name, v in got.items()
    }


def stages(sides: list[Side], tokens: int, pause: float, requests: int) -> dict[str, Any]:
    """Where a short request's time goes, from its reply and its log line: end to end, the
    engine's encode and forwards, its wait for the engine (logged after #29) and the rest
    (parse, plan, readout, reply, HTTP)."""

    def run(side: Side, r: int) -> list[dict[str, float]]:
        mark = side.lines()
        e2e = []
        replies = []
        for i in range(requests):
            reply, elapsed = side.decide(state_of(tokens, f"stage {side.name} {i}"), QUESTIONS[i % 8])
            e2e.append(elapsed)
            replies.append(reply)
            time.sleep(pause)
        logs = side.logged(mark)
        rows = []
        for k, (elapsed, reply) in enumerate(zip(e2e, replies, strict=True)):
            wait = logs[k].get("wait_seconds") if k < len(logs) else None
            total, forward = reply["total_seconds"], reply["forward_seconds"]
            rows.append(
                {
                    "e2e": elapsed,
                    "encode": total - forward,
                    "forward": forward,
                    "wait": wait if wait is not None else float("nan"),
                    "rest": elapsed - total - (wait or 0),
                }
            )
        return rows

    got = interleave(sides, 1, run)
    out = {}
    for name, v in got.items():
        rows = v[0]
        out[name] = {k: med_ms([row[k] for row in rows]) for k in rows[0]}
    return out


def in_process_stages(path: Path, tokens: int, rounds: int) -> dict[str, float]:
    """The door's own stages of a short /decide, in process (the same code before and after)."""
    from semif_serve.domain.calibration import CalibrationTable
    from semif_serve.doors.base import json_reply
    from semif_serve.doors.native.api import decision_result, read_decision
    from semif_serve.service.core import plan_rows

    body = json.dumps(
        {"id": "d", "state": state_of(tokens, "p"), "question": QUESTIONS[0], "options": OPTIONS}
    ).encode()
    identity = {"source": "bench", "revision": "0" * 40}
    times: dict[str, list[float]] = {"parse": [], "plan": []}
    for _ in range(rounds):
        t0 = time.perf_counter()
        call = read_decision(body, identity)
        t1 = time.perf_counter()
        plan_rows(call.questions, max_rows=64, max_options=16, calibration=CalibrationTable({}))
        t2 = time.perf_counter()
        times["parse"].append(t1 - t0)
        times["plan"].append(t2 - t1)
    del decision_result, json_reply
    return {k: round(1000 * statistics.median(v), 3) for k, v in times.items()}


def state_budget_mib(path: Path, tokens: int, states: int) -> int:
    """A cache budget of about `states` states of `tokens` tokens (the engine's own estimate)."""
    from transformers import AutoConfig

    from semif_serve.engine.memory import MemoryEstimate

    estimate = MemoryEstimate(AutoConfig.from_pretrained(str(path)), 4)
    per = estimate.cache_per_token * (tokens + 80) + estimate.state_per_row
    return max(1, int(states * per / (1 << 20)) + 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="keep,sequential,follow,pause,eight,interleaved,clients16,stages")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", default=None, help="a checkout whose service runs beside (its src/)")
    args = parser.parse_args()
    import torch

    from bench.run import bench_checkpoint

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    path = bench_checkpoint()
    only = set(args.only.split(","))
    results: dict[str, Any] = {}
    if "keep" in only:
        results["keep"] = keep_threshold(path, [64, 128, 256, 512, 1024, 2048], args.rounds)
    names = ["default", "plain"] + (["before"] if args.before else [])
    work = Path(tempfile.mkdtemp(prefix="traffic-"))
    load = os.getloadavg()[0]
    started = time.perf_counter()
    rounds = args.rounds
    http = only - {"keep", "interleaved"}
    if http:
        sides = start_sides(path, work, names, args.before, {})
        try:
            warm(sides)
            if "sequential" in only:
                results["sequential_short"] = sequential(sides, 40, 8, rounds)
                results["sequential_1k"] = sequential(sides, 1000, 3, rounds)
                results["sequential_2k"] = sequential(sides, 2000, 2, rounds)
                print(
                    "sequential",
                    results["sequential_short"],
                    results["sequential_1k"],
                    results["sequential_2k"],
                    flush=True,
                )
            if "follow" in only:
                results["follow_2k"] = follow_up(sides, 2000, 0.0, rounds)
                print("follow", results["follow_2k"], flush=True)
            if "pause" in only:
                results["pause_2k"] = follow_up(sides, 2000, 0.3, rounds)
                print("pause", results["pause_2k"], flush=True)
            if "eight" in only:
                results["eight_2k"] = eight(sides, 2000, max(1, rounds - 1))
                print("eight", results["eight_2k"], flush=True)
            if "clients16" in only:
                results["clients16"] = clients16(sides, 40, 3, rounds)
                print("clients16", results["clients16"], flush=True)
            if "stages" in only:
                results["stages_short"] = stages(sides, 40, 0.3, 6)
                results["stages_1k"] = stages(sides, 1000, 0.3, 4)
                results["stages_in_process"] = in_process_stages(path, 40, 50)
                print("stages", results["stages_short"], results["stages_1k"], flush=True)
        finally:
            stop_sides(sides)
    if "interleaved" in only:
        budget = state_budget_mib(path, 2000, 3)
        sides = start_sides(path, work, names, args.before, {"state_cache_mib": budget})
        try:
            warm(sides)
            results["interleaved_6x4"] = {"budget_mib": budget, **interleaved(sides, 2000, 6, 4)}
            print("interleaved", results["interleaved_6x4"], flush=True)
        finally:
            stop_sides(sides)
    results["run"] = {
        "seconds": round(time.perf_counter() - started),
        "load_before_after": [round(load, 2), round(os.getloadavg()[0], 2)],
    }
    print("issue 29 bench: bench checkpoint, fp32 CPU", json.dumps(results, indent=1), sep="\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
