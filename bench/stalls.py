"""Issue 18: no single request stalls the service. One run, the ratios side by side.

    uv run python bench/stalls.py            # the demo checkpoint, fp32 CPU (a few minutes)
    uv run python bench/stalls.py --quick    # fewer probes and a smaller heavy request
    uv run python bench/stalls.py --only images     # the corrupt image alone (--quick: 2 posts)
    uv run python bench/stalls.py --only calibrate   # POST /calibrate alone (under a minute)

It starts the real service (`semif-serve serve`, the demo checkpoint) as a child process on a
loopback port and measures, over HTTP:

1. `/health` latency idle vs while 4 System One bodies of 72,165 rows (283 choices x 255
   options, rotations; ~1 MB) and 8 bodies of ~116,000 empty zstd frames (1 MiB) arrive at
   once (goal: worst < 1 s), and each refusal's time (goal: the 413s < 100 ms);
2. 256 questions over a ~32k-token state: the codec's encoding time with every row encoded
   whole (as before) vs the state encoded once (in this process, the same rows), and the
   request end to end through the service;
3. a tiny request's latency alone vs sent 1 s after that heavy request (goal < 3 s);
4. issue 30: System One bodies under two Content-Type headers (json first and multipart last,
   and the reverse), ~3 MB of JSON and a small zstd body inflating to ~10 MB of JSON: each
   refusal's time (goal: 400 < 1 s), /health and a tiny request meanwhile (goal < 1 s);
5. the service's RSS growth for one question of ~32.7k tokens (goal < 1.5 GiB), and the
   bound the memory estimate sets for that row at Qwen3.5-4B geometry in BF16, with the
   suffix chunked (as now) and whole (as before);
6. (issue 30) on the demo's vision checkpoint, a JPEG of a 64 x 64 scan under a header saying
   1024 x 1024: the time to its refusal (before: answered after ~10 s of engine time on filler
   pixels), /health meanwhile, and what a whole 1024 x 1024 JPEG costs the engine (what the
   corrupt one bought).
7. reply amplification (issue 30): 72 described options of 14 KB names in rotations, a few
   hundred bytes of zstd, 8 at once: the refusal's time (goal 413 < 1 s), `/health` meanwhile
   (goal < 1 s) and the service's RSS growth; and in process, the largest legitimate reply
   (255 options of 64-character names in rotations) and one just under SEMIF_MAX_REPLY_BYTES,
   mapped and serialised as the door does it: the count vs the real bytes, and the time.
8. `POST /calibrate` at its cap (SEMIF_CALIBRATE_MAX_LOGITS, 10,000 logits: 2,500 rows of 4):
   the fit's time, `/health` meanwhile (goal: worst < 1 s), a tiny System One request sent
   0.5 s into the fit (goal < 3 s), and the refusal of a row more (goal: 422, before any fit).
9. tiny requests' latencies sent 1, 3 and 6 s after a question about a 1024 x 1024 (and, without
   --quick, 1440 x 1440) PNG, on the demo's vision checkpoint, with the code before the tower
   ran in steps (a tree named by SEMIF_BENCH_BEFORE_SRC) and after (goal: about one chunk).

Issue 30, tokenising and batching (`--only tokens` runs only the next two; `--before SRC` runs
them on a second service importing SRC, an older checkout's src/, side by side):

10. six concurrent ~0.95 MB System One states (each past the token limit) and a tiny request
   sent 0.5 s after them: each refusal's time, the tiny one's wait, /health worst (goal < 1 s);
11. 200 questions over a ~29k-token state (--quick: ~8k tokens, SEMIF_MAX_BATCH_TOKENS=4096):
   the engine's forwards (from /metrics) and the request's seconds.

Issue 37 (`--only lev`; `--before SRC` also runs it on a service importing SRC):

13. on the demo checkpoint with its lev release (`lev-demo`): a tiny lev and a tiny base request
   alone, then each sent 1 s into one lev request over a ~6,000-word state (three nouls, its long
   prefix prefilled in steps) and, beside, into one base request over the same state (goal: the
   tiny one within the base's no-stall bound either way); and 16 lev requests in flight at once:
   their forwards from /metrics against the requests sent (goal: fewer forwards than requests).

Issue 38 (`--only progress`; `--before SRC` also runs it on a service importing SRC):

12. two concurrent System One noul questions (`x_orderings: "none"`) over new states that each
   fit the state cache alone but not together: ~2.2k and ~4.1k tokens at SEMIF_STATE_CACHE_MIB=1,
   two ~15k-token states at 4 MiB: each answer's status and seconds (a client gives up after
   --progress-timeout, 120 s), and the cache's evictions meanwhile (goal: both answered, each
   about as fast as alone).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from harness.server import ServiceProcess, read_rss, reset_peak_rss

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

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


def zstd_compress(data: bytes) -> bytes:
    try:
        from compression import zstd  # type: ignore[import-not-found]
    except ImportError:
        from backports import zstd
    return zstd.compress(data)


def frame_bomb(limit: int) -> bytes:
    frame = zstd_compress(b"")
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


def systemone(state: str, questions: int) -> bytes:
    return json.dumps({"model": "jev-latest", "state": state, "questions": nouls(questions)}).encode()


TINY_STATE = "The release went well."


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


def logged_lines(service: ServiceProcess) -> int:
    return len(service.log_path.read_text(encoding="utf-8").splitlines())


def logged_seconds(service: ServiceProcess, after: int, statuses) -> dict[int, list[float]]:
    """Each request the service logged after line `after`, by status: headers in to answer out."""
    logged: dict[int, list[float]] = {status: [] for status in statuses}
    for line in service.log_path.read_text(encoding="utf-8").splitlines()[after:]:
        record = json.loads(line) if line.startswith("{") else {}
        if record.get("message") == "request" and record.get("status") in logged:
            logged[record["status"]].append(record["duration_ms"] / 1000)
    return logged


def health_under_attack(service: ServiceProcess, probes: int) -> dict:
    idle = []
    with httpx.Client(timeout=30) as client:
        for _ in range(probes):
            started = time.perf_counter()
            client.get(f"{service.url}/health")
            idle.append(time.perf_counter() - started)
    big, bomb = rotations_body(), frame_bomb(1 << 20)
    alone = [post(service.url, service.token, "/v1/systemone", big) for _ in range(3)]
    logged_before = logged_lines(service)
    calls = [lambda: post(service.url, service.token, "/v1/systemone", big) for _ in range(4)]
    calls += [
        lambda: post(service.url, service.token, "/v1/systemone", bomb, {"Content-Encoding": "zstd"})
        for _ in range(8)
    ]
    with Prober(service.url) as prober:
        time.sleep(0.2)
        results = in_parallel(calls)
        time.sleep(0.2)
    return {
        "alone": alone,
        "logged": logged_seconds(service, logged_before, (413, 400)),
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


def two_content_types(service: ServiceProcess, repeats: int) -> dict:
    """Issue 30: System One bodies under two Content-Type headers (json + multipart, both orders),
    a ~3 MB JSON one and a small zstd one inflating to ~10 MB of JSON, `repeats` of each at once,
    with /health probed and a tiny request sent meanwhile."""
    pairs = [("application/json", "multipart/form-data; boundary=x")]
    pairs.append(pairs[0][::-1])
    plain = systemone(SENTENCE * (3_000_000 // len(SENTENCE)), 1)
    inflating = zstd_compress(systemone(SENTENCE * (10_000_000 // len(SENTENCE)), 1))
    tiny = systemone(TINY_STATE, 1)

    def attack(content: bytes, pair, coding: dict) -> tuple[int, float]:
        started = time.perf_counter()
        reply = httpx.post(
            f"{service.url}/v1/systemone",
            content=content,
            headers=[
                ("Authorization", f"Bearer {service.token}"),
                *(("Content-Type", kind) for kind in pair),
                *coding.items(),
            ],
            timeout=600,
        )
        return reply.status_code, time.perf_counter() - started

    zstd = {"Content-Encoding": "zstd"}
    calls = [lambda p=pair: attack(plain, p, {}) for pair in pairs for _ in range(repeats)]
    calls += [lambda p=pair: attack(inflating, p, zstd) for pair in pairs for _ in range(repeats)]

    def late_tiny():
        time.sleep(0.05)  # sent while the attack's bodies are arriving
        return post(service.url, service.token, "/v1/systemone", tiny)

    calls.append(late_tiny)
    tiny_alone = post(service.url, service.token, "/v1/systemone", tiny)
    before = logged_lines(service)
    with Prober(service.url) as prober:
        time.sleep(0.2)
        results = in_parallel(calls)
        time.sleep(0.2)
    half = len(pairs) * repeats
    return {
        "plain": results[:half],
        "inflating": results[half:-1],
        "tiny_alone": tiny_alone,
        "tiny_beside": results[-1],
        "logged": logged_seconds(service, before, (400,))[400],
        "health_worst": max(prober.latencies),
        "probes": len(prober.latencies),
        "plain_bytes": len(plain),
        "inflating_bytes": len(inflating),
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


def tiny_beside(service: ServiceProcess, path: str, heavy: bytes, tiny: bytes, delay: float):
    """A tiny System One request alone (3 times), then sent `delay` s into a heavy POST to `path`,
    with /health probed meanwhile: (the tiny ones alone, the heavy result, the tiny result, prober)."""
    tiny_alone = [post(service.url, service.token, "/v1/systemone", tiny) for _ in range(3)]

    def late_tiny():
        time.sleep(delay)
        return post(service.url, service.token, "/v1/systemone", tiny)

    with Prober(service.url, every=0.05) as prober:
        heavy_result, tiny_result = in_parallel(
            [lambda: post(service.url, service.token, path, heavy), late_tiny]
        )
    return tiny_alone, heavy_result, tiny_result, prober


def heavy_and_tiny(service: ServiceProcess, state: str, rows: int) -> dict:
    heavy, tiny = systemone(state, rows), systemone(TINY_STATE, 1)
    tiny_alone, heavy_result, tiny_result, prober = tiny_beside(service, "/v1/systemone", heavy, tiny, 1.0)
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


def corrupt_header_jpeg() -> bytes:
    """A flat 64 x 64 JPEG whose frame header (SOF0) is rewritten to say 1024 x 1024."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (64, 64), (90, 140, 200)).save(out, format="JPEG", quality=50)
    data = bytearray(out.getvalue())
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = (1024).to_bytes(2, "big") * 2
    return bytes(data)


