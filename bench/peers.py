"""semif-serve beside its peers, on the same checkpoint and the same work, in one run.

    PYTHONPATH=src:. python bench/peers.py                      # every peer found, ~20 min
    PYTHONPATH=src:. python bench/peers.py --only lev --rounds 1
    PYTHONPATH=src:. python bench/peers.py --only lev-release   # lev and semif-serve on one lev release
    PYTHONPATH=src:. python bench/peers.py --only lev,lev-base,lev-release --settings defaults,1

Peers are built from their public source in scratch environments outside the repository (see
bench/README.md "Peers" and ../shared/docs/PEERS.md); each is found by a flag or variable and
skipped with a line saying so when absent:

- upstream SemIf's System One server `semif_api` (--semif-api-dir, SEMIF_PEER_SEMIF_API_DIR),
  float32; semif-serve with SEMIF_SYSTEMONE_ORDERINGS=none (one reading per question);
- jev-compatible-server 0.1.1 (--jev-dir, SEMIF_PEER_JEV_DIR), float32, the causal_options
  readout; semif-serve the same as for semif_api;
- lev's own server, frozen base (--lev-dir, SEMIF_PEER_LEV_DIR), which always loads bfloat16 and
  reads choice and binary noul in two orders; semif-serve in bfloat16 with
  noul=rotations,choice=reversal,score=none (the same two orders).
- `lev-base` (issue 39): the same lev server over the frozen base, its frozen defaults spelled out
  (`--noul-readout binary --prompt-style plain --score-order-average off`), beside semif-serve's
  entry that reads the base with lev's method (SEMIF_MODELS `[models.lev-base] method = "lev"`
  with the same three keys; the requests name `lev-base`): both read lev's plain prompt (the
  short noul is 64 tokens), choice and binary noul in two orders. The `lev` peer above compares
  lev's prompt with SemIf's (145 tokens) on the same base.
- `lev-release`: lev's own server and semif-serve both serving one lev-format release (issue 26),
  written once beside the checkpoint (`<model>-lev-release/`, by `write_lev_release`: a random
  rank-32 LoRA adapter on every attention and MLP projection, adapter_scale 0.25, a candidate
  head, a calibration table). lev: `lev serve --model <ckpt> --checkpoint <release>
  --noul-readout rating --prompt-style plain --score-order-average off` (bfloat16, as lev always
  loads). With a checkpoint lev reads a noul as a rating (nine codes, one order) unless told
  `binary`, and the manifest's prompt style wins over the flag; the flags only pin lev's
  defaults, so the work cannot drift if a default changes. semif-serve: bfloat16, SEMIF_MODELS
  `[models.lev-bench] release = ...` with the same three options (`noul_readout = "rating"`,
  `prompt_style = "plain"`, `score_order_average = "off"`) and `base_model` the checkpoint (the
  manifest's base, which lev loads in place of `--model`), aliased `local`; the requests name
  `lev-bench` (lev ignores the name). Both sides then read each choice in Mode A in two orders
  (as given, reversed) and the noul as one rating row over the same prompt, calibrated by the
  release's temperatures. Where they differ, by design: lev merges the adapter into its bf16
  weights at load (`merge_and_unload`, no flag turns it off), so its forward costs the base's;
  semif-serve keeps the base unmerged and adds the adapter's term per projection (its base
  serves SemIf's method beside). lev's `load` does not read the manifest's `adapter_scale`
  (scale 1.0) where semif-serve applies it (0.25): a different factor on the same term, the
  same cost.

Workloads, one client that sends the next request as soon as the answer arrives:
(a) eight choices (3 options each) over a NEW ~1,000-token state every request;
(b) one short noul over a NEW short state every request;
(c), (d) the same two over ONE state every request of the cell, the question asked differently
each time (each side saw the state once in its warm-up; `--no-again` leaves them out).
Cells are interleaved A, B, A, B; while one server is measured the other is stopped
(SIGSTOP), so neither steals the two cores with idle work. Each setting of --settings
(default `defaults,plain,1`) is measured in the same run: `defaults` starts every server as users
run it (no OMP_NUM_THREADS or MKL_NUM_THREADS: torch's own count for the peers, semif-serve's
thread policy, engine/threads.py), `plain` the same with semif-serve's SEMIF_DIRECT_PATH=plain
(lone rows as SemIf's plain forward, no state reuse for them), a number pins every server to
that many intra-op threads (OMP_NUM_THREADS and MKL_NUM_THREADS). On this shared machine another
process usually holds a core, and a server whose torch runs two OpenMP threads then waits at
every parallel op's barrier for the descheduled one (measured: upstream's short noul at 350-900
ms a request with two threads, 130-165 ms with one, under a load of 5).
Reported: req/s, semif-serve/peer, the median request, and, since lev reads a shorter prompt,
ms per 1,000 input tokens as each server counts them.

Concurrent clients (issue 37, `lev-release` only; `--clients`, default 16, 1 turns them off):
after its two workloads, workload (b) again with 1 and with N clients, each client sending its
next request as soon as its answer arrives (asyncio, one connection each), for semif-serve on
the release, semif-serve on the base (SemIf's method, the same questions, the same process) and
lev on the release, interleaved per round, the other server stopped. Reported per side: req/s
at 1 and at N, the gain, and for semif-serve the `semif_forwards_total`,
`semif_merged_forwards_total` and `semif_forward_rows_total` that /metrics counted during the N-client
cells against the requests sent; and semif-serve / lev at N.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from bench.run import environment
from harness.report import format_table, log, write_result
from harness.server import LOOPBACK, ServiceProcess, free_port, stop_process
from harness.stats import median
from harness.workloads import filler

SYSTEMONE = "/v1/systemone"
DEFAULT_MODEL_DIR = Path(os.environ.get("SEMIF_PEERS_MODEL") or "/work/peers/ckpt")
STATE_TOKENS = 1000
MATCH_NONE = "none"
MATCH_LEV = "noul=rotations,choice=reversal,score=none"
JEV_DECISION_CONFIG = {"decision": {"readout": "causal_options", "profile": "decider"}}
BASE_MODEL = "jev-latest"  # the name the requests send to semif-serve's base
LEV_RELEASE = "lev-bench"  # the release's served name (and its manifest's name)
LEV_RELEASE_ALIAS = "local"  # the name lev's harness sends
LEV_RELEASE_RANK = 32
LEV_RELEASE_SCALE = 0.25
# lev's server flags for the release, the same on both sides (SEMIF_MODELS keys and `lev serve`).
LEV_RELEASE_OPTIONS = {"noul_readout": "rating", "prompt_style": "plain", "score_order_average": "off"}
LEV_BASE = "lev-base"  # semif-serve's entry reading the frozen base with lev's method (issue 39)
# lev's frozen-base defaults (`lev serve` without --checkpoint), pinned on both sides of `lev-base`.
LEV_BASE_OPTIONS = {"noul_readout": "binary", "prompt_style": "plain", "score_order_average": "off"}
CLIENTS = 16  # concurrent clients of the concurrency cells (issue 37)
_LEV_RELEASE_MARKER = "BENCH.json"


def peers_shape() -> Any:
    """The bench geometry of issue 29: hidden 256, 8 layers, the real vocabulary."""
    from semif_serve.tools.demo import BENCH_SHAPE

    return dataclasses.replace(BENCH_SHAPE, hidden_size=256, num_attention_heads=4)


def ensure_checkpoint(directory: Path) -> Path:
    """The checkpoint every server loads, written once by the demo writer (the bench code path)."""
    if (directory / "config.json").exists() and (directory / "DEMO.json").exists():
        return directory
    from semif_serve.tools.demo import write_checkpoint

    log(f"peers: writing the checkpoint to {directory} (once) ...")
    directory.mkdir(parents=True, exist_ok=True)
    write_checkpoint(directory, peers_shape())
    return directory


def release_directory(model: Path) -> Path:
    """Where the bench keeps its lev release: beside the checkpoint, never inside it."""
    return model.parent / f"{model.name}-lev-release"


def release_recipe(model: Path) -> dict[str, Any]:
    """What the bench's release is written from; a release written from another is rewritten."""
    from semif_serve.tools.lev_builder import DEFAULT_TARGETS

    return {
        "base": str(model),
        "name": LEV_RELEASE,
        "rank": LEV_RELEASE_RANK,
        "adapter_scale": LEV_RELEASE_SCALE,
        "target_modules": list(DEFAULT_TARGETS),
    }


