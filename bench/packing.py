"""Many clients, many states (issue 50): the packed forward, and semif-serve beside vLLM.

  uv run python bench/packing.py --only limit
      In process, this CPU's limit for the work: one packed forward over 16 SemIf prompts of
      ~150-token new states (whole on two threads, and split into two lanes as the engine runs it)
      against the same 16 run one by one (packed forwards of one, and transformers' own plain
      forward), in float32 and bfloat16.

  uv run python bench/packing.py --only lanes
      In process: one packed forward of n such prompts (n = 2, 4, 8, 16) and of 2 and 8 shorter
      ones, whole on two threads against split into two lanes of one thread each
      (`engine.lanes.ForwardLanes`, its split forced), interleaved, per dtype: where the lanes'
      thresholds come from.

  uv run python bench/packing.py --only budget
      In process: one packed forward of n prompts (n = 1, 2, 4, 7, 14, 29), whole and in the
      engine's lanes, the cost per sequence and the gain over one alone, per dtype: where
      `SEMIF_MAX_FORWARD_TOKENS`' default comes from, and the engine's ceiling for many clients.

  uv run python bench/packing.py --only lev
      In process, bf16: one lev request (a chat-style release over the checkpoint) over a new
      ~150-token state, with lev's stored preamble and without it, interleaved.

  uv run python bench/packing.py --only servers [--vllm /work/peers/vllm] [--rounds 3] [--pinned]
                                 [--clients 1,16] [--gathering]
      Real servers on the peers' checkpoint (hidden 256, 8 layers, linear head dim 64, the real
      vocabulary): semif-serve at its defaults in bf16 and float32 and in bf16 with
      SEMIF_DIRECT_PATH=plain (SemIf's plain forward, no state cache), and vLLM's CPU build in bf16
      (its own venv, PEERS.md), each request a new ~150-token state and one 4-option question,
      1 client and 16 clients sending the next request as soon as the answer arrives. vLLM gets
      SemIf's own prompt ids, `allowed_token_ids` = the four codes and processed log-probabilities.
      Rounds interleave the servers, each round starting one server later; the others are stopped
      (SIGSTOP) while one is measured, and each cell follows one second of the same clients, not
      counted (the first cell after another server's reads low).
      `--pinned`: every server's threads named instead of left to its defaults: semif-serve's
      `SEMIF_TORCH_THREADS` and vLLM's `VLLM_CPU_OMP_THREADS_BIND` set to all of this machine's cores.
      `--clients`: the client counts (the gain is the most clients' over one's). `--gathering`: beside
      them semif-serve in bf16 with `SEMIF_MAX_GATHER_SECONDS=0` (no turn waits for the clients a
      forward answered), the A/B of docs/packing.md's "Gathering".

  uv run python bench/packing.py --only fairness [--seconds 40]
      The contract's promise under a flood (issue 50's case): semif-serve at its defaults in bf16
      (rows per request raised to 128), 8 clients each sending 128-row `/decide/shared` requests
      (32 decisions x 4 rotations) over a new ~3k-token state as soon as the last is answered, and
      one client sending a one-row `/decide` over a new short state every ~0.5 s: its latency
      (p50, max) beside the same request with the engine idle, and the forwards the engine ran
      while it was in flight (`semif_forwards_total`, read before it is sent and after it is
      answered: at most the one running when it arrived plus its own, give or take one that
      another client's request finished in that span).

  uv run python bench/packing.py --only siblings [--repeats 3]
      In process: one step of a request's rows (26 of ~76 tokens) over its kept state of ~2.8k and
      ~8.5k tokens, in bf16 and float32, the full-attention layers reading the state once for all
      rows (cascade attention, `engine.packed._over_shared_past`) against once per row, interleaved.

  uv run python bench/packing.py --only breakdown [--repeats 7]
      In process, bf16: where one packed forward of 16 such prompts goes (timers around its
      sequence mixers and the linear-attention kernels; the rest is the token-wise work: norms,
      projections, the MLP), and the bf16 matmul's rate over one prompt's rows and over sixteen's.

Results are printed (and written as JSON with `--out FILE`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import os
import signal
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from harness.report import log, print_table, write_result
from harness.server import ServiceProcess
from harness.stats import percentile
from harness.workloads import filler

QUESTION = "Which team should handle this ticket?"
OPTIONS = ("The billing team.", "The platform team.", "The security team.", "The support desk.")
STATE_TOKENS = 150  # about: each state's words fitted once to this many prompt tokens
CLIENTS = 16
# Each servers cell is preceded by this long a cell of the same clients, not counted: the first
# cell after another server's read 5-15% low (bench/RESULTS.md, fourteenth pass).
SETTLE_SECONDS = 1.0


def peers_checkpoint(directory: Path) -> Path:
    """The peers' checkpoint (linear head dim 64: vLLM's CPU kernel takes 64 or 128)."""
    from bench.peers import ensure_checkpoint

    return ensure_checkpoint(directory)


def codec_of(model: Path, dtype: str = "float32") -> Any:
    from semif_serve.engine.loader import load_model
    from semif_serve.service.settings import Settings
    from semif_serve.service.startup import checkpoint_spec

    spec = checkpoint_spec(Settings(model_path=model, model_revision="bench", device="cpu", dtype=dtype))
    return load_model(spec)


def state_words(codec: Any) -> int:
    """Words of filler whose SemIf prompt is about STATE_TOKENS + the question's tokens."""
    from semif_serve.domain.types import PromptRow

    row = PromptRow(QUESTION, OPTIONS)
    base = len(codec.encode_prompts("", [row], 1 << 20)[0].ids)
    words = 10
    while len(codec.encode_prompts(filler(words), [row], 1 << 20)[0].ids) - base < STATE_TOKENS:
        words += 5
    return words