def image_body(jpeg: bytes) -> bytes:
    import base64

    photo = "<image:0123456789abcdef0123456789abcdef>"
    asset = {"type": "image", "format": "jpeg", "data_base64": base64.b64encode(jpeg).decode()}
    return json.dumps(
        {"model": "jev-latest", "state": f"A photo: {photo}", "questions": nouls(1), "assets": {photo: asset}}
    ).encode()


def corrupt_image(work: Path, quick: bool) -> dict:
    import io

    from PIL import Image

    from semif_serve.tools.demo import DEMO_REVISION, write_checkpoint

    model = write_checkpoint(work / "vision-model", multimodal=True)
    corrupt = corrupt_header_jpeg()
    whole = io.BytesIO()
    Image.effect_noise((1024, 1024), 40).convert("RGB").save(whole, format="JPEG", quality=75)
    tiny = json.dumps({"model": "jev-latest", "state": "The release went well.", "questions": nouls(1)})
    with ServiceProcess(model, DEMO_REVISION, {"device": "cpu", "demo": "true"}, work / "vision") as service:
        with Prober(service.url, every=0.05) as prober:
            refusals = [
                post(service.url, service.token, "/v1/systemone", image_body(corrupt))
                for _ in range(2 if quick else 5)
            ]
        tiny_after = post(service.url, service.token, "/v1/systemone", tiny.encode())
        bought = (
            None if quick else post(service.url, service.token, "/v1/systemone", image_body(whole.getvalue()))
        )
    return {
        "bytes": len(corrupt),
        "refusals": refusals,
        "health_worst": max(prober.latencies),
        "tiny_after": tiny_after,
        "whole": bought,
        "whole_bytes": len(whole.getvalue()),
    }