def ensure_release(model: Path) -> Path:
    """The lev release both servers of `lev-release` load, written once over `model`."""
    directory = release_directory(model)
    marker = directory / _LEV_RELEASE_MARKER
    recipe = release_recipe(model)
    if marker.is_file() and json.loads(marker.read_text(encoding="utf-8")) == recipe:
        return directory
    from semif_serve.tools.lev_builder import write_lev_release

    log(f"peers: writing the lev release to {directory} (once) ...")
    shutil.rmtree(directory, ignore_errors=True)
    write_lev_release(
        directory,
        model,
        rank=recipe["rank"],
        target_modules=tuple(recipe["target_modules"]),
        adapter_scale=recipe["adapter_scale"],
        # lev loads the manifest's base in place of --model: name the checkpoint itself.
        base_name=recipe["base"],
        name=recipe["name"],
    )
    marker.write_text(json.dumps(recipe) + "\n", encoding="utf-8")
    return directory


def release_models_toml(release: Path, base_model: str) -> str:
    """semif-serve's SEMIF_MODELS file for the release: lev's flags as the entry's keys, the
    release's base vouched for (the service's own base name is its model source), `local`."""
    lines = [f"[models.{LEV_RELEASE}]", f"release = {json.dumps(str(release))}"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in LEV_RELEASE_OPTIONS.items()]
    lines += [
        f"base_model = {json.dumps(base_model)}",
        "[aliases]",
        f"{LEV_RELEASE_ALIAS} = {json.dumps(LEV_RELEASE)}",
    ]
    return "\n".join(lines) + "\n"


def release_models(model: Path) -> str:
    """The `lev-release` peer's SEMIF_MODELS text: the bench's release, written once over `model`."""
    return release_models_toml(ensure_release(model), str(model))