# -- this CPU's limit ---------------------------------------------------------------------------


def interleaved(cells: dict[str, Any], repeats: int) -> dict[str, float]:
    """Each cell's median ms over `repeats` runs, the cells interleaved (the machine is shared and
    noisy), after one warm run each."""
    times: dict[str, list[float]] = {name: [] for name in cells}
    for fn in cells.values():
        fn()
    for _ in range(repeats):
        for name, fn in cells.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1000)
    return {name: statistics.median(ts) for name, ts in times.items()}


def sixteen_prompts(model: Path, dtype: str) -> tuple[Any, list[list[int]]]:
    """The checkpoint loaded in `dtype`, and 16 SemIf prompts' ids over new ~150-token states."""
    from semif_serve.domain.types import PromptRow

    loaded = codec_of(model, dtype)
    words = state_words(loaded.codec)
    rows = [PromptRow(QUESTION, OPTIONS)]
    prompts = [
        loaded.codec.encode_prompts(filler(words, seed=900 + i), rows, 1 << 20)[0].ids for i in range(CLIENTS)
    ]
    return loaded, prompts


def limit(model: Path, repeats: int) -> dict[str, Any]:
    """One packed forward over 16 prompts against 16 forwards, per dtype (median ms)."""

    out: dict[str, Any] = {}
    for dtype in ("float32", "bfloat16"):
        loaded, prompts = sixteen_prompts(model, dtype)
        medians = interleaved(forward_cells(loaded.model, prompts), repeats)
        out[dtype] = {
            "prompt_tokens": statistics.mean(len(p) for p in prompts),
            "ms": medians,
            "packed_gain_over_one_by_one": medians["16 packed forwards of 1"] / medians["packed 16"],
            "packed_gain_over_plain": medians["16 plain forwards"] / medians["packed 16"],
            "lanes_gain_over_one_by_one": medians["16 packed forwards of 1"] / medians["packed 16 in lanes"],
            # what the engine does for one client now: each lone prompt in lanes where that pays
            "lanes_gain_over_one_by_one_in_lanes": medians["16 forwards of 1 in lanes"]
            / medians["packed 16 in lanes"],
        }
    rows = [
        [
            d,
            f"{v['prompt_tokens']:.0f}",
            *(f"{v['ms'][k]:.0f}" for k in v["ms"]),
            f"{v['packed_gain_over_one_by_one']:.2f}x",
            f"{v['lanes_gain_over_one_by_one']:.2f}x",
            f"{v['lanes_gain_over_one_by_one_in_lanes']:.2f}x",
        ]
        for d, v in out.items()
    ]
    header = [
        "dtype",
        "tokens",
        "packed 16 (ms)",
        "in 2 lanes",
        "16 x packed 1",
        "16 x 1 in lanes",
        "16 x plain",
    ]
    print_table([*header, "gain", "gain, lanes", "gain, lanes over 1 in lanes"], rows, "limit")
    return out