def calibrate_rows(logits: int, options: int = 4) -> bytes:
    """A `POST /calibrate` body of `logits` logits: rows of `options`, labels and groups varied."""
    rows = [
        {
            "logits": [((i * 7 + k * 3) % 11) / 2.0 - 2.5 for k in range(options)],
            "label": i % options,
            "group": i % 50,
        }
        for i in range(logits // options)
    ]
    return json.dumps({"workload": "bench", "rows": rows}).encode()


def calibrate_beside_health(service: ServiceProcess, cap: int) -> dict:
    at_cap, over = calibrate_rows(cap), calibrate_rows(cap + 4)
    tiny = json.dumps(
        {"model": "jev-latest", "state": "The release went well.", "questions": nouls(1)}
    ).encode()
    refused = [post(service.url, service.token, "/calibrate", over) for _ in range(3)]
    tiny_alone, fit, tiny_result, prober = tiny_beside(service, "/calibrate", at_cap, tiny, 0.5)
    return {
        "fit": fit,
        "fit_bytes": len(at_cap),
        "refused": refused,
        "tiny_alone": statistics.median(s for _, s in tiny_alone),
        "tiny_beside": tiny_result,
        "health_worst": max(prober.latencies),
        "health_median": statistics.median(prober.latencies),
        "probes": len(prober.latencies),
    }


def calibrate_lines(result: dict, cap: int) -> list[tuple[str, str, str]]:
    return [
        (
            f"POST /calibrate at the cap ({cap} logits, {result['fit_bytes']} B): status, time",
            f"{result['fit'][0]} in {result['fit'][1]:.2f} s",
            "",
        ),
        (
            "  /health meanwhile: worst (median)",
            f"{ms(result['health_worst'])} ({ms(result['health_median'])}, {result['probes']} probes)",
            "< 1 s",
        ),
        (
            "  a tiny request: alone vs sent 0.5 s into the fit",
            f"{ms(result['tiny_alone'])} vs {result['tiny_beside'][0]} in {ms(result['tiny_beside'][1])}",
            "< 3 s",
        ),
        (
            f"  {cap + 4} logits: status, time",
            statuses(result["refused"]),
            "422, no fit",
        ),
    ]


def gradient_png(side: int) -> bytes:
    """A side x side PNG that compresses well (what it shows does not change the tower's cost)."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.linear_gradient("L").resize((side, side)).convert("RGB").save(out, format="PNG")
    return out.getvalue()


def tiny_beside_an_image(model: Path, work: Path, source: Path, side: int) -> dict:
    """Tiny text requests sent 1, 3 and 6 s after one question about a side x side PNG (each
    once the one before it is answered), on a fresh service running the code under `source`
    (this tree's, or the one before it); the service stops once they are answered (the
    image's request with it)."""
    import base64

    from semif_serve.tools.demo import DEMO_REVISION

    photo = "<image:0123456789abcdef0123456789abcdef>"
    asset = {"type": "image", "format": "png", "data_base64": base64.b64encode(gradient_png(side)).decode()}
    heavy = json.dumps(
        {"model": "jev-latest", "state": {"photo": photo}, "questions": nouls(1), "assets": {photo: asset}}
    ).encode()
    tiny = json.dumps(
        {"model": "jev-latest", "state": "The release went well.", "questions": nouls(1)}
    ).encode()
    settings = {"device": "cpu", "demo": "true", "shutdown_grace_seconds": 1}
    env = {"PYTHONPATH": str(source)}
    tinies = []
    with ServiceProcess(model, DEMO_REVISION, settings, work / f"tower-{side}", extra_env=env) as service:
        started = time.perf_counter()
        threading.Thread(
            target=lambda: post_quietly(service.url, service.token, "/v1/systemone", heavy), daemon=True
        ).start()
        with Prober(service.url, every=0.05) as prober:
            for offset in (1.0, 3.0, 6.0):
                time.sleep(max(0.0, started + offset - time.perf_counter()))
                tinies.append(post(service.url, service.token, "/v1/systemone", tiny))
    return {"tinies": tinies, "health_worst": max(prober.latencies)}


def tower_rows(tower: dict) -> list[tuple[str, str, str]]:
    """The tower phase's lines of the table."""
    return [
        (
            f"tiny requests 1, 3, 6 s after a {side} x {side} PNG's question ({when}), /health worst",
            statuses(got["tinies"]) + f"; {ms(got['health_worst'])}",
            "about one chunk; < 1 s" if when == "after" else "",
        )
        for (side, when), got in tower.items()
    ]


def post_quietly(url: str, token: str, path: str, body: bytes) -> None:
    """`post`, where the service may stop before it answers."""
    try:
        post(url, token, path, body)
    except httpx.HTTPError:
        pass


def tower_before_after(work: Path, sides: list[int]) -> dict:
    """`tiny_beside_an_image` for each side, after (this tree) and, where SEMIF_BENCH_BEFORE_SRC
    names an older tree's src/, before the tower ran in steps."""
    from semif_serve.tools.demo import write_checkpoint

    model = write_checkpoint(work / "vision-model", multimodal=True)
    trees = [("after", ROOT / "src")]
    if os.environ.get("SEMIF_BENCH_BEFORE_SRC"):  # a checkout's src/ from before the change
        trees.insert(0, ("before", Path(os.environ["SEMIF_BENCH_BEFORE_SRC"])))
    return {
        (side, when): tiny_beside_an_image(model, work / when, source, side)
        for side in sides
        for when, source in trees
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


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def statuses(results) -> str:
    """(status, seconds) pairs as the table shows them."""
    return ", ".join(f"{status} in {ms(seconds)}" for status, seconds in results)


def image_rows(corrupt: dict) -> list[tuple[str, str, str]]:
    """Phase 5's lines of the table."""
    return [
        (
            f"JPEG of a 64 x 64 scan under a 1024 x 1024 header ({corrupt['bytes']} B), vision demo: "
            "status, time",
            statuses(corrupt["refusals"]),
            "422, no engine work",
        ),
        ("  /health worst meanwhile", ms(corrupt["health_worst"]), "< 1 s"),
        ("  a tiny request right after", f"{corrupt['tiny_after'][0]} in {ms(corrupt['tiny_after'][1])}", ""),
        (
            f"  what it bought before: a whole 1024 x 1024 JPEG ({corrupt['whole_bytes']} B) answered",
            f"{corrupt['whole'][0]} in {corrupt['whole'][1]:.1f} s"
            if corrupt["whole"]
            else "(not with --quick)",
            "",
        ),
    ]


def print_table(lines: list[tuple[str, str, str]]) -> None:
    widths = [max(len(str(row[i])) for row in lines) for i in range(3)]
    for row in lines:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)))