def lev_base_models_toml(_model: Path | None = None) -> str:
    """semif-serve's SEMIF_MODELS file for `lev-base`: the base itself read with lev's method,
    lev's frozen-base flags as the entry's keys."""
    lines = [f"[models.{LEV_BASE}]", 'method = "lev"']
    lines += [f"{key} = {json.dumps(value)}" for key, value in LEV_BASE_OPTIONS.items()]
    return "\n".join(lines) + "\n"


def lev_flags(options: Mapping[str, str]) -> list[str]:
    """`lev serve` flags for lev's server options (`noul_readout` -> `--noul-readout`)."""
    return [arg for key, value in options.items() for arg in ("--" + key.replace("_", "-"), value)]


# -- the servers ---------------------------------------------------------------------------------


class PeerProcess:
    """A peer's own server as a child process on a free loopback port, ready when `ready` says so."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        cwd: Path,
        env: Mapping[str, str],
        health: str,
        ready_status: str | None,
        work: Path,
        startup_timeout: float = 600.0,
    ) -> None:
        self.name = name
        self.argv = argv
        self.cwd = cwd
        self.env = env
        self.health = health
        self.ready_status = ready_status
        self.log_path = work / f"{name}.log"
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def __enter__(self) -> PeerProcess:
        self._log = open(self.log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed in __exit__
        self.process = subprocess.Popen(
            self.argv, cwd=self.cwd, env=dict(self.env), stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited during startup; see {self.log_path}")
            try:
                reply = httpx.get(self.url + self.health, timeout=2.0)
                if reply.status_code == 200 and (
                    self.ready_status is None or reply.json().get("status") == self.ready_status
                ):
                    return self
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} was not ready within {self.startup_timeout:.0f} s")

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)  # a stopped server cannot drain
            stop_process(self.process)
        self._log.close()


THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
DEFAULTS = "defaults"  # the --settings entry that pins nothing
# The --settings entry that runs every server at its defaults and semif-serve's lone rows as
# SemIf's plain forward (SEMIF_DIRECT_PATH=plain: no state cache for them), beside the defaults.
PLAIN = "plain"
Setting = int | str | None  # a thread count, PLAIN, or None (the defaults)


def thread_env(threads: Setting) -> dict[str, str]:
    """The intra-op thread settings every server gets, ours and the peers' alike (None or PLAIN:
    none, each server's own defaults)."""
    if not isinstance(threads, int):
        return {}
    return dict.fromkeys(THREAD_VARIABLES, str(threads))


def parse_settings(text: str) -> list[Setting]:
    """`defaults,plain,1,2` -> [None, "plain", 1, 2]."""
    items = [p.strip() for p in text.split(",") if p.strip()]
    return [None if item == DEFAULTS else item if item == PLAIN else int(item) for item in items]


def setting_name(threads: Setting) -> str:
    if threads == PLAIN:
        return "defaults, plain path"
    return DEFAULTS if threads is None else f"{threads} thread" + ("s" if int(threads) > 1 else "")


