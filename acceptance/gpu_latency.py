"""The latency table and the capacity table on one GPU, without the weights, in under 8 minutes.

    uv run python -m acceptance.gpu_latency [--runs 3] [--requests 20] [--out RESULT.json]

It builds a random-weight checkpoint of Qwen3.5-4B's text geometry in BF16 in a temporary
directory (initialised on the GPU, so it needs neither ~16 GB of host RAM nor minutes of CPU
init), loads it through the production loader into the real service (device cuda, BF16, the
12 GiB cap) served by uvicorn on a loopback port in this process, and measures over HTTP:

- latency: the spec's five rows (short /decide, ~2,000-token state, 3 rotations, 6 orderings,
  3 rotations on the long state), median and p90 end to end and server-side;
- capacity, at ~140, ~520, ~1,960 and ~3,900 prefix tokens (binary decisions, found by
  bracketing from the spec's figures and bisecting):
  - the out-of-memory boundary: the largest /decide/shared row count that runs before a
    503 out_of_memory, with the engine's own batch splitting switched off (the spec's table:
    63/51/26/16 on 0.1.3);
  - the largest row count the engine, with its memory estimate on, runs in ONE forward; a
    503 there means the estimate let through a batch that did not fit (a gate).

Random weights cost what the real ones cost in time and memory; the answers mean nothing.
The tokenizer is the demo one, so "tokens" are fitted against the service's own counts.
Everything runs against a deadline (--deadline, default 450 s); a part that would overrun is
reported as skipped, and the run fails its gates.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .common import (
    EXIT_ERROR,
    EXIT_GATE_FAILED,
    EXIT_PASS,
    CheckError,
    Client,
    Gate,
    ServiceCallError,
    log,
    print_table,
    write_result,
)
from .latency import measure_latency, print_latency
from .server import LoopbackServer
from .workloads import (
    LATENCY_CASES,
    binary_criteria,
    filler,
    fit_latency_states,
    fit_words,
    prefix_tokens_probe,
)

REVISION = "random-weights-qwen3.5-4b-geometry-v1"
CAPACITY_PREFIX_TOKENS = (140, 520, 1960, 3900)
SPEC_CAPACITY = {140: 63, 520: 51, 1960: 26, 3900: 16}  # 0.1.3 on fv-ml1, for comparison and as hints
SPEC_LATENCY_SERVER_MS = (35, 92, 78, 81, 158)  # 0.1.3, server-side medians
VRAM_CAP_GIB = 12.0
MAX_ROWS = 1024  # well past anything that fits under 12 GiB: the cap, not the row limit, must bind
CAPACITY_BODY_BYTES = 8 * 1024 * 1024


# -- pure parts (tested on the CPU) -------------------------------------------------------


@dataclass
class Deadline:
    """Seconds left of a time box that started at construction."""

    seconds: float
    started: float = field(default_factory=time.monotonic)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def allows(self, needed: float) -> bool:
        return self.left() >= needed


@dataclass
class CapacitySearch:
    """The outcome of one capacity search: the largest fitting row count and every probe."""

    fits: int
    first_failure: int | None
    capped: bool
    probes: list[tuple[int, bool]]
    complete: bool


def find_capacity(
    probe: Callable[[int], bool],
    hint: int,
    limit: int,
    keep_going: Callable[[], bool] = lambda: True,
) -> CapacitySearch:
    """The largest n in 1..limit with probe(n) true, assuming fitting is monotone in n.

    Brackets from `hint` (x1.5 up while it fits, /2 down while it fails), then bisects.
    `keep_going` is asked before each probe; when it says no, the best bracket so far is
    returned with complete=False. probe(1) failing gives fits=0."""
    probes: list[tuple[int, bool]] = []

    def ask(n: int) -> bool:
        ok = probe(n)
        probes.append((n, ok))
        return ok

    lo, hi = 0, None  # lo fits (0: nothing known to fit), hi fails
    n = max(1, min(hint, limit))
    while True:
        if not keep_going():
            return CapacitySearch(lo, hi, False, probes, False)
        if ask(n):
            lo = n
            if n >= limit:
                return CapacitySearch(lo, None, True, probes, True)
            if hi is not None:
                break
            n = min(limit, max(n + 1, int(n * 1.5)))
        else:
            hi = n
            if lo:
                break
            if n == 1:
                return CapacitySearch(0, 1, False, probes, True)
            n = max(1, n // 2)
    while hi - lo > 1:
        if not keep_going():
            return CapacitySearch(lo, hi, False, probes, False)
        mid = (lo + hi) // 2
        if ask(mid):
            lo = mid
        else:
            hi = mid
    return CapacitySearch(lo, hi, False, probes, True)


def capacity_decisions(n: int) -> list[dict[str, Any]]:
    """n binary decisions with unique ids (the criteria repeat past 50; the rows do not share)."""
    base = binary_criteria(50)
    return [{**base[i % len(base)], "id": f"d{i:04d}"} for i in range(n)]


def service_settings(cap_gib: float = VRAM_CAP_GIB) -> dict[str, Any]:
    """SEMIF_* settings of the measured service: cuda, BF16, the cap, and limits the cap outruns."""
    return {
        "device": "cuda",
        "dtype": "bfloat16",
        "vram_cap_gib": cap_gib,
        "max_rows": MAX_ROWS,
        "max_body_bytes": CAPACITY_BODY_BYTES,
        "max_queue": 32,
    }


def write_random_checkpoint(directory: Path, shape, device: str = "cuda", seed: int = 0) -> Path:
    """A random-weight Qwen3.5 text checkpoint of `shape` in BF16, initialised on `device`
    (float32 init, then cast), with the demo tokenizer and a DEMO.json marker."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from semif_serve.tools.demo import build_tokenizer

    directory = Path(directory)
    tokenizer = build_tokenizer(directory)
    text = shape.text_config(-(-len(tokenizer) // 64) * 64)
    text.update(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    config = Qwen3_5TextConfig(**text)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(config)
    model.to(torch.bfloat16).eval()
    model.config.dtype = torch.bfloat16
    model.save_pretrained(str(directory))
    parameters = sum(p.numel() for p in model.parameters())
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    (directory / "DEMO.json").write_text(
        json.dumps({"random_weights": True, "revision": REVISION, "seed": seed, "parameters": parameters})
        + "\n"
    )
    return directory


# -- the GPU run --------------------------------------------------------------------------


def gpu_environment(gpu: str | None) -> dict[str, Any]:
    """The GPU, torch and kernel packages; exits when there is not exactly one usable GPU."""
    import importlib.util

    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    import torch

    if not torch.cuda.is_available():
        raise CheckError("no CUDA device is visible; gpu_latency needs one GPU")
    if torch.cuda.device_count() != 1:
        raise CheckError(f"{torch.cuda.device_count()} GPUs are visible; choose one with --gpu N")
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "gpu_memory_gib": round(props.total_memory / 1024**3, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "flash_linear_attention": importlib.util.find_spec("fla") is not None,
        "causal_conv1d": importlib.util.find_spec("causal_conv1d") is not None,
    }


@dataclass
class CapacityProbe:
    """probe(n) for one state: does /decide/shared with n binary decisions run in one forward?

    `split_counts` says whether a reply that the service split into several forward batches
    (its estimator at work) counts as fitting; a 503 out_of_memory or 413 too_large_for_memory
    never does. Every outcome is kept."""

    client: Client
    state: str
    split_counts: bool
    outcomes: list[tuple[int, str]] = field(default_factory=list)

    def __call__(self, n: int) -> bool:
        try:
            reply, _ = self.client.decide_shared(self.state, capacity_decisions(n))
        except ServiceCallError as exc:
            if (exc.status, exc.code) in ((503, "out_of_memory"), (413, "too_large_for_memory")):
                self.outcomes.append((n, exc.code))
                return False
            raise
        batches = reply["timing"].get("forward_batches", 1)
        self.outcomes.append((n, "ok" if batches == 1 else f"split into {batches}"))
        return batches == 1 or self.split_counts

    @property
    def out_of_memory(self) -> int:
        return sum(1 for _, outcome in self.outcomes if outcome == "out_of_memory")


def disable_splitting(service) -> Callable[[], None]:
    """Turn off the engine's own batch splitting (its memory estimate), so a request that does
    not fit really runs out of memory; returns the undo. In-process, so one run measures both;
    SEMIF_SPLIT_BATCHES=false does the same for a whole service."""
    core = service.core
    saved = core.engine
    core.engine = saved.with_memory(saved.memory, headroom_bytes=None)

    def restore() -> None:
        core.engine = saved

    return restore


def measure_capacity(
    client: Client,
    service,
    deadline: Deadline,
    targets: tuple[int, ...] = CAPACITY_PREFIX_TOKENS,
    limit: int = MAX_ROWS,
    reserve: float = 30.0,
) -> list[dict[str, Any]]:
    """Per state size: the real out-of-memory boundary (the engine's splitting off), then the
    largest request the engine runs in one forward with its estimate on (503s there mean the
    estimate let through a batch that did not fit)."""
    rows = []
    for target in targets:
        if not deadline.allows(reserve + 20):
            rows.append({"target_prefix_tokens": target, "skipped": "deadline"})
            continue
        words, prefix = fit_words(prefix_tokens_probe(client, seed=target), target)
        state = filler(words, seed=target)
        started = time.monotonic()
        hint = SPEC_CAPACITY.get(target, 16)
        restore = disable_splitting(service)
        try:
            raw = CapacityProbe(client, state, split_counts=False)
            boundary = find_capacity(raw, hint, limit, keep_going=lambda: deadline.allows(reserve))
        finally:
            restore()
        estimated = CapacityProbe(client, state, split_counts=False)
        one_forward = find_capacity(
            estimated, max(1, boundary.fits), limit, keep_going=lambda: deadline.allows(reserve)
        )
        rows.append(
            {
                "target_prefix_tokens": target,
                "prefix_tokens": prefix,
                "max_rows": boundary.fits,
                "first_failure": boundary.first_failure,
                "capped_by_max_rows": boundary.capped,
                "complete": boundary.complete and one_forward.complete,
                "probes": raw.outcomes,
                "one_forward_rows": one_forward.fits,
                "one_forward_probes": estimated.outcomes,
                "estimate_out_of_memory": estimated.out_of_memory,
                "seconds": time.monotonic() - started,
                "spec_0_1_3": SPEC_CAPACITY.get(target),
            }
        )
        log(
            f"capacity: ~{prefix} prefix tokens -> {boundary.fits} rows before OOM, "
            f"{one_forward.fits} in one forward by the estimate"
        )
    return rows


def capacity_gates(rows: list[dict[str, Any]]) -> list[Gate]:
    measured = [r for r in rows if "skipped" not in r]
    skipped = len(rows) - len(measured)
    return [
        Gate(
            "capacity measured",
            not skipped and all(r["complete"] for r in measured),
            f"{len(measured)}/{len(rows)} state sizes"
            + (f", {skipped} skipped (deadline)" if skipped else ""),
        ),
        Gate(
            "estimate never OOMs",
            all(r["estimate_out_of_memory"] == 0 for r in measured),
            "503 out_of_memory with the engine's estimate on: "
            + str(sum(r["estimate_out_of_memory"] for r in measured)),
        ),
        Gate(
            "estimate within the boundary",
            all(r["one_forward_rows"] <= r["max_rows"] for r in measured),
            "rows the estimate runs in one forward <= rows that fit before OOM",
        ),
    ]


def print_capacity(rows: list[dict[str, Any]], cap_gib: float = VRAM_CAP_GIB) -> None:
    table = []
    for r in rows:
        target = r["target_prefix_tokens"]
        spec = SPEC_CAPACITY.get(target)
        if "skipped" in r:
            table.append([f"~{target}", "-", "skipped (deadline)", "-", "-", spec])
            continue
        note = "" if r["complete"] else " (incomplete)"
        fits = f"{r['max_rows']}{'+' if r['capped_by_max_rows'] else ''}{note}"
        table.append(
            [f"~{target}", r["prefix_tokens"], fits, r["one_forward_rows"], r["estimate_out_of_memory"], spec]
        )
    print_table(
        [
            "state size",
            "prefix tok",
            "max rows (OOM boundary)",
            "rows in one forward (estimate)",
            "estimate 503s",
            "spec 0.1.3",
        ],
        table,
        title=f"capacity under a {cap_gib:g} GiB cap (/decide/shared, binary decisions)",
    )


def run_tables(
    service,
    url: str,
    token: str,
    runs: int,
    requests: int,
    deadline: Deadline,
    capacity_targets: tuple[int, ...] = CAPACITY_PREFIX_TOKENS,
    max_rows: int = MAX_ROWS,
    long_state_tokens: int = 2000,
) -> dict[str, Any]:
    """The latency table, then the capacity table, against a running service (`service` is its
    in-process object, used only to switch the engine's splitting off for the OOM boundary)."""
    out: dict[str, Any] = {}
    with Client(url, token, timeout=300) as client:
        health = client.health()
        out["service"] = {k: health.get(k) for k in ("version", "model", "limits", "memory")}
        states = fit_latency_states(client, long_state_tokens=long_state_tokens)
        rows = measure_latency(client, states, LATENCY_CASES, runs, requests)
        for row, spec in zip(rows, SPEC_LATENCY_SERVER_MS, strict=True):
            row["spec_0_1_3_server_ms"] = spec
        out["latency"] = {
            "runs": runs,
            "requests": requests,
            "short_input_tokens": states.short_input_tokens,
            "long_state_tokens": states.long_state_tokens,
            "rows": rows,
        }
        print_latency(rows, states, runs, requests, title="latency")
        if capacity_targets:
            out["capacity"] = measure_capacity(client, service, deadline, capacity_targets, max_rows)
            print_capacity(
                out["capacity"], service.settings.vram_cap_gib if service.settings.device == "cuda" else 0
            )
        out["memory_after"] = client.health().get("memory")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m acceptance.gpu_latency", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--runs", type=int, default=3, help="latency runs (N)")
    parser.add_argument("--requests", type=int, default=20, help="latency requests per run and row (M)")
    parser.add_argument("--deadline", type=float, default=450.0, help="time box in seconds for the whole run")
    parser.add_argument("--work-dir", type=Path, default=None, help="where to build (default: a temp dir)")
    parser.add_argument("--keep-checkpoint", action="store_true", help="leave the built checkpoint")
    parser.add_argument("--gpu", default=None, help="CUDA_VISIBLE_DEVICES for this run (default: inherited)")
    parser.add_argument("--skip-capacity", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="JSON result file")
    args = parser.parse_args(argv)
    deadline = Deadline(args.deadline)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    env = gpu_environment(args.gpu)
    log(f"gpu_latency: {env}")
    started_at = dt.datetime.now(dt.UTC)
    result: dict[str, Any] = {"environment": env, "started_at": started_at.isoformat(timespec="seconds")}
    work = Path(tempfile.mkdtemp(prefix="semif-gpu-", dir=args.work_dir))
    try:
        from semif_serve.app import create_app
        from semif_serve.service.settings import load_settings
        from semif_serve.service.startup import Service
        from semif_serve.tools.demo import QWEN35_4B_SHAPE

        t0 = time.monotonic()
        model_dir = write_random_checkpoint(work / "model", QWEN35_4B_SHAPE, device="cuda")
        result["build_seconds"] = time.monotonic() - t0
        log(f"gpu_latency: built the checkpoint in {result['build_seconds']:.0f} s")
        t0 = time.monotonic()
        token = "gpu-" + secrets.token_urlsafe(24)
        settings = load_settings(
            model_path=model_dir, model_revision=REVISION, api_token=token, **service_settings()
        )
        service = Service.start(settings)
        result["startup_seconds"] = time.monotonic() - t0
        log(f"gpu_latency: service loaded and warmed up in {result['startup_seconds']:.0f} s")
        try:
            with LoopbackServer(create_app(service)) as server:
                capacity = () if args.skip_capacity else CAPACITY_PREFIX_TOKENS
                result.update(
                    run_tables(service, server.url, token, args.runs, args.requests, deadline, capacity)
                )
        finally:
            service.worker.shutdown()
    finally:
        if not args.keep_checkpoint:
            shutil.rmtree(work, ignore_errors=True)
    result["seconds"] = deadline.elapsed()
    gates = capacity_gates(result.get("capacity", [])) if "capacity" in result else []
    gates.append(Gate("under 8 minutes", result["seconds"] <= 480, f"{result['seconds']:.0f} s"))
    print_table(
        ["gate", "result", "detail"], [[g.name, "PASS" if g.passed else "FAIL", g.detail] for g in gates]
    )
    result["gates"] = [g.__dict__ for g in gates]
    result["passed"] = all(g.passed for g in gates)
    out = args.out or Path(f"gpu-latency-{started_at.strftime('%Y%m%d-%H%M%S')}.json")
    write_result(out, result)
    print(
        f"gpu_latency: {'PASS' if result['passed'] else 'FAIL'} in {result['seconds']:.0f} s (result: {out})"
    )
    return EXIT_PASS if result["passed"] else EXIT_GATE_FAILED


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (CheckError, RuntimeError, ServiceCallError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(EXIT_ERROR)