def amplifying_body() -> bytes:
    """72 options of 14 KB names, each described (a name then costs no token), in rotations:
    unbounded, 72 readings echoing every name twice, some 145 MB of reply."""
    criteria = {f"{i:02d}" + "x" * 13_998: f"Option {i}." for i in range(72)}
    question = {"type": "choice", "criteria": criteria, "x_orderings": "rotations"}
    return json.dumps({"model": "jev-latest", "state": "s", "questions": {"pick": question}}).encode()


def reply_amplification(service: ServiceProcess, concurrent: int) -> dict:
    plain = amplifying_body()
    body = zstd_compress(plain)
    zstd = {"Content-Encoding": "zstd"}
    alone = [post(service.url, service.token, "/v1/systemone", body, zstd) for _ in range(3)]
    before = read_rss(service.pid)["VmRSS"]
    reset = reset_peak_rss(service.pid)
    with Prober(service.url) as prober:
        time.sleep(0.2)
        results = in_parallel(
            [lambda: post(service.url, service.token, "/v1/systemone", body, zstd)] * concurrent
        )
        time.sleep(0.2)
    peak = read_rss(service.pid)["VmHWM"]
    return {
        "bytes": len(body),
        "inflated": len(plain),
        "alone": alone,
        "concurrent": results,
        "health_worst": max(prober.latencies),
        "growth": peak - before if reset else None,
    }