def _peer_env(extra: Mapping[str, str], threads: int | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SEMIF_", "DECISION_"))}
    for name in THREAD_VARIABLES:
        env.pop(name, None)
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.update(thread_env(threads))
    env.update(extra)
    return env


def semif_api_peer(directory: Path, model: Path, work: Path, threads: int | None) -> PeerProcess:
    """Upstream SemIf's `semif_api`, started as PEERS.md says (torch, CPU, float32)."""
    port = free_port()
    env = _peer_env(
        {
            "SEMIF_MODEL": str(model),
            "SEMIF_REVISION": "bench",
            "SEMIF_BACKEND": "torch",
            "SEMIF_DEVICE": "cpu",
            "SEMIF_DTYPE": "float32",
            "SEMIF_HOST": LOOPBACK,
            "SEMIF_PORT": str(port),
            "PYTHONPATH": "src",
        },
        threads,
    )
    peer = PeerProcess(
        "semif_api",
        [str(directory / ".venv/bin/python"), "-m", "semif_api.app"],
        directory,
        env,
        "/healthz",
        "ready",
        work,
    )
    peer.url = f"http://{LOOPBACK}:{port}"
    return peer


def jev_peer(directory: Path, model: Path, work: Path, threads: int | None) -> PeerProcess:
    """jev-compatible-server 0.1.1, transformers backend, the causal_options readout."""
    port = free_port()
    config = work / "jev-decision.json"
    config.write_text(json.dumps(JEV_DECISION_CONFIG), encoding="utf-8")
    env = _peer_env(
        {
            "DECISION_BACKEND": "transformers",
            "DECISION_MODEL_ID": str(model),
            "DECISION_CONFIG": str(config),
        },
        threads,
    )
    argv = [str(directory / ".venv/bin/python"), "-m", "uvicorn", "--factory"]
    argv += ["jev_compatible_server.app:create_app", "--host", LOOPBACK, "--port", str(port)]
    peer = PeerProcess("jev", argv, directory, env, "/health", "ok", work)
    peer.url = f"http://{LOOPBACK}:{port}"
    return peer


def _lev_serve(name: str, directory: Path, work: Path, threads: int | None, args: list[str]) -> PeerProcess:
    """`lev serve ARGS` on a free loopback port (lev always loads bfloat16)."""
    port = free_port()
    argv = [str(directory / ".venv/bin/lev"), "serve", *args, "--host", LOOPBACK, "--port", str(port)]
    peer = PeerProcess(name, argv, directory, _peer_env({}, threads), "/health", "ok", work)
    peer.url = f"http://{LOOPBACK}:{port}"
    return peer


def lev_peer(directory: Path, model: Path, work: Path, threads: int | None) -> PeerProcess:
    """lev's own server over the frozen base (`lev serve --model`), bfloat16, two orders."""
    return _lev_serve("lev", directory, work, threads, ["--model", str(model)])


def lev_base_peer(directory: Path, model: Path, work: Path, threads: int | None) -> PeerProcess:
    """lev's own server over the frozen base with its frozen defaults spelled out (`lev-base`)."""
    return _lev_serve(
        "lev-base", directory, work, threads, ["--model", str(model), *lev_flags(LEV_BASE_OPTIONS)]
    )


def lev_release_peer(directory: Path, model: Path, work: Path, threads: int | None) -> PeerProcess:
    """lev's own server over the bench's lev release (`lev serve --checkpoint`), bfloat16."""
    args = [
        "--model",
        str(model),
        "--checkpoint",
        str(release_directory(model)),
        *lev_flags(LEV_RELEASE_OPTIONS),
    ]
    return _lev_serve("lev-release", directory, work, threads, args)


@dataclasses.dataclass(frozen=True)
class Peer:
    name: str
    directory: Path | None
    marker: str  # a file the scratch environment must hold
    build: Any
    dtype: str
    orderings: str
    served: str = BASE_MODEL  # the model the requests name
    models: Any = None  # (checkpoint) -> semif-serve's SEMIF_MODELS text declaring `served`
    concurrent: bool = False  # also measure CLIENTS concurrent clients (issue 37)


def peers_from(args: argparse.Namespace) -> list[Peer]:
    return [
        Peer("semif_api", args.semif_api_dir, ".venv/bin/python", semif_api_peer, "float32", MATCH_NONE),
        Peer("jev", args.jev_dir, ".venv/bin/python", jev_peer, "float32", MATCH_NONE),
        Peer("lev", args.lev_dir, ".venv/bin/lev", lev_peer, "bfloat16", MATCH_LEV),
        # SEMIF_SYSTEMONE_ORDERINGS reaches the base only; lev's method reads lev's own orders.
        Peer(
            "lev-base",
            args.lev_dir,
            ".venv/bin/lev",
            lev_base_peer,
            "bfloat16",
            MATCH_LEV,
            LEV_BASE,
            lev_base_models_toml,
        ),
        Peer(
            "lev-release",
            args.lev_dir,
            ".venv/bin/lev",
            lev_release_peer,
            "bfloat16",
            MATCH_LEV,
            LEV_RELEASE,
            release_models,
            concurrent=True,
        ),
    ]


# -- the work ------------------------------------------------------------------------------------


def fit_state_words(model: Path, target: int) -> int:
    """Words of filler whose tokens (the checkpoint's tokenizer) come to about `target`."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    words = 700
    for _ in range(4):
        tokens = len(tokenizer.encode(filler(words)).ids)
        words = max(1, round(words * target / tokens))
    return words


# One numbering for every workload of the process: a state a server kept from an earlier peer's
# cells must not come back in the next peer's.
_STATE_SERIALS = itertools.count(1)


class Workload:
    """Request bodies: each over a state no earlier request of this process saw, or (a name
    ending `-again`) every one over the same state, the question asked differently each time."""

    def __init__(self, name: str, words: int, model: str = BASE_MODEL) -> None:
        self.name = name
        self.words = words
        self.model = model
        self.again: int | None = next(_STATE_SERIALS) if name.endswith(AGAIN) else None

    def next(self) -> dict[str, Any]:
        asked = next(_STATE_SERIALS)
        n = asked if self.again is None else self.again
        if self.name.startswith("eight"):
            state = f"Incident {n}. " + filler(self.words, seed=n)
            questions = {
                f"c{i}": {
                    "type": "choice",
                    "instructions": f"Which team owns follow-up {i} of ask {asked}?",
                    "criteria": {"platform": None, "payments": None, "search": None},
                }
                for i in range(8)
            }
        else:
            state = f"Health checks passed in zone {n % 7} after deploy {n}."
            questions = {"ok": {"type": "noul", "instructions": f"Did deployment check {asked} succeed?"}}
        return {"model": self.model, "state": state, "questions": questions}


AGAIN = "-again"
WORKLOADS = {
    "eight": "(a) 8 choices, new ~1k-token state",
    "noul": "(b) 1 short noul, new state",
    "eight-again": "(c) 8 choices, the same ~1k-token state again",
    "noul-again": "(d) 1 short noul, the same state again",
}


def measure(
    client: httpx.Client, url: str, workload: Workload, n: int, budget: float = float("inf")
) -> dict[str, Any]:
    """Up to n requests back to back (at least one, fewer once `budget` seconds are spent);
    req/s over the wall time and the mean input tokens the server reported."""
    tokens, latencies = [], []
    started = time.perf_counter()
    while len(tokens) < n and (not tokens or time.perf_counter() - started < budget):
        sent = time.perf_counter()
        reply = client.post(url + SYSTEMONE, json=workload.next())
        latencies.append(time.perf_counter() - sent)
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {reply.text[:300]}")
        tokens.append(int(reply.json()["usage"]["input_tokens"]))
    wall = time.perf_counter() - started
    done = len(tokens)
    return {
        "requests": done,
        "seconds": wall,
        "rps": done / wall,
        "input_tokens": sum(tokens) / done,
        "latencies": latencies,
    }


@contextmanager
def only_running(pid: int, others: list[int]) -> Iterator[None]:
    """Stop every other server while `pid` is measured, so idle work elsewhere costs it nothing."""
    with TakingTurns([pid, *others]) as turns:
        turns.turn(pid)
        yield


class TakingTurns:
    """Servers that take turns on the CPU: `turn(pid)` stops every other and continues `pid`, and
    nothing is continued between turns (a server continued for a moment between two others' turns
    would read their load as its own machine's, and its next forward would pick its threads from
    it); leaving the block continues them all."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids

    def turn(self, pid: int) -> None:
        """Only `pid` runs from now."""
        for other in self.pids:
            if other != pid:
                os.kill(other, signal.SIGSTOP)
        os.kill(pid, signal.SIGCONT)

    def __enter__(self) -> TakingTurns:
        return self

    def __exit__(self, *exc: object) -> None:
        for pid in self.pids:
            os.kill(pid, signal.SIGCONT)


def side_by_side(
    ours: tuple[str, str, int],
    theirs: tuple[str, int],
    words: int,
    counts: Mapping[str, int],
    rounds: int,
    budget: float,
    model: str = BASE_MODEL,
) -> dict[str, Any]:
    """For each workload, `rounds` interleaved pairs of cells (semif-serve, then the peer), every
    request naming `model`."""
    our_url, token, our_pid = ours
    peer_url, peer_pid = theirs
    out: dict[str, Any] = {}
    with (
        httpx.Client(timeout=600.0, headers={"authorization": f"Bearer {token}"}) as mine,
        httpx.Client(timeout=600.0) as peer,
    ):
        for name, n in counts.items():
            workload = Workload(name, words, model)
            cells: dict[str, list[dict[str, Any]]] = {"semif-serve": [], "peer": []}
            for client, url, pid, other in (
                (mine, our_url, our_pid, peer_pid),
                (peer, peer_url, peer_pid, our_pid),
            ):
                with only_running(pid, [other]):
                    measure(client, url, workload, 1)  # warm-up, not counted
            for r in range(rounds):
                log(f"peers:   {name} round {r + 1}/{rounds}")
                with only_running(our_pid, [peer_pid]):
                    cells["semif-serve"].append(measure(mine, our_url, workload, n, budget))
                with only_running(peer_pid, [our_pid]):
                    cells["peer"].append(measure(peer, peer_url, workload, n, budget))
                a, b = cells["semif-serve"][-1]["rps"], cells["peer"][-1]["rps"]
                log(f"peers:     semif-serve {a:.2f} req/s, peer {b:.2f} req/s ({a / b:.2f}x)")
            out[name] = summarize(cells)
    return out


def summarize(cells: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    ours, theirs = cells["semif-serve"], cells["peer"]
    ratios = [a["rps"] / b["rps"] for a, b in zip(ours, theirs, strict=True)]

    def per_k_tokens(side: list[dict[str, Any]]) -> float | None:
        # jev-compatible-server reports 0 input tokens: no per-token cost for it.
        if any(c["input_tokens"] <= 0 for c in side):
            return None
        return median([1000.0 * c["seconds"] / c["requests"] / (c["input_tokens"] / 1000.0) for c in side])

    return {
        "semif_rps": median([c["rps"] for c in ours]),
        "peer_rps": median([c["rps"] for c in theirs]),
        "ratio": median(ratios),
        "ratios": ratios,
        "semif_ms_per_request": median([1000.0 * c["seconds"] / c["requests"] for c in ours]),
        "peer_ms_per_request": median([1000.0 * c["seconds"] / c["requests"] for c in theirs]),
        # One slow request dominates a short cell's mean on a shared machine; the median does not.
        "semif_median_ms": 1000.0 * median([x for c in ours for x in c["latencies"]]),
        "peer_median_ms": 1000.0 * median([x for c in theirs for x in c["latencies"]]),
        "semif_input_tokens": median([c["input_tokens"] for c in ours]),
        "peer_input_tokens": median([c["input_tokens"] for c in theirs]),
        "semif_ms_per_1k_tokens": per_k_tokens(ours),
        "peer_ms_per_1k_tokens": per_k_tokens(theirs),
        "cells": cells,
    }


# -- concurrent clients (issue 37) ---------------------------------------------------------------


def measure_clients(
    url: str, headers: Mapping[str, str], workload: Workload, clients: int, n: int, budget: float
) -> dict[str, Any]:
    """`clients` clients, each sending its next request as soon as its answer arrives, until
    about n requests (every client stops issuing once `budget` seconds are spent); req/s over
    the wall time, as `measure` reports one client."""
    return asyncio.run(_clients(url, headers, workload, clients, n, budget))


async def _clients(
    url: str, headers: Mapping[str, str], workload: Workload, clients: int, n: int, budget: float
) -> dict[str, Any]:
    tokens: list[int] = []
    latencies: list[float] = []
    issued = 0
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600.0, headers=dict(headers), limits=limits) as http:
        started = time.perf_counter()

        async def client() -> None:
            nonlocal issued
            while issued < n and time.perf_counter() - started < budget:
                issued += 1
                sent = time.perf_counter()
                reply = await http.post(url + SYSTEMONE, json=workload.next())
                latencies.append(time.perf_counter() - sent)
                if reply.status_code != 200:
                    raise RuntimeError(f"HTTP {reply.status_code}: {reply.text[:300]}")
                tokens.append(int(reply.json()["usage"]["input_tokens"]))

        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - started
    done = len(tokens)
    return {
        "clients": clients,
        "requests": done,
        "seconds": wall,
        "rps": done / wall,
        "input_tokens": sum(tokens) / max(1, done),
        "latencies": latencies,
    }


FORWARD_COUNTERS = ("semif_forwards_total", "semif_merged_forwards_total", "semif_forward_rows_total")


def forward_counters(url: str) -> dict[str, float]:
    """semif-serve's batcher counters from /metrics (the forwards it ran, and their rows)."""
    values: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name in FORWARD_COUNTERS:
            values[name] = float(value)
    return values


def settled_counters(url: str, timeout: float = 5.0) -> dict[str, float]:
    """The counters once two reads 0.2 s apart agree: a reply may leave before its forward is counted."""
    deadline = time.monotonic() + timeout
    last = forward_counters(url)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = forward_counters(url)
        if now == last:
            return now
        last = now
    return last


def concurrent_cells(
    ours: tuple[str, str, int],
    theirs: tuple[str, int],
    clients: int,
    n: int,
    rounds: int,
    budget: float,
    model: str,
) -> dict[str, Any]:
    """Issue 37's cells on the short noul, interleaved per round, the other server stopped:
    semif-serve on `model` and on the base (SemIf's method, the same questions) with 1 and with
    `clients` concurrent clients, and the peer with 1 and `clients`; for semif-serve's
    concurrent cells, the forwards /metrics counted against the requests sent."""
    our_url, token, our_pid = ours
    peer_url, peer_pid = theirs
    mine = {"authorization": f"Bearer {token}"}
    sides = {  # cell name -> (url, headers, pid, other pid, the model the requests name)
        f"semif-serve {model}": (our_url, mine, our_pid, peer_pid, model),
        f"semif-serve {BASE_MODEL}": (our_url, mine, our_pid, peer_pid, BASE_MODEL),
        "peer": (peer_url, {}, peer_pid, our_pid, model),
    }
    cells: dict[str, dict[int, list[dict[str, Any]]]] = {name: {1: [], clients: []} for name in sides}
    for url, headers, pid, other, served in sides.values():
        with only_running(pid, [other]):
            measure_clients(url, headers, Workload("noul", 0, served), clients, clients, budget)  # warm-up
    for r in range(rounds):
        log(f"peers:   noul, {clients} concurrent clients, round {r + 1}/{rounds}")
        for name, (url, headers, pid, other, served) in sides.items():
            for count in (1, clients):
                with only_running(pid, [other]):
                    before = settled_counters(url) if pid == our_pid else {}
                    cell = measure_clients(url, headers, Workload("noul", 0, served), count, n, budget)
                    if pid == our_pid:
                        after = settled_counters(url)
                        cell["counted"] = {
                            k: after.get(k, 0.0) - before.get(k, 0.0) for k in FORWARD_COUNTERS
                        }
                cells[name][count].append(cell)
            one, many = cells[name][1][-1]["rps"], cells[name][clients][-1]["rps"]
            log(
                f"peers:     {name}: 1 client {one:.2f} req/s, {clients} clients {many:.2f}"
                f" ({many / one:.2f}x)"
            )
    return summarize_concurrent(cells, clients, model)


def summarize_concurrent(
    cells: dict[str, dict[int, list[dict[str, Any]]]], clients: int, model: str
) -> dict[str, Any]:
    """Per side: median req/s at 1 and `clients` clients and the gain per round; semif-serve's
    forwards and rows per request at `clients`; semif-serve / peer at `clients`."""
    out: dict[str, Any] = {"clients": clients, "model": model, "sides": {}, "cells": cells}
    for name, by_count in cells.items():
        ones, manys = by_count[1], by_count[clients]
        side = {
            "rps_1": median([c["rps"] for c in ones]),
            "rps_n": median([c["rps"] for c in manys]),
            "gains": [b["rps"] / a["rps"] for a, b in zip(ones, manys, strict=True)],
            "median_ms_n": 1000.0 * median([x for c in manys for x in c["latencies"]]),
        }
        side["gain"] = median(side["gains"])
        counted = [c for c in manys if "counted" in c]
        if counted:
            requests = sum(c["requests"] for c in counted)
            side["requests_n"] = requests
            side["forwards_n"] = sum(c["counted"]["semif_forwards_total"] for c in counted)
            side["merged_forwards_n"] = sum(c["counted"]["semif_merged_forwards_total"] for c in counted)
            side["rows_n"] = sum(c["counted"]["semif_forward_rows_total"] for c in counted)
        out["sides"][name] = side
    ours, theirs = cells[f"semif-serve {model}"][clients], cells["peer"][clients]
    out["ratios_n"] = [a["rps"] / b["rps"] for a, b in zip(ours, theirs, strict=True)]
    out["ratio_n"] = median(out["ratios_n"])
    return out


# -- the run -------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = ensure_checkpoint(args.model.resolve())  # the peers run in their own directories
    words = fit_state_words(model, STATE_TOKENS)
    counts = {"eight": args.requests_eight, "noul": args.requests_noul}
    counts.update({f"{name}{AGAIN}": counts[name] for name in list(counts) if args.states_again})
    results: dict[str, Any] = {
        "model": str(model),
        "rounds": args.rounds,
        "counts": counts,
        "cell_seconds": args.cell_seconds,
        "settings": [setting_name(t) for t in args.settings],
        "environment": environment(),
        "load_average_before": os.getloadavg(),
        "peers": {},
        "skipped": {},
    }
    wanted = [p for p in peers_from(args) if p.name in args.only]
    for name in THREAD_VARIABLES:  # semif-serve's process inherits this one's environment
        os.environ.pop(name, None)
    work = Path(tempfile.mkdtemp(prefix="semif-bench-peers-"))
    try:
        for threads in args.settings:
            _run_setting(args, model, words, counts, wanted, threads, work, results)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["load_average_after"] = os.getloadavg()
    return results


def _run_setting(
    args: argparse.Namespace,
    model: Path,
    words: int,
    counts: Mapping[str, int],
    wanted: list[Peer],
    threads: Setting,
    work: Path,
    results: dict[str, Any],
) -> None:
    """Every wanted peer beside semif-serve, every server under one thread setting."""
    from semif_serve.tools.demo import DEMO_REVISION

    setting = setting_name(threads)
    groups: dict[tuple[str, str, str, Any], list[Peer]] = {}
    for peer in wanted:
        if peer.directory is None or not (peer.directory / peer.marker).exists():
            line = f"{peer.name}: no scratch environment at {peer.directory} (see bench/README.md, Peers)"
            print(f"SKIPPED {line}")
            results["skipped"][peer.name] = line
            continue
        groups.setdefault((peer.dtype, peer.orderings, peer.served, peer.models), []).append(peer)
    for (dtype, orderings, served_model, models_text), group in groups.items():
        settings = {"device": "cpu", "dtype": dtype, "systemone_orderings": orderings}
        extra = thread_env(threads)
        if threads == PLAIN:
            extra["SEMIF_DIRECT_PATH"] = "plain"
        where = f"semif-{dtype}-{setting.replace(' ', '-').replace(',', '')}"
        if models_text is not None:
            models = work / f"models-{served_model}.toml"
            models.write_text(models_text(model), encoding="utf-8")
            extra["SEMIF_MODELS"] = str(models)
            where += f"-{served_model}"
        served = "" if models_text is None else f", serving {served_model}"
        log(f"peers: {setting}: semif-serve ({dtype}, orderings {orderings}{served}) ...")
        with ServiceProcess(model, DEMO_REVISION, settings, work / where, extra_env=extra) as ours:
            for peer in group:
                log(f"peers: {peer.name} ...")
                assert peer.directory is not None
                with ExitStack() as stack:
                    peer_threads = None if threads == PLAIN else threads
                    theirs = stack.enter_context(peer.build(peer.directory, model, work, peer_threads))
                    measured = side_by_side(
                        (ours.url, ours.token, ours.pid),
                        (theirs.url, theirs.pid),
                        words,
                        counts,
                        args.rounds,
                        args.cell_seconds,
                        peer.served,
                    )
                    if peer.concurrent and args.clients > 1:
                        measured["concurrent"] = concurrent_cells(
                            (ours.url, ours.token, ours.pid),
                            (theirs.url, theirs.pid),
                            args.clients,
                            args.requests_concurrent,
                            args.rounds,
                            args.cell_seconds,
                            peer.served,
                        )
                results["peers"][f"{peer.name} @ {setting}"] = {
                    "peer": peer.name,
                    "setting": setting,
                    "dtype": dtype,
                    "semif_orderings": orderings,
                    "model": peer.served,
                    **measured,
                }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def table_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = []
    for peer in results["peers"].values():
        for workload, label in WORKLOADS.items():
            if workload not in peer:
                continue
            r = peer[workload]
            rows.append(
                [
                    f"{peer['peer']} ({peer['dtype']})",
                    peer["setting"],
                    label,
                    f"{r['semif_rps']:.2f}",
                    f"{r['peer_rps']:.2f}",
                    f"{r['ratio']:.2f}x",
                    " ".join(f"{x:.2f}" for x in r["ratios"]),
                    f"{r['semif_ms_per_request']:.0f} / {r['peer_ms_per_request']:.0f}",
                    f"{r['semif_median_ms']:.0f} / {r['peer_median_ms']:.0f}",
                    f"{r['semif_input_tokens']:.0f} / {r['peer_input_tokens']:.0f}",
                    f"{_ms(r['semif_ms_per_1k_tokens'])} / {_ms(r['peer_ms_per_1k_tokens'])}",
                ]
            )
    return rows


HEADERS = [
    "peer",
    "threads",
    "workload",
    "semif-serve req/s",
    "peer req/s",
    "semif/peer",
    "per round",
    "ms/request (ours / theirs)",
    "median ms (ours / theirs)",
    "input tokens",
    "ms per 1k tokens",
]


CONCURRENT_HEADERS = [
    "peer",
    "threads",
    "server, model",
    "1 client req/s",
    "N clients req/s",
    "gain (per round)",
    "median ms at N",
    "forwards / requests at N (merged)",
    "rows / forward",
]


def concurrent_rows(results: dict[str, Any]) -> list[list[str]]:
    """One row per side of each concurrency section, then semif-serve / peer at N clients."""
    rows = []
    for peer in results["peers"].values():
        section = peer.get("concurrent")
        if not section:
            continue
        for name, side in section["sides"].items():
            label = f"{peer['peer']} ({section['model']})" if name == "peer" else name
            counted = "-"
            per_forward = "-"
            if "forwards_n" in side:
                counted = f"{side['forwards_n']:.0f} / {side['requests_n']} ({side['merged_forwards_n']:.0f})"
                per_forward = f"{side['rows_n'] / max(1.0, side['forwards_n']):.1f}"
            rows.append(
                [
                    peer["peer"],
                    peer["setting"],
                    label,
                    f"{side['rps_1']:.2f}",
                    f"{side['rps_n']:.2f}",
                    f"{side['gain']:.2f}x (" + " ".join(f"{g:.2f}" for g in side["gains"]) + ")",
                    f"{side['median_ms_n']:.0f}",
                    counted,
                    per_forward,
                ]
            )
        ratios = " ".join(f"{x:.2f}" for x in section["ratios_n"])
        rows.append(
            [
                peer["peer"],
                peer["setting"],
                f"semif-serve / peer at N={section['clients']}",
                "",
                "",
                f"{section['ratio_n']:.2f}x ({ratios})",
                "",
                "",
                "",
            ]
        )
    return rows


def markdown(results: dict[str, Any]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(results)]
    lines += [
        f"| {name} | skipped | {line} |" + " |" * (len(HEADERS) - 3)
        for name, line in results["skipped"].items()
    ]
    concurrent = concurrent_rows(results)
    if concurrent:
        lines += ["", "| " + " | ".join(CONCURRENT_HEADERS) + " |", "|" + "---|" * len(CONCURRENT_HEADERS)]
        lines += ["| " + " | ".join(row) + " |" for row in concurrent]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    env = os.environ.get
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR, help="checkpoint (built if absent)")
    parser.add_argument(
        "--semif-api-dir", type=Path, default=Path(env("SEMIF_PEER_SEMIF_API_DIR") or "/work/peers/semif")
    )
    parser.add_argument("--jev-dir", type=Path, default=Path(env("SEMIF_PEER_JEV_DIR") or "/work/peers/jev"))
    parser.add_argument("--lev-dir", type=Path, default=Path(env("SEMIF_PEER_LEV_DIR") or "/work/peers/lev"))
    parser.add_argument(
        "--only", default="semif_api,jev,lev,lev-base,lev-release", help="comma-separated peers"
    )
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per workload")
    parser.add_argument("--requests-eight", type=int, default=20, help="requests per cell, workload (a)")
    parser.add_argument("--requests-noul", type=int, default=40, help="requests per cell, workload (b)")
    parser.add_argument(
        "--clients",
        type=int,
        default=CLIENTS,
        help="concurrent clients of lev-release's concurrency cells (1: none)",
    )
    parser.add_argument(
        "--requests-concurrent", type=int, default=240, help="requests per concurrency cell (short noul)"
    )
    parser.add_argument(
        "--cell-seconds", type=float, default=10.0, help="stop a cell after this long (at least one request)"
    )
    parser.add_argument(
        "--settings",
        default="defaults,plain,1",
        help="settings, each measured in turn: defaults (nothing pinned), plain (the defaults with "
        "semif-serve's SEMIF_DIRECT_PATH=plain) or N (OMP_NUM_THREADS=N)",
    )
    parser.add_argument(
        "--no-again",
        dest="states_again",
        action="store_false",
        help="only new states (no cells over the same state asked again)",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the raw results as JSON")
    args = parser.parse_args(argv)
    args.only = [p.strip() for p in args.only.split(",") if p.strip()]
    args.settings = parse_settings(args.settings)
    wall = time.perf_counter()
    results = run(args)
    results["wall_seconds"] = time.perf_counter() - wall
    env_ = results["environment"]
    print(
        f"semif-serve vs peers: hidden 256, 8 layers, vocab 248,320; CPU ({env_['cpus']} CPUs, torch "
        f"{env_['torch']}); settings {', '.join(results['settings'])}; {args.rounds} rounds; "
        f"{results['wall_seconds']:.0f} s; load average "
        f"{results['load_average_before'][0]:.2f}/{results['load_average_after'][0]:.2f}"
    )
    print(format_table(HEADERS, table_rows(results)))
    if concurrent_rows(results):
        print(format_table(CONCURRENT_HEADERS, concurrent_rows(results)))
    for line in results["skipped"].values():
        print(f"skipped: {line}")
    print()
    print(markdown(results))
    if args.out:
        write_result(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