def lanes(model: Path, repeats: int) -> dict[str, Any]:
    """One packed forward whole on two threads against split into two lanes of one thread each
    (the split forced), over n SemIf prompts and over shorter sequences, per dtype (median ms)."""
    import random

    import torch

    from semif_serve.engine import lanes as lanes_module
    from semif_serve.engine.packed import Segment, packed_forward

    rng = random.Random(0)
    out: dict[str, Any] = {}
    rows = []
    for dtype in ("bfloat16", "float32"):
        loaded, prompts = sixteen_prompts(model, dtype)
        shapes = [(n, prompts[:n]) for n in (1, 2, 4, 8, 16)]  # 1: a lone sequence, head and tail
        shapes += [
            (n, [[rng.randrange(1000, 50_000) for _ in range(t)] for _ in range(n)])
            for n, t in ((2, 64), (2, 128), (2, 192), (8, 32), (8, 64))
        ]
        forced = lanes_module.ForwardLanes()
        torch.set_num_threads(2)
        thresholds = ("MIN_SHARE_TOKENS", "LONE_SPLIT_TOKENS", "LONE_SPLIT_TOKENS_BF16")
        saved = {name: getattr(lanes_module, name) for name in thresholds}
        for name in thresholds:
            setattr(lanes_module, name, 0)  # measured below the engine's thresholds too
        try:
            for n, sequences in shapes:
                segments = [Segment(tuple(p), read=True) for p in sequences]
                ms = interleaved(
                    {
                        "whole": functools.partial(packed_forward, loaded.model, segments),
                        "lanes": functools.partial(forced.forward, loaded.model, segments),
                    },
                    repeats,
                )
                tokens = sum(len(p) for p in sequences) // n
                gain = ms["whole"] / ms["lanes"]
                out[f"{dtype} {n} x {tokens}"] = {
                    "whole_ms": ms["whole"],
                    "lanes_ms": ms["lanes"],
                    "gain": gain,
                }
                rows.append(
                    [dtype, str(n), str(tokens), f"{ms['whole']:.1f}", f"{ms['lanes']:.1f}", f"{gain:.2f}x"]
                )
        finally:
            for name, value in saved.items():
                setattr(lanes_module, name, value)
            forced.close()
    print_table(
        ["dtype", "sequences", "tokens each", "whole, 2 threads (ms)", "2 lanes (ms)", "gain"], rows, "lanes"
    )
    return out


def breakdown(model: Path, repeats: int) -> dict[str, Any]:
    """Per part, the median ms of one packed forward of `CLIENTS` prompts (bf16), and the bf16
    matmul's GFLOPS over one prompt's rows and over all of theirs (the MLP's gate projection)."""
    import collections

    import torch

    from semif_serve.domain.types import PromptRow
    from semif_serve.engine import causal_conv_rows, delta_rule_rows
    from semif_serve.engine.packed import Segment, _Mixers, packed_forward

    loaded = codec_of(model, "bfloat16")
    words = state_words(loaded.codec)
    row = [PromptRow(QUESTION, OPTIONS)]
    prompts = [
        loaded.codec.encode_prompts(filler(words, seed=900 + i), row, 1 << 20)[0].ids for i in range(CLIENTS)
    ]
    segments = [Segment(tuple(p), read=True) for p in prompts]
    spent: collections.defaultdict[str, float] = collections.defaultdict(float)
    parts = {  # (owner, attribute): the part its time counts in, in the order printed
        (_Mixers, "linear"): "linear-attention layers",
        (delta_rule_rows, "recurrence"): "  of which the gated delta rule",
        (causal_conv_rows, "convolve_bf16"): "  of which the convolution",
        (_Mixers, "attention"): "full-attention layers",
    }
    originals = {key: getattr(*key) for key in parts}

    def timed(inner: Any, label: str) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - started

        return run

    totals: list[float] = []
    per_part: dict[str, list[float]] = {label: [] for label in parts.values()}
    try:
        for key, label in parts.items():
            setattr(*key, timed(originals[key], label))
        for rep in range(repeats + 2):  # two to warm (the kernels load or compile)
            spent.clear()
            started = time.perf_counter()
            packed_forward(loaded.model, segments)
            if rep >= 2:
                totals.append((time.perf_counter() - started) * 1000)
                for label in per_part:
                    per_part[label].append(spent[label] * 1000)
    finally:
        for key, inner in originals.items():
            setattr(*key, inner)
    ms = {label: statistics.median(v) for label, v in per_part.items()}
    mixers = ms["linear-attention layers"] + ms["full-attention layers"]
    ms["the rest: norms, MLP, residuals"] = statistics.median(totals) - mixers
    ms["whole forward"] = statistics.median(totals)
    weight = loaded.model.get_decoder().layers[0].mlp.gate_proj.weight
    rates: dict[int, float] = {}
    with torch.inference_mode():
        for rows in (len(prompts[0]), sum(len(p) for p in prompts)):
            x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
            times = []
            for _ in range(repeats + 2):
                started = time.perf_counter()
                torch.nn.functional.linear(x, weight)
                times.append(time.perf_counter() - started)
            rates[rows] = 2 * rows * weight.shape[0] * weight.shape[1] / statistics.median(times[2:]) / 1e9
    print_table(["part", "ms"], [[label, f"{v:.1f}"] for label, v in ms.items()], "breakdown (bf16)")
    print_table(["rows", "GFLOPS"], [[r, f"{v:.0f}"] for r, v in rates.items()], "matmul (bf16)")
    return {"ms": ms, "matmul_gflops": {str(r): v for r, v in rates.items()}}


BUDGET_COUNTS = (1, 2, 4, 7, 14, 29)