def reply_build(options: int, name_length: int) -> dict:
    """One choice of `options` options (`name_length`-character names, described) in rotations,
    answered by SemIf's method from synthetic readouts in process (its plan, the door's count of
    the reply, its outcome mapped to the wire) and serialised as the door does it."""
    import random

    from semif_serve.domain.calibration import CalibrationTable
    from semif_serve.domain.requests import BASE, Defaults, Limits
    from semif_serve.domain.types import BatchTiming
    from semif_serve.doors.base import json_reply
    from semif_serve.doors.systemone.mapping import answers_of, asked_question, timing_block, usage_of
    from semif_serve.doors.systemone.schemas import ChoiceQuestion, SystemOneResponse
    from semif_serve.doors.systemone.sizes import reply_bytes
    from semif_serve.engine.rows import Readout, RowReadout
    from semif_serve.service.methods import Ask, MethodStart, Served
    from semif_serve.service.methods.semif import SemIfMethod
    from semif_serve.service.models import ModelEntry

    criteria = {f"{i:03d}".ljust(name_length, "n"): f"Option {i}." for i in range(options)}
    body = ChoiceQuestion(type="choice", criteria=criteria, x_orderings="rotations")
    model = "Qwen/Qwen3.5-4B@" + "0" * 40
    # Its plan and answers read no engine and no settings: the calibration and the base's name.
    method = SemIfMethod(MethodStart(None, None, CalibrationTable(), model, None))  # type: ignore[arg-type]
    served = Served(model, method, BASE, ModelEntry(model, method.name), is_base=True)
    limits = Limits(max_input_tokens=8192, max_options=options, max_rows=options)
    ask = Ask(served, "s", (asked_question("pick", body),), limits, shared=True, defaults=Defaults())
    plan = method.plan(ask)
    started = time.perf_counter()
    counted = reply_bytes(method, plan, [("pick", body.type)], model)
    count_s = time.perf_counter() - started
    readout = Readout(
        rows=[
            RowReadout(
                [random.gauss(0, 3) for _ in range(options)],
                [random.random() for _ in range(options)],
                9,
                "0" * 64,
            )
            for _ in plan.rows
        ],
        shared=True,
        forward_seconds=1.0,
        total_seconds=1.0,
        timing=BatchTiming(100, 0.1, 0.1, 0.1, len(plan.rows), 1000, 1000, 4),
    )
    started = time.perf_counter()
    decided = method.outcome(plan, [readout])
    assert decided.answers is not None
    answers = answers_of(["pick"], decided.answers, method)
    mapped_s = time.perf_counter() - started
    reply = SystemOneResponse(
        model=model, answers=answers, usage=usage_of(decided), x_timing=timing_block(decided)
    )
    started = time.perf_counter()
    sent = len(json_reply(reply).body)
    serialised_s = time.perf_counter() - started
    return {
        "options": options,
        "name_length": name_length,
        "counted": counted,
        "sent": sent,
        "count_s": count_s,
        "mapped_s": mapped_s,
        "serialised_s": serialised_s,
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


def metric_total(service: ServiceProcess, name: str) -> float:
    """A counter's value from /metrics, summed over its labels."""
    text = httpx.get(f"{service.url}/metrics", timeout=30).text
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith((name + " ", name + "{"))
    )


