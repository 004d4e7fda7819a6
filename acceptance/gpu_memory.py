"""The memory behaviour on one GPU, without the weights, in under 8 minutes.

    uv run python -m acceptance.gpu_memory [--out RESULT.json]

On a random-weight checkpoint of Qwen3.5-4B's text geometry in BF16 (built on the GPU), served
by the real service in this process under the 12 GiB cap, it measures reserved memory:

- at rest, after warm-up (the baseline the release policy returns to);
- after a large /decide/shared request (a burst must be given back: <= baseline + margin);
- after an out-of-memory, forced by lowering the cap to baseline + 256 MiB for one request
  (503 out_of_memory, then back to the baseline, and the next request is answered);

and the capacity table (the largest /decide/shared row count at ~140, ~520, ~1,960 and ~3,900
prefix tokens; the spec measured 63/51/26/16), shared with `gpu_latency`.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from semif_serve.domain.numerics import GIB, MIB

from .common import (
    EXIT_GATE_FAILED,
    EXIT_PASS,
    Client,
    Gate,
    ServiceCallError,
    log,
    print_table,
    write_result,
)
from .gpu_latency import (
    CAPACITY_PREFIX_TOKENS,
    REVISION,
    Deadline,
    capacity_decisions,
    capacity_gates,
    disable_splitting,
    gpu_environment,
    measure_capacity,
    print_capacity,
    service_settings,
    write_random_checkpoint,
)
from .server import LoopbackServer
from .workloads import filler, fit_words, prefix_tokens_probe

LARGE_REQUEST = (1960, 24)  # (prefix tokens, rows): a burst well past the release margin


def reserved_gib() -> float:
    import torch

    torch.cuda.synchronize()
    return torch.cuda.memory_reserved(0) / GIB


def measure_memory(client: Client, service) -> dict[str, Any]:
    """Reserved memory at rest, after a large request and after a forced out-of-memory."""
    import torch

    policy = service.worker.policy
    margin_gib = policy.margin_bytes / GIB
    out: dict[str, Any] = {"baseline_gib": policy.baseline_bytes / GIB, "at_rest_gib": reserved_gib()}
    words, prefix = fit_words(prefix_tokens_probe(client, seed=LARGE_REQUEST[0]), LARGE_REQUEST[0])
    state = filler(words, seed=LARGE_REQUEST[0])
    client.decide_shared(state, capacity_decisions(LARGE_REQUEST[1]))
    out["large_request"] = {"prefix_tokens": prefix, "rows": LARGE_REQUEST[1]}
    out["after_large_gib"] = reserved_gib()
    total = torch.cuda.get_device_properties(0).total_memory
    tiny = policy.baseline_bytes + 256 * MIB
    restore = disable_splitting(service)
    torch.cuda.set_per_process_memory_fraction(tiny / total, 0)
    try:
        client.decide_shared(state, capacity_decisions(LARGE_REQUEST[1]))
        out["forced_oom"] = "answered (the request fitted in baseline + 256 MiB)"
    except ServiceCallError as exc:
        out["forced_oom"] = f"{exc.status} {exc.code}"
    finally:
        torch.cuda.set_per_process_memory_fraction(service.settings.vram_cap_gib * GIB / total, 0)
        restore()
    out["after_oom_gib"] = reserved_gib()
    reply, _ = client.decide_shared(state, capacity_decisions(2))
    out["next_request"] = "answered" if len(reply["results"]) == 2 else "wrong"
    out["margin_gib"] = margin_gib
    return out


def memory_gates(m: dict[str, Any]) -> list[Gate]:
    ceiling = m["baseline_gib"] + m["margin_gib"]
    return [
        Gate("burst given back", m["after_large_gib"] <= ceiling, f"{m['after_large_gib']:.2f} GiB"),
        Gate("forced OOM is 503", m["forced_oom"] == "503 out_of_memory", m["forced_oom"]),
        Gate("back to baseline after OOM", m["after_oom_gib"] <= ceiling, f"{m['after_oom_gib']:.2f} GiB"),
        Gate("next request answered", m["next_request"] == "answered", m["next_request"]),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m acceptance.gpu_memory", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--deadline", type=float, default=450.0, help="time box in seconds")
    parser.add_argument("--skip-capacity", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("gpu-memory.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    deadline = Deadline(args.deadline)
    result: dict[str, Any] = {"environment": gpu_environment(None)}
    work = Path(tempfile.mkdtemp(prefix="semif-gpu-memory-"))
    try:
        from semif_serve.app import create_app
        from semif_serve.service.settings import load_settings
        from semif_serve.service.startup import Service
        from semif_serve.tools.demo import QWEN35_4B_SHAPE

        model_dir = write_random_checkpoint(work / "model", QWEN35_4B_SHAPE, device="cuda")
        token = "gpu-" + secrets.token_urlsafe(24)
        settings = load_settings(
            model_path=model_dir, model_revision=REVISION, api_token=token, **service_settings()
        )
        started = time.monotonic()
        service = Service.start(settings)
        result["startup_seconds"] = time.monotonic() - started
        try:
            with (
                LoopbackServer(create_app(service)) as server,
                Client(server.url, token, timeout=300) as client,
            ):
                result["memory"] = measure_memory(client, service)
                m = result["memory"]
                print_table(
                    ["state", "reserved GiB"],
                    [
                        ["at rest (baseline)", f"{m['at_rest_gib']:.2f}"],
                        [
                            f"after {LARGE_REQUEST[1]} rows at ~{LARGE_REQUEST[0]} tok",
                            f"{m['after_large_gib']:.2f}",
                        ],
                        [f"after forced OOM ({m['forced_oom']})", f"{m['after_oom_gib']:.2f}"],
                    ],
                    title="memory",
                )
                if not args.skip_capacity:
                    result["capacity"] = measure_capacity(client, service, deadline, CAPACITY_PREFIX_TOKENS)
                    print_capacity(result["capacity"], service.settings.vram_cap_gib)
        finally:
            service.worker.shutdown()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["seconds"] = deadline.elapsed()
    gates = memory_gates(result["memory"]) + capacity_gates(result.get("capacity", []))
    gates.append(Gate("under 8 minutes", result["seconds"] <= 480, f"{result['seconds']:.0f} s"))
    print_table(
        ["gate", "result", "detail"], [[g.name, "PASS" if g.passed else "FAIL", g.detail] for g in gates]
    )
    result["gates"] = [g.__dict__ for g in gates]
    result["passed"] = all(g.passed for g in gates)
    write_result(args.out, result)
    log(f"gpu_memory: {'PASS' if result['passed'] else 'FAIL'} in {result['seconds']:.0f} s")
    return EXIT_PASS if result["passed"] else EXIT_GATE_FAILED


if __name__ == "__main__":
    raise SystemExit(main())