def budget(model: Path, repeats: int) -> dict[str, Any]:
    """Per dtype, ms per sequence of one packed forward over n prompts, whole on this thread's
    threads and in the engine's lanes (as the engine runs it), and the gain over n = 1 in lanes."""
    from semif_serve.domain.types import PromptRow
    from semif_serve.engine.lanes import ForwardLanes
    from semif_serve.engine.packed import Segment, packed_forward

    out: dict[str, Any] = {}
    lanes = ForwardLanes()
    for dtype in ("bfloat16", "float32"):
        loaded = codec_of(model, dtype)
        words = state_words(loaded.codec)
        row = [PromptRow(QUESTION, OPTIONS)]
        prompts = [
            loaded.codec.encode_prompts(filler(words, seed=2000 + i), row, 1 << 20)[0].ids
            for i in range(max(BUDGET_COUNTS))
        ]
        ways = {"whole": packed_forward, "lanes": lanes.forward}
        times: dict[tuple[str, int], list[float]] = {(w, n): [] for w in ways for n in BUDGET_COUNTS}
        for rep in range(repeats + 1):
            for n in BUDGET_COUNTS:
                for way, forward in ways.items():
                    t0 = time.perf_counter()
                    forward(loaded.model, [Segment(tuple(p), read=True) for p in prompts[:n]])
                    if rep:  # the first pass warms
                        times[way, n].append((time.perf_counter() - t0) * 1000 / n)
        per = {key: statistics.median(v) for key, v in times.items()}
        out[dtype] = {
            str(n): {
                "ms_per_sequence": per["whole", n],
                "ms_per_sequence_in_lanes": per["lanes", n],
                "gain": per["whole", 1] / per["whole", n],
                "gain_in_lanes": per["lanes", 1] / per["lanes", n],
            }
            for n in BUDGET_COUNTS
        }
    rows = [
        [
            d,
            n,
            f"{v['ms_per_sequence']:.1f}",
            f"{v['ms_per_sequence_in_lanes']:.1f}",
            f"{v['gain']:.2f}x",
            f"{v['gain_in_lanes']:.2f}x",
        ]
        for d, cells in out.items()
        for n, v in cells.items()
    ]
    headers = ["dtype", "sequences", "ms per sequence", "in lanes", "gain over one", "in lanes"]
    print_table(headers, rows, "budget")
    return out