def post_within(service: ServiceProcess, body: bytes, seconds: float) -> tuple[int | str, float]:
    """A POST that gives up after `seconds` (as a client would), its status or "gave up"."""
    started = time.perf_counter()
    try:
        reply = httpx.post(
            f"{service.url}/v1/systemone",
            content=body,
            headers={"Authorization": f"Bearer {service.token}"},
            timeout=seconds,
        )
        return reply.status_code, time.perf_counter() - started
    except httpx.TimeoutException:
        return "gave up", time.perf_counter() - started


# (SEMIF_STATE_CACHE_MIB, the two states' tokens): each fits the cache alone, not beside the other.
PROGRESS_CASES = ((1, (2_200, 4_100)), (4, (15_000, 15_000)))


def two_new_states_at_once(service: ServiceProcess, codec, tokens: tuple[int, int], seconds: float) -> dict:
    tag = time.time_ns()
    bodies = [systemone(f"Report {tag}-{n}. " + state_of(codec, count), 1) for n, count in enumerate(tokens)]
    evictions = metric_total(service, "semif_state_cache_evictions_total")
    results = in_parallel([lambda b=b: post_within(service, b, seconds) for b in bodies])
    return {
        "results": results,
        "evictions": metric_total(service, "semif_state_cache_evictions_total") - evictions,
    }


def progress(model: Path, work: Path, codec, before: str | None, seconds: float) -> None:
    """Phase 12 on this tree's service, and on one importing `before` when given."""
    from semif_serve.tools.demo import DEMO_REVISION

    trees = {"now": None, **({"before": before} if before else {})}
    lines = [("tree, cache, states", "answers (status, seconds)", "evictions meanwhile")]
    for name, src in trees.items():
        for mib, tokens in PROGRESS_CASES:
            settings = {"device": "cpu", "demo": "true", "state_cache_mib": mib}
            extra = {"PYTHONPATH": src} if src else None
            with ServiceProcess(
                model, DEMO_REVISION, settings, work / f"progress-{name}-{mib}", extra_env=extra
            ) as service:
                print(f"issue 38, {name}: two new states at once, {mib} MiB ...", flush=True)
                got = two_new_states_at_once(service, codec, tokens, seconds)
            answers = ", ".join(f"{status} in {t:.1f} s" for status, t in got["results"])
            lines.append(
                (f"{name}, {mib} MiB, {tokens[0]} + {tokens[1]} tokens", answers, f"{got['evictions']:.0f}")
            )
    print_table(lines)


LEV_MODEL = "lev-demo"  # the demo's lev release (tools.demo.ensure_demo_models)
LEV_STATE_WORDS = 6_000


def lev_body(state: str, questions: int, model: str = LEV_MODEL) -> bytes:
    """System One nouls about `state` on `model` (lev reads its release's own orders)."""
    asked = {
        f"q{i}": {"type": "noul", "instructions": f"Is claim {i} about the report true?"}
        for i in range(questions)
    }
    return json.dumps({"model": model, "state": state, "questions": asked}).encode()


def lev_in_flight(service: ServiceProcess, requests: int) -> dict:
    """`requests` lev requests about new short states at once: statuses and forwards run."""
    tag = time.time_ns()
    bodies = [lev_body(f"Ticket {tag}-{i}: the card payment failed twice.", 1) for i in range(requests)]
    before = metric_total(service, "semif_forwards_total")
    counted = metric_total(service, "semif_model_requests_total") + requests
    results = in_parallel([lambda b=b: post(service.url, service.token, "/v1/systemone", b) for b in bodies])
    deadline = time.monotonic() + 10
    while metric_total(service, "semif_model_requests_total") < counted and time.monotonic() < deadline:
        time.sleep(0.05)  # each request is counted just before its last byte: wait for the count
    return {
        "statuses": [status for status, _ in results],
        "forwards": metric_total(service, "semif_forwards_total") - before,
    }


