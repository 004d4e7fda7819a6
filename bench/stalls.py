"""Issue 18: no single request stalls the service. One run, the ratios side by side.

    uv run python bench/stalls.py            # the demo checkpoint, fp32 CPU (a few minutes)
    uv run python bench/stalls.py --quick    # fewer probes and a smaller heavy request

It starts the real service (`semif-serve serve`, the demo checkpoint) as a child process on a
loopback port and measures, over HTTP:

1. `/health` latency idle vs while 4 System One bodies of 72,165 rows (283 choices x 255
   options, rotations; ~1 MB) and 8 bodies of ~116,000 empty zstd frames (1 MiB) arrive at
   once (goal: worst < 1 s), and each refusal's time (goal: the 413s < 100 ms);
2. 256 questions over a ~32k-token state: the codec's encoding time with every row encoded
   whole (as before) vs the state encoded once (in this process, the same rows), and the
   request end to end through the service;
3. a tiny request's latency alone vs sent 1 s after that heavy request (goal < 3 s);
4. the service's RSS growth for one question of ~32.7k tokens (goal < 1.5 GiB), and the
   bound the memory estimate sets for that row at Qwen3.5-4B geometry in BF16, with the
   suffix chunked (as now) and whole (as before).

Issue 30, tokenising and batching (`--issue30` runs only these; `--before SRC` runs them on a
second service importing SRC, e.g. /work/main/src, side by side):

5. six concurrent ~0.95 MB System One states (each past the token limit) and a tiny request
   sent 0.5 s after them: each refusal's time, the tiny one's wait, /health worst (goal < 1 s);
6. 200 questions over a ~29k-token state (--quick: ~8k tokens, SEMIF_MAX_BATCH_TOKENS=4096):
   the engine's forwards (from /metrics) and the request's seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "src"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402

from acceptance.server import ServiceProcess, read_rss, reset_peak_rss  # noqa: E402

SENTENCE = "The service returned errors for ten minutes after the release, then recovered. "
GIB = 1 << 30


def rotations_body() -> bytes:
    choice = {
        "type": "choice",
        "criteria": {f"o{i:03d}": None for i in range(255)},
        "x_orderings": "rotations",
    }
    body = {"model": "jev-latest", "state": "s", "questions": {f"q{i}": choice for i in range(283)}}
    return json.dumps(body, separators=(",", ":")).encode()


def frame_bomb(limit: int) -> bytes:
    try:
        from compression import zstd  # type: ignore[import-not-found]
    except ImportError:
        from backports import zstd
    frame = zstd.compress(b"")
    return frame * (limit // len(frame))


def state_of(codec, tokens: int) -> str:
    return SENTENCE * max(1, tokens // len(codec.encode(SENTENCE)))


def nouls(count: int) -> dict:
    return {
        f"q{i}": {
            "type": "noul",
            "instructions": f"Is statement {i} about the release true?",
            "x_orderings": "none",
        }
        for i in range(count)
    }


class Prober:
    """GETs /health every `every` seconds on its own thread, keeping each latency."""

    def __init__(self, url: str, every: float = 0.02) -> None:
        self.url = url
        self.every = every
        self.latencies: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                started = time.perf_counter()
                client.get(f"{self.url}/health")
                self.latencies.append(time.perf_counter() - started)
                time.sleep(self.every)

    def __enter__(self) -> Prober:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)


def post(url: str, token: str, path: str, body: bytes, headers: dict | None = None) -> tuple[int, float]:
    started = time.perf_counter()
    reply = httpx.post(
        f"{url}{path}",
        content=body,
        headers={"Authorization": f"Bearer {token}", **(headers or {})},
        timeout=600,
    )
    return reply.status_code, time.perf_counter() - started


def in_parallel(calls) -> list:
    results: list = [None] * len(calls)

    def run(i, call):
        results[i] = call()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def health_under_attack(service: ServiceProcess, probes: int) -> dict:
    idle = []
    with httpx.Client(timeout=30) as client:
        for _ in range(probes):
            started = time.perf_counter()
            client.get(f"{service.url}/health")
            idle.append(time.perf_counter() - started)
    big, bomb = rotations_body(), frame_bomb(1 << 20)
    alone = [post(service.url, service.token, "/v1/systemone", big) for _ in range(3)]
    logged_before = len(service.log_path.read_text(encoding="utf-8").splitlines())
    calls = [lambda: post(service.url, service.token, "/v1/systemone", big) for _ in range(4)]
    calls += [
        lambda: post(service.url, service.token, "/v1/systemone", bomb, {"Content-Encoding": "zstd"})
        for _ in range(8)
    ]
    with Prober(service.url) as prober:
        time.sleep(0.2)
        results = in_parallel(calls)
        time.sleep(0.2)
    logged: dict[int, list[float]] = {413: [], 400: []}
    for line in service.log_path.read_text(encoding="utf-8").splitlines()[logged_before:]:
        record = json.loads(line) if line.startswith("{") else {}
        if record.get("message") == "request" and record.get("status") in logged:
            logged[record["status"]].append(record["duration_ms"] / 1000)
    return {
        "alone": alone,
        "logged": logged,
        "idle_worst": max(idle),
        "idle_median": statistics.median(idle),
        "attack_worst": max(prober.latencies),
        "attack_median": statistics.median(prober.latencies),
        "probes": len(prober.latencies),
        "big": results[:4],
        "bombs": results[4:],
        "big_bytes": len(big),
        "bomb_bytes": len(bomb),
    }


def encoding_before_after(codec, state: str, rows: int) -> dict:
    from semif_serve.domain.types import PromptRow

    prompt_rows = [
        PromptRow(f"Is statement {i} about the release true?", ("Yes, it is true.", "No, it is false."))
        for i in range(rows)
    ]
    assert codec.splits_after_state
    started = time.perf_counter()
    once = codec.encode_prompts(state, prompt_rows, 40_000)
    once_s = time.perf_counter() - started
    started = time.perf_counter()
    whole = [codec.encode_prompt(state, r.question, r.descriptions, 40_000) for r in prompt_rows]
    whole_s = time.perf_counter() - started
    assert [p.ids for p in once] == [p.ids for p in whole]
    return {"once": once_s, "whole": whole_s, "state_tokens": once[0].head_tokens}


def heavy_and_tiny(service: ServiceProcess, state: str, rows: int) -> dict:
    heavy = json.dumps({"model": "jev-latest", "state": state, "questions": nouls(rows)}).encode()
    tiny = json.dumps(
        {"model": "jev-latest", "state": "The release went well.", "questions": nouls(1)}
    ).encode()
    tiny_alone = [post(service.url, service.token, "/v1/systemone", tiny) for _ in range(3)]

    def late_tiny():
        time.sleep(1.0)
        return post(service.url, service.token, "/v1/systemone", tiny)

    with Prober(service.url, every=0.05) as prober:
        heavy_result, tiny_result = in_parallel(
            [lambda: post(service.url, service.token, "/v1/systemone", heavy), late_tiny]
        )
    return {
        "tiny_alone": statistics.median(s for _, s in tiny_alone),
        "tiny_beside": tiny_result,
        "heavy": heavy_result,
        "heavy_bytes": len(heavy),
        "health_worst": max(prober.latencies),
    }


def long_question(service: ServiceProcess, codec, tokens: int) -> dict:
    instructions = state_of(codec, tokens)
    body = json.dumps(
        {
            "model": "jev-latest",
            "state": "The release went well.",
            "questions": {"q": {"type": "noul", "instructions": instructions, "x_orderings": "none"}},
        }
    ).encode()
    before = read_rss(service.pid)["VmRSS"]
    reset = reset_peak_rss(service.pid)
    status, seconds = post(service.url, service.token, "/v1/systemone", body)
    peak = read_rss(service.pid)["VmHWM"]
    return {
        "status": status,
        "seconds": seconds,
        "rss_before": before,
        "growth": peak - before if reset else None,
        "tokens": len(codec.encode(instructions)),
        "bytes": len(body),
    }


def gpu_bound(tokens: int, chunk: int) -> dict:
    """The memory estimate for one row of `tokens` suffix tokens at Qwen3.5-4B geometry in BF16."""
    from transformers import Qwen3_5TextConfig

    from semif_serve.engine.memory import MemoryEstimate
    from semif_serve.tools.demo import QWEN35_4B_SHAPE, QWEN35_VOCAB_SIZE

    config = Qwen3_5TextConfig(**QWEN35_4B_SHAPE.text_config(QWEN35_VOCAB_SIZE))
    estimate = MemoryEstimate(config, 2)
    prefix = 100
    return {
        "chunked": estimate.prefill_bytes(prefix, chunk) + estimate.row_bytes(prefix, tokens, chunk),
        "whole": estimate.prefill_bytes(prefix, chunk) + estimate.row_bytes(prefix, tokens),
    }


def six_large_states_and_a_tiny_one(service: ServiceProcess) -> dict:
    large = json.dumps(
        {"model": "jev-latest", "state": "The zones recovered. " * 45_000, "questions": nouls(1)}
    ).encode()
    tiny = json.dumps({"model": "jev-latest", "state": "ok", "questions": nouls(1)}).encode()
    tiny_alone = statistics.median(
        post(service.url, service.token, "/v1/systemone", tiny)[1] for _ in range(3)
    )

    def late_tiny():
        time.sleep(0.5)
        return post(service.url, service.token, "/v1/systemone", tiny)

    calls = [lambda: post(service.url, service.token, "/v1/systemone", large) for _ in range(6)]
    with Prober(service.url, every=0.05) as prober:
        results = in_parallel([*calls, late_tiny])
    return {
        "large": results[:6],
        "tiny": results[6],
        "tiny_alone": tiny_alone,
        "health": max(prober.latencies),
    }


def forwards_run(service: ServiceProcess) -> int:
    text = httpx.get(f"{service.url}/metrics", timeout=30).text
    return int(
        float(next(line for line in text.splitlines() if line.startswith("semif_forwards_total ")).split()[1])
    )


def rows_over_a_long_state(service: ServiceProcess, state: str, rows: int) -> dict:
    body = json.dumps({"model": "jev-latest", "state": state, "questions": nouls(rows)}).encode()
    before = forwards_run(service)
    status, seconds = post(service.url, service.token, "/v1/systemone", body)
    return {"status": status, "seconds": seconds, "forwards": forwards_run(service) - before}


def issue30(model: Path, work: Path, codec, quick: bool, before: str | None) -> None:
    """Phases 5 and 6 on this tree's service, and on one importing `before` when given."""
    from semif_serve.tools.demo import DEMO_REVISION

    state = state_of(codec, 8_000 if quick else 31_000)  # ~29k real tokens
    settings = {"device": "cpu", "demo": "true", **({"max_batch_tokens": 4096} if quick else {})}
    trees = {"now": None, **({"before": before} if before else {})}
    measured = {}
    for name, src in trees.items():
        extra = {"PYTHONPATH": src} if src else None
        with ServiceProcess(
            model, DEMO_REVISION, settings, work / f"issue30-{name}", extra_env=extra
        ) as service:
            print(f"issue 30, {name}: six large states and a tiny one ...", flush=True)
            side = six_large_states_and_a_tiny_one(service)
            print(f"issue 30, {name}: 200 questions over a long state ...", flush=True)
            measured[name] = (side, rows_over_a_long_state(service, state, 200))
    tokens = len(codec.encode(state))
    for name, (side, rows) in measured.items():
        print(f"{name}: 6 large states: " + ", ".join(f"{s} in {t:.2f} s" for s, t in side["large"]))
        tiny_status, tiny_seconds = side["tiny"]
        print(
            f"{name}: tiny request alone {side['tiny_alone'] * 1000:.0f} ms; sent 0.5 s after them "
            f"{tiny_status} in {tiny_seconds:.2f} s; /health worst {side['health'] * 1000:.0f} ms"
        )
        print(
            f"{name}: 200 questions over a {tokens}-token state: {rows['status']} in "
            f"{rows['seconds']:.1f} s, {rows['forwards']} forwards"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--issue30", action="store_true", help="only phases 5 and 6")
    parser.add_argument("--before", help="also run phases 5 and 6 on a service importing this src")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from semif_serve.domain.prompt import PromptCodec
    from semif_serve.tools.demo import DEMO_REVISION, write_checkpoint

    work = Path(tempfile.mkdtemp(prefix="semif-stalls-"))
    model = write_checkpoint(work / "model")
    codec = PromptCodec(AutoTokenizer.from_pretrained(str(model)))
    if args.issue30 or args.before:
        issue30(model, work, codec, args.quick, args.before)
        if args.issue30:
            return
    state_tokens = 8_000 if args.quick else 34_700  # ~32.4k real tokens (the sentence is ~15 per copy)
    rows = 64 if args.quick else 256
    state = state_of(codec, state_tokens)
    settings = {"device": "cpu", "demo": "true"}  # every limit at its default
    print("encoding, in process ...", flush=True)
    encoding = encoding_before_after(codec, state, rows)
    with ServiceProcess(model, DEMO_REVISION, settings, work / "service") as service:
        print("health under attack ...", flush=True)
        attack = health_under_attack(service, 10 if args.quick else 30)
        print("heavy beside tiny ...", flush=True)
        fairness = heavy_and_tiny(service, state, rows)
        print("long question ...", flush=True)
        longq = long_question(service, codec, 8_000 if args.quick else 34_950)
    bound = gpu_bound(32_700, 2048)

    def ms(seconds: float) -> str:
        return f"{seconds * 1000:.0f} ms"

    big = attack["big"]
    bombs = attack["bombs"]
    lines = [
        ("measurement", "measured", "goal"),
        (
            "/health worst: idle vs 4 x 72,165-row bodies + 8 frame bombs",
            f"{ms(attack['idle_worst'])} vs {ms(attack['attack_worst'])} (median "
            f"{ms(attack['idle_median'])} vs {ms(attack['attack_median'])}, {attack['probes']} probes)",
            "< 1 s",
        ),
        (
            f"72,165-row bodies ({attack['big_bytes']} B): status, time to it",
            ", ".join(f"{s} in {ms(t)}" for s, t in big),
            "413 < 100 ms",
        ),
        (
            "  one such body alone, 3 times one after another",
            ", ".join(f"{s} in {ms(t)}" for s, t in attack["alone"]),
            "413 < 100 ms",
        ),
        (
            "  the 4 concurrent ones as the service logged them (headers in to answer out)",
            ", ".join(f"{ms(t)}" for t in attack["logged"][413]),
            "",
        ),
        (
            f"frame bombs ({attack['bomb_bytes']} B of empty zstd frames): status, time",
            ", ".join(f"{s} in {ms(t)}" for s, t in bombs),
            "4xx",
        ),
        (
            "  the same, as the service logged them",
            ", ".join(f"{ms(t)}" for t in attack["logged"][400]),
            "",
        ),
        (
            f"{rows} questions over a {encoding['state_tokens']}-token state: encoding, per row vs once",
            f"{encoding['whole']:.2f} s vs {encoding['once']:.2f} s "
            f"= {encoding['whole'] / encoding['once']:.1f}x",
            "",
        ),
        (
            f"the same request end to end ({fairness['heavy_bytes']} B)",
            f"{fairness['heavy'][0]} in {fairness['heavy'][1]:.2f} s",
            "",
        ),
        (
            "a tiny request: alone vs sent 1 s after the heavy one",
            f"{ms(fairness['tiny_alone'])} vs {fairness['tiny_beside'][0]} in "
            f"{ms(fairness['tiny_beside'][1])}",
            "< 3 s",
        ),
        ("/health worst meanwhile", ms(fairness["health_worst"]), "< 1 s"),
        (
            f"one {longq['tokens']}-token question ({longq['bytes']} B): RSS growth, time",
            (f"{longq['growth'] / GIB:.2f} GiB" if longq["growth"] is not None else "n/a")
            + f" over {longq['rss_before'] / GIB:.2f} GiB, {longq['status']} in {longq['seconds']:.1f} s",
            "< 1.5 GiB",
        ),
        (
            "estimate for a 32,700-token question, Qwen3.5-4B BF16: chunked vs whole",
            f"{bound['chunked'] / GIB:.2f} GiB vs {bound['whole'] / GIB:.2f} GiB",
            "",
        ),
    ]
    widths = [max(len(str(row[i])) for row in lines) for i in range(3)]
    for row in lines:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