def forward_cells(model: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """The four ways to run `prompts`: one packed forward (whole on this thread's threads, and in
    the engine's lanes), a packed forward each, a plain one each."""
    import torch

    from semif_serve.engine.lanes import ForwardLanes
    from semif_serve.engine.packed import Segment, packed_forward

    decoder = model.get_decoder()
    lanes = ForwardLanes()

    def packed() -> None:
        packed_forward(model, [Segment(tuple(p), read=True) for p in prompts])

    def in_lanes() -> None:
        lanes.forward(model, [Segment(tuple(p), read=True) for p in prompts])

    def one_by_one() -> None:
        for p in prompts:
            packed_forward(model, [Segment(tuple(p), read=True)])

    def one_by_one_in_lanes() -> None:  # as the engine runs a lone request: split where it pays
        for p in prompts:
            lanes.forward(model, [Segment(tuple(p), read=True)])

    def plain() -> None:
        with torch.inference_mode():
            for p in prompts:
                decoder(input_ids=torch.tensor([p]), use_cache=False)

    return {
        "packed 16": packed,
        "packed 16 in lanes": in_lanes,
        "16 packed forwards of 1": one_by_one,
        "16 forwards of 1 in lanes": one_by_one_in_lanes,
        "16 plain forwards": plain,
    }


# -- lev's preamble ------------------------------------------------------------------------------


def lev_preamble(model: Path, repeats: int, work: Path) -> dict[str, Any]:
    """In process, bf16: one lev request over a new ~150-token state (a chat-style release over the
    checkpoint; a rating noul, one row computed whole, and a four-option choice, its rows over a
    kept prefix), engine time with lev's stored preamble and without it, interleaved."""
    from semif_serve.domain.lev.types import MANIFEST_FILE, LevChoice, LevNoul
    from semif_serve.engine.adapters import AdapterBank
    from semif_serve.engine.lev_release import load_lev_release
    from semif_serve.engine.runner import TorchEngine
    from semif_serve.engine.state_cache import StateCache
    from semif_serve.service.lev_core import LevEncoder, lev_answers, lev_jobs, lev_rows
    from semif_serve.tools.lev_builder import DEFAULT_BASE_NAME, write_lev_release

    loaded = codec_of(model, "bfloat16")
    words = state_words(loaded.codec)
    directory = work / "lev-release"
    if not (directory / MANIFEST_FILE).exists():
        write_lev_release(directory, model, prompt_style="chat", seed=5)
    bank = AdapterBank(loaded.model)
    release = load_lev_release(
        directory,
        bank,
        loaded.codec.tokenizer,
        name="chat",
        base_name=DEFAULT_BASE_NAME,
        base_directory=model,
    )
    cases = {
        "rating noul (1 row, whole)": {"urgent": LevNoul(criteria=None)},
        "choice of 4 (rows over a kept prefix)": {
            "team": LevChoice(dict.fromkeys(OPTIONS), instructions=QUESTION)
        },
    }
    with_preamble = LevEncoder(release.tokenizer)
    without = LevEncoder(release.tokenizer)
    without.preamble = lambda style: ()
    # Each side its own cache: a prefix lookup would otherwise find the other side's preamble.
    sides = {
        "with the preamble": (
            with_preamble,
            TorchEngine.over(loaded, bank).with_options(cache=StateCache(256 << 20)),
        ),
        "without": (without, TorchEngine.over(loaded, bank).with_options(cache=StateCache(256 << 20))),
    }
    counter = itertools.count()

    def ask(encoder: Any, engine: Any, questions: Any) -> float:
        rows = lev_rows(release, encoder, filler(words, seed=30_000 + next(counter)), questions, None)
        t0 = time.perf_counter()
        lev_answers(
            release, rows, [engine.read_prepared(job()) for job in lev_jobs(rows, engine, release.adapter)]
        )
        return (time.perf_counter() - t0) * 1000

    out: dict[str, Any] = {"preamble_tokens": len(with_preamble.preamble("chat"))}
    for name, questions in cases.items():
        times: dict[str, list[float]] = {"with the preamble": [], "without": []}
        for rep in range(repeats + 1):
            for label, (encoder, engine) in sides.items():
                ms = ask(encoder, engine, questions)
                if rep:  # the first pass warms (and keeps the preamble)
                    times[label].append(ms)
        medians = {label: statistics.median(v) for label, v in times.items()}
        out[name] = {**medians, "gain": medians["without"] / medians["with the preamble"]}
    bank.close()
    rows = [[name, *(f"{v[k]:.1f}" for k in ("with the preamble", "without")), f"{v['gain']:.2f}x"]
            for name, v in out.items() if name != "preamble_tokens"]  # fmt: skip
    print_table(["lev request, new state", "with (ms)", "without (ms)", "gain"], rows, "lev's preamble")
    return out


# -- servers --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Server:
    name: str
    url: str
    pid: int
    ask: Any  # (client, n) -> None


class VllmProcess:
    """vLLM's OpenAI server in its own venv (PEERS.md), its own process group."""

    def __init__(self, root: Path, model: Path, port: int = 8061, bind: str = "auto") -> None:
        self.root, self.model, self.port, self.bind = root, model, port, bind
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> VllmProcess:
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "4",
            "VLLM_CPU_OMP_THREADS_BIND": self.bind,
            "HF_HUB_OFFLINE": "1",
        }
        args = [
            str(self.root / ".venv/bin/python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--served-model-name", "ckpt", "--dtype", "bfloat16",
            "--max-model-len", "4096", "--logprobs-mode", "processed_logprobs",
            "--port", str(self.port), "--host", "127.0.0.1",
        ]  # fmt: skip
        self._log = open(self.root / "bench-server.log", "w")  # noqa: SIM115 - closed in __exit__
        self.process = subprocess.Popen(
            args, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited: see {self.root / 'bench-server.log'}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise RuntimeError("vLLM did not start within 600 s")

    @property
    def pid(self) -> int:
        return self.process.pid

    def __exit__(self, *exc: object) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGCONT)
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.process.pid, signal.SIGKILL)
        self._log.close()