def lev_beside(model: Path, work: Path, codec, before: str | None) -> None:
    """Phase 13 on this tree's service, and on one importing `before` when given."""
    from semif_serve.tools.demo import DEMO_REVISION, ensure_demo_models

    models = ensure_demo_models(model)
    trees = {"now": None, **({"before": before} if before else {})}
    lines = [("tree, heavy request, tiny one", "tiny alone / 1 s into the heavy one", "heavy request")]
    flights = []
    for name, src in trees.items():
        extra = {"PYTHONPATH": src} if src else None
        settings = {"device": "cpu", "demo": "true", "models": str(models)}
        with ServiceProcess(model, DEMO_REVISION, settings, work / f"lev-{name}", extra_env=extra) as service:
            for heavy_on in (LEV_MODEL, "jev-latest"):
                for tiny_on in (LEV_MODEL, "jev-latest"):
                    tag = time.time_ns()
                    state = f"Report {tag}. " + " ".join(
                        ["The deployment log lists a warning."] * (LEV_STATE_WORDS // 6)
                    )
                    heavy = lev_body(state, 3, heavy_on)
                    tiny = lev_body(TINY_STATE, 1, tiny_on)
                    print(f"issue 37, {name}: tiny {tiny_on} beside heavy {heavy_on} ...", flush=True)
                    alone, heavy_result, tiny_result, _ = tiny_beside(
                        service, "/v1/systemone", heavy, tiny, 1.0
                    )
                    alone_ms = ms(statistics.median(t for _, t in alone))
                    beside = f"{alone_ms} / {tiny_result[0]} in {ms(tiny_result[1])}"
                    heavy_ran = f"{heavy_result[0]} in {ms(heavy_result[1])}"
                    lines.append((f"{name}, {heavy_on}, {tiny_on}", beside, heavy_ran))
            got = lev_in_flight(service, 16)
            flights.append((name, got))
    print_table(lines)
    for name, got in flights:
        statuses = sorted(set(got["statuses"]))
        print(f"{name}: 16 lev requests in flight: {statuses}, {got['forwards']:.0f} forwards")


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
    parser.add_argument(
        "--only",
        choices=["images", "calibrate", "tower", "tokens", "progress", "lev"],
        help="run one phase alone",
    )
    parser.add_argument(
        "--progress-timeout", type=float, default=120.0, help="phase 12: a client gives up after"
    )
    parser.add_argument("--before", help="also run the tokenising phases on a service importing this src/")
    args = parser.parse_args()
    sides = [1024] if args.quick else [1024, 1440]
    if args.only == "images":
        work = Path(tempfile.mkdtemp(prefix="semif-stalls-"))
        print_table([("measurement", "measured", "goal"), *image_rows(corrupt_image(work, args.quick))])
        return
    if args.only == "tower":
        work = Path(tempfile.mkdtemp(prefix="semif-stalls-"))
        print_table([("measurement", "measured", "goal"), *tower_rows(tower_before_after(work, sides))])
        return

    from transformers import AutoTokenizer

    from semif_serve.domain.prompt import PromptCodec
    from semif_serve.tools.demo import DEMO_REVISION, write_checkpoint

    work = Path(tempfile.mkdtemp(prefix="semif-stalls-"))
    model = write_checkpoint(work / "model")
    codec = PromptCodec(AutoTokenizer.from_pretrained(str(model)))
    if args.only == "progress":
        progress(model, work, codec, args.before, args.progress_timeout)
        return
    if args.only == "lev":
        lev_beside(model, work, codec, args.before)
        return
    if args.only == "tokens" or args.before:
        issue30(model, work, codec, args.quick, args.before)
        if args.only == "tokens":
            return
    state_tokens = 8_000 if args.quick else 34_700  # ~32.4k real tokens (the sentence is ~15 per copy)
    rows = 64 if args.quick else 256
    state = state_of(codec, state_tokens)
    settings = {"device": "cpu", "demo": "true"}  # every limit at its default
    from semif_serve.service.settings import Settings

    cap = Settings.model_fields["calibrate_max_logits"].default
    if args.only == "calibrate":
        with ServiceProcess(model, DEMO_REVISION, settings, work / "service") as service:
            print("calibrate beside health ...", flush=True)
            fitted = calibrate_beside_health(service, cap)
        print_table([("measurement", "measured", "goal"), *calibrate_lines(fitted, cap)])
        return
    print("encoding, in process ...", flush=True)
    encoding = encoding_before_after(codec, state, rows)
    with ServiceProcess(model, DEMO_REVISION, settings, work / "service") as service:
        print("health under attack ...", flush=True)
        attack = health_under_attack(service, 10 if args.quick else 30)
        print("two Content-Types ...", flush=True)
        headers = two_content_types(service, 2 if args.quick else 4)
        print("heavy beside tiny ...", flush=True)
        fairness = heavy_and_tiny(service, state, rows)
        print("long question ...", flush=True)
        longq = long_question(service, codec, 8_000 if args.quick else 34_950)
        print("reply amplification ...", flush=True)
        amplified = reply_amplification(service, 8)
    print("corrupt image ...", flush=True)
    corrupt = corrupt_image(work, args.quick)
    print("calibrate beside health ...", flush=True)
    with ServiceProcess(model, DEMO_REVISION, settings, work / "calibrate") as service:
        fitted = calibrate_beside_health(service, cap)
    print("tiny beside an image in the tower, before and after ...", flush=True)
    tower = tower_before_after(work, sides)
    bound = gpu_bound(32_700, 2048)
    builds = [reply_build(255, 64), reply_build(255, 112)]

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
            statuses(big),
            "413 < 100 ms",
        ),
        (
            "  one such body alone, 3 times one after another",
            statuses(attack["alone"]),
            "413 < 100 ms",
        ),
        (
            "  the 4 concurrent ones as the service logged them (headers in to answer out)",
            ", ".join(f"{ms(t)}" for t in attack["logged"][413]),
            "",
        ),
        (
            f"frame bombs ({attack['bomb_bytes']} B of empty zstd frames): status, time",
            statuses(bombs),
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
            f"two Content-Types, {headers['plain_bytes']} B JSON: status, time (client side)",
            statuses(headers["plain"]),
            "400 < 1 s",
        ),
        (
            f"  {headers['inflating_bytes']} B of zstd inflating to ~10 MB JSON: status, time",
            statuses(headers["inflating"]),
            "400 < 1 s",
        ),
        (
            "  the service's own times for those 400s (headers in to answer out)",
            ", ".join(ms(t) for t in headers["logged"]),
            "",
        ),
        (
            "  a tiny request alone vs during them; /health worst meanwhile",
            f"{ms(headers['tiny_alone'][1])} vs {headers['tiny_beside'][0]} in "
            f"{ms(headers['tiny_beside'][1])}; {ms(headers['health_worst'])} ({headers['probes']} probes)",
            "< 1 s",
        ),
        (
            f"one {longq['tokens']}-token question ({longq['bytes']} B): RSS growth, time",
            (f"{longq['growth'] / GIB:.2f} GiB" if longq["growth"] is not None else "n/a")
            + f" over {longq['rss_before'] / GIB:.2f} GiB, {longq['status']} in {longq['seconds']:.1f} s",
            "< 1.5 GiB",
        ),
        *image_rows(corrupt),
        (
            "estimate for a 32,700-token question, Qwen3.5-4B BF16: chunked vs whole",
            f"{bound['chunked'] / GIB:.2f} GiB vs {bound['whole'] / GIB:.2f} GiB",
            "",
        ),
        *calibrate_lines(fitted, cap),
    ]
    lines += [
        (
            f"reply amplification ({amplified['bytes']} B zstd, {amplified['inflated']} B inflated): alone",
            statuses(amplified["alone"]),
            "413 < 1 s",
        ),
        (
            f"  {len(amplified['concurrent'])} at once: status, time",
            statuses(amplified["concurrent"]),
            "413 < 1 s",
        ),
        ("  /health worst meanwhile", ms(amplified["health_worst"]), "< 1 s"),
        (
            "  the service's RSS growth meanwhile",
            f"{amplified['growth'] / (1 << 20):.0f} MiB" if amplified["growth"] is not None else "n/a",
            "",
        ),
    ]
    lines += [
        (
            f"a reply of {b['options']} options x rotations, {b['name_length']}-char names: count vs sent",
            f"{b['counted']} B vs {b['sent']} B ({b['counted'] / b['sent']:.2f}x, counted in "
            f"{ms(b['count_s'])}); mapped {ms(b['mapped_s'])}, serialised {ms(b['serialised_s'])}",
            "count >= sent",
        )
        for b in builds
    ]
    lines += calibrate_lines(fitted, cap)
    lines += tower_rows(tower)
    print_table(lines)


if __name__ == "__main__":
    main()