def group_pids(pid: int) -> list[int]:
    """`pid` and its descendants (vLLM runs an engine core and a worker beside its server)."""
    out, todo = [pid], [pid]
    while todo:
        parent = todo.pop()
        for child in Path("/proc").iterdir():
            if child.name.isdigit():
                try:
                    stat = (child / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(stat[1]) == parent:
                    out.append(int(child.name))
                    todo.append(int(child.name))
    return out


def only(servers: list[Server], running: Server) -> None:
    for server in servers:
        for pid in group_pids(server.pid):
            os.kill(pid, signal.SIGCONT if server is running else signal.SIGSTOP)


def cell(server: Server, clients: int, seconds: float, counter: itertools.count) -> dict[str, float]:
    """`clients` closed-loop clients for `seconds`; requests/s, p50 and p99 latency (ms)."""
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client() -> None:
        with httpx.Client(timeout=120) as c:
            while time.monotonic() < stop:
                n = next(counter)
                t0 = time.perf_counter()
                server.ask(c, n)
                with lock:
                    latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {
        "rps": len(latencies) / wall,
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        "requests": len(latencies),
    }


def servers(
    model: Path,
    vllm_root: Path | None,
    rounds: int,
    seconds: float,
    work: Path,
    pinned: bool = False,
    clients_list: tuple[int, ...] = (1, CLIENTS),
    gathering: bool = False,
) -> dict[str, Any]:
    from semif_serve.domain.types import PromptRow
    from semif_serve.tools.demo import DEMO_REVISION

    codec = codec_of(model).codec
    words = state_words(codec)
    row = PromptRow(QUESTION, OPTIONS)
    codes = list(codec.slots[: len(OPTIONS)])

    def state(n: int) -> str:
        return filler(words, seed=10_000 + n)  # a new state every request

    def semif_ask(url: str, token: str):
        def ask(c: httpx.Client, n: int) -> None:
            body = {"id": str(n), "state": state(n), "question": QUESTION,
                    "options": [{"id": str(i), "description": d} for i, d in enumerate(OPTIONS)]}  # fmt: skip
            r = c.post(f"{url}/decide", json=body, headers={"Authorization": f"Bearer {token}"})
            r.raise_for_status()

        return ask

    def vllm_ask(url: str):
        def ask(c: httpx.Client, n: int) -> None:
            ids = codec.encode_prompts(state(n), [row], 1 << 20)[0].ids
            body = {"model": "ckpt", "prompt": ids, "max_tokens": 1, "temperature": 0,
                    "allowed_token_ids": codes, "logprobs": len(codes)}  # fmt: skip
            r = c.post(f"{url}/v1/completions", json=body)
            r.raise_for_status()
            assert len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == len(codes)

        return ask

    counter = itertools.count()
    out: dict[str, Any] = {"state_words": words, "cells": {}, "pinned": pinned, "clients": clients_list}
    # Pinned: every server on exactly this machine's cores, named (its defaults pick them itself).
    cores = os.cpu_count() or 1
    threads = {"torch_threads": cores} if pinned else {}
    with (
        contextlib.ExitStack() as optional,
        ServiceProcess(
            model, DEMO_REVISION, {"device": "cpu", "dtype": "bfloat16", **threads}, work / "semif-bf16"
        ) as bf16,
        ServiceProcess(
            model, DEMO_REVISION, {"device": "cpu", "dtype": "float32", **threads}, work / "semif-f32"
        ) as f32,
        ServiceProcess(
            model,
            DEMO_REVISION,
            {"device": "cpu", "dtype": "bfloat16", "direct_path": "plain", **threads},
            work / "semif-bf16-plain",
        ) as plain,
    ):
        running = [
            Server("semif-serve bf16", bf16.url, bf16.pid, semif_ask(bf16.url, bf16.token)),
            Server("semif-serve float32", f32.url, f32.pid, semif_ask(f32.url, f32.token)),
            Server("semif-serve bf16, plain", plain.url, plain.pid, semif_ask(plain.url, plain.token)),
        ]
        if gathering:
            settings = {"device": "cpu", "dtype": "bfloat16", "max_gather_seconds": 0, **threads}
            off = optional.enter_context(
                ServiceProcess(model, DEMO_REVISION, settings, work / "semif-bf16-no-gathering")
            )
            running.append(
                Server("semif-serve bf16, no gathering", off.url, off.pid, semif_ask(off.url, off.token))
            )
        bind = f"0-{cores - 1}" if pinned else "auto"
        vllm = VllmProcess(vllm_root, model, bind=bind) if vllm_root is not None else None
        if vllm is not None:
            log("packing: starting vLLM (3-4 minutes) ...")
            vllm.__enter__()
            running.append(Server("vLLM bf16", vllm.url, vllm.pid, vllm_ask(vllm.url)))
        try:
            # Warm each (its first forwards compile or allocate), vLLM first: round 1's first cell
            # had followed vLLM's warm-up and read low (run 46: 15.81 against 21.70 and 22.84).
            for server in running[len(running) - 1 :] + running[: len(running) - 1]:
                only(running, server)
                cell(server, CLIENTS, 2.0, counter)
            ours = [server for server in running if not server.name.startswith("vLLM")]
            for r in range(rounds):
                # vLLM last, the others one later each round: the cell right after a vLLM cell read
                # 5-15% low (runs 36-41; a settling second did not remove it), so each of ours
                # follows vLLM in one round of every len(ours), which the median drops.
                order = ours[r % len(ours) :] + ours[: r % len(ours)] + running[len(ours) :]
                for clients in clients_list:
                    for server in order:
                        only(running, server)
                        cell(server, clients, SETTLE_SECONDS, counter)  # not counted: see SETTLE_SECONDS
                        got = cell(server, clients, seconds, counter)
                        out["cells"].setdefault(f"{server.name} @{clients}", []).append(got)
                        rps = got["rps"]
                        log(f"packing: round {r + 1}: {server.name}, {clients} clients: {rps:.2f} req/s")
        finally:
            for server in running:
                for pid in group_pids(server.pid):
                    os.kill(pid, signal.SIGCONT)
            if vllm is not None:
                vllm.__exit__()
    medians: dict[str, dict[str, float]] = {}
    for name, cells in out["cells"].items():
        medians[name] = {k: statistics.median(c[k] for c in cells) for k in ("rps", "p50_ms", "p99_ms")}
    out["medians"] = medians
    print_servers(medians, clients_list)
    return out


def siblings(model: Path, repeats: int) -> dict[str, Any]:
    """A step of 26 rows over a kept state: the state's keys read once for all rows, and once per
    row (the path before, `_over_one_long_past` finding no siblings), interleaved, per dtype."""
    from semif_serve.domain.requests import RowsRequest
    from semif_serve.domain.types import PromptRow
    from semif_serve.engine import packed
    from semif_serve.engine.adapters import AdapterBank
    from semif_serve.engine.batching import Group, Part
    from semif_serve.engine.runner import TorchEngine
    from semif_serve.engine.state_cache import StateCache

    shared = packed._Mixers._over_one_long_past
    rows = [PromptRow(f"{QUESTION} ({k}) {'x ' * (k % 4)}", OPTIONS) for k in range(26)]
    out: dict[str, Any] = {}
    for dtype in ("bfloat16", "float32"):
        loaded = codec_of(model, dtype)
        engine = TorchEngine.over(loaded, AdapterBank(loaded.model)).with_options(cache=StateCache(1 << 30))
        for words in (2300, 7000):
            request = RowsRequest.of(filler(words, seed=1), rows, shared=True, max_input_tokens=32_768)
            job = engine.prepare(request).job("rows")
            engine.read(request)  # keeps the state
            group = Group(job.prefix_key, job.prefix_tokens, (Part(job, 0, len(rows)),))
            seconds: dict[str, list[float]] = {"once": [], "per row": []}
            for _ in range(repeats):
                for name in seconds:
                    packed._Mixers._over_one_long_past = shared if name == "once" else (lambda *a: [])
                    t0 = time.perf_counter()
                    engine.run_groups([group])
                    seconds[name].append(time.perf_counter() - t0)
            packed._Mixers._over_one_long_past = shared
            cell = {k: statistics.median(v) * 1000 for k, v in seconds.items()}
            cell["gain"] = cell["per row"] / cell["once"]
            out[f"{dtype}, {job.prefix_tokens}-token state"] = cell
    print_table(
        ["26 rows over a kept state", "read once ms", "per row ms", "gain"],
        [[k, f"{v['once']:.0f}", f"{v['per row']:.0f}", f"{v['gain']:.2f}x"] for k, v in out.items()],
    )
    return out


FLOOD_CLIENTS = 8
FLOOD_DECISIONS = 32  # x 4 rotations = 128 rows a request
FLOOD_STATE_TOKENS = 3000


def fairness(model: Path, seconds: float, work: Path) -> dict[str, Any]:
    """A one-row request's wait while 8 clients flood the engine with 128-row requests over new
    ~3k-token states (see the module docstring)."""
    from semif_serve.domain.types import PromptRow
    from semif_serve.tools.demo import DEMO_REVISION

    codec = codec_of(model).codec
    row = PromptRow(QUESTION, OPTIONS)
    base = len(codec.encode_prompts("", [row], 1 << 20)[0].ids)
    words = 200
    while len(codec.encode_prompts(filler(words), [row], 1 << 20)[0].ids) - base < FLOOD_STATE_TOKENS:
        words += 100
    options = [{"id": str(i), "description": d} for i, d in enumerate(OPTIONS)]
    settings = {"device": "cpu", "dtype": "bfloat16", "max_rows": FLOOD_DECISIONS * len(OPTIONS)}
    with ServiceProcess(model, DEMO_REVISION, settings, work / "fairness") as service:
        auth = {"Authorization": f"Bearer {service.token}"}
        counter = itertools.count()

        def forwards(c: httpx.Client) -> float:
            text = c.get(f"{service.url}/metrics", headers=auth).text
            line = next(x for x in text.splitlines() if x.startswith("semif_forwards_total "))
            return float(line.split()[1])

        def small(c: httpx.Client) -> tuple[float, float]:
            """One one-row request over a new short state: (seconds, forwards run meanwhile)."""
            n = next(counter)
            state = filler(40, seed=50_000 + n)
            body = {"id": f"s{n}", "state": state, "question": QUESTION, "options": options}
            before = forwards(c)
            t0 = time.perf_counter()
            c.post(f"{service.url}/decide", json=body, headers=auth).raise_for_status()
            took = time.perf_counter() - t0
            return took, forwards(c) - before

        def heavy(c: httpx.Client) -> None:
            n = next(counter)
            decisions = [
                {"id": f"q{k}", "question": f"{QUESTION} ({k})", "options": options, "orderings": "rotations"}
                for k in range(FLOOD_DECISIONS)
            ]
            body = {"state": filler(words, seed=60_000 + n), "decisions": decisions}
            c.post(f"{service.url}/decide/shared", json=body, headers=auth).raise_for_status()

        with httpx.Client(timeout=600) as c:
            for _ in range(3):  # warm
                small(c)
            idle = [small(c)[0] for _ in range(10)]
            heavy(c)
            heavy_alone = []
            for _ in range(2):
                t0 = time.perf_counter()
                heavy(c)
                heavy_alone.append(time.perf_counter() - t0)
            stop = time.monotonic() + seconds
            heavy_done = itertools.count()

            def flood() -> None:
                with httpx.Client(timeout=600) as fc:
                    while time.monotonic() < stop:
                        heavy(fc)
                        next(heavy_done)

            threads = [threading.Thread(target=flood) for _ in range(FLOOD_CLIENTS)]
            for t in threads:
                t.start()
            time.sleep(min(5.0, seconds / 4))  # the flood's first forwards are running
            waits: list[tuple[float, float]] = []
            while time.monotonic() < stop - 1:
                waits.append(small(c))
                time.sleep(0.5)
            for t in threads:
                t.join()
    took = [w[0] for w in waits]
    ran = [w[1] for w in waits]
    flood_cell = {
        "requests": len(waits),
        "p50_ms": percentile(took, 50) * 1000,
        "max_ms": max(took) * 1000,
        "forwards_p50": statistics.median(ran),
        "forwards_max": max(ran),
    }
    out = {
        "state_words": words,
        "heavy_alone_s": statistics.median(heavy_alone),
        "heavy_requests_answered": next(heavy_done),
        "small_idle_ms": statistics.median(idle) * 1000,
        "small_in_flood": flood_cell,
    }
    print_table(
        ["case", "value"],
        [
            ["one heavy request alone (128 rows, ~3k-token state)", f"{out['heavy_alone_s']:.2f} s"],
            ["the one-row request, engine idle (p50)", f"{out['small_idle_ms']:.0f} ms"],
            [
                f"the one-row request in the flood (p50 / max of {flood_cell['requests']})",
                f"{flood_cell['p50_ms']:.0f} / {flood_cell['max_ms']:.0f} ms",
            ],
            [
                "forwards run while it was in flight (p50 / max)",
                f"{flood_cell['forwards_p50']:.0f} / {flood_cell['forwards_max']:.0f}",
            ],
            ["heavy requests answered in the flood", str(out["heavy_requests_answered"])],
        ],
        "fairness",
    )
    return out


def print_servers(medians: dict[str, dict[str, float]], clients_list: tuple[int, ...] = (1, CLIENTS)) -> None:
    rows = []
    least, most = clients_list[0], clients_list[-1]
    for server in sorted({name.rsplit(" @", 1)[0] for name in medians}):
        cells = [medians[f"{server} @{n}"] for n in clients_list if f"{server} @{n}" in medians]
        if len(cells) == len(clients_list):
            gain = cells[-1]["rps"] / cells[0]["rps"]
            latency = [f"{c['p50_ms']:.0f}/{c['p99_ms']:.0f}" for c in (cells[0], cells[-1])]
            rows.append([server, *(f"{c['rps']:.2f}" for c in cells), f"{gain:.2f}x", *latency])
    headers = ["server", *(f"{n} req/s" for n in clients_list), "gain", f"p50/p99 @{least} ms", f"@{most}"]
    print_table(headers, rows, "servers (median of rounds)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only",
        choices=["limit", "lanes", "budget", "lev", "servers", "fairness", "siblings", "breakdown"],
        required=True,
    )
    parser.add_argument("--model", type=Path, default=Path("/tmp/semif-bench/peers-model"))
    parser.add_argument(
        "--vllm", type=Path, default=None, help="vLLM's venv root (PEERS.md); none: without it"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--clients", default=f"1,{CLIENTS}", help="servers: the client counts, comma-separated"
    )
    parser.add_argument(
        "--gathering", action="store_true", help="servers: also semif-serve bf16 with no gathering"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the raw results as JSON")
    parser.add_argument(
        "--pinned",
        action="store_true",
        help="servers: every server's threads named (SEMIF_TORCH_THREADS, VLLM_CPU_OMP_THREADS_BIND)",
    )
    args = parser.parse_args()
    model = peers_checkpoint(args.model)
    if args.only == "limit":
        result = limit(model, args.repeats)
    elif args.only == "lanes":
        result = lanes(model, args.repeats)
    elif args.only == "budget":
        result = budget(model, args.repeats)
    elif args.only == "lev":
        result = lev_preamble(model, args.repeats, Path("/tmp/semif-bench/packing"))
    elif args.only == "siblings":
        result = siblings(model, args.repeats)
    elif args.only == "breakdown":
        result = breakdown(model, args.repeats)
    elif args.only == "fairness":
        result = fairness(model, args.seconds, Path("/tmp/semif-bench/packing"))
    else:
        work = Path("/tmp/semif-bench/packing")
        clients = tuple(int(n) for n in args.clients.split(","))
        result = servers(
            model, args.vllm, args.rounds, args.seconds, work, args.pinned, clients, args.gathering
        )
    if args.out is not None:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
