"""The same batch on a Ray cluster (`semif-serve run-batch --ray`; the optional extra
`semif-serve[ray]`).

The driver checks the files as the local run does (job.prepared), then streams the remaining
lines, read one at a time, to `LineScorer` actors in batches: one engine each, started in the
actor's `__init__` from the driver's settings (one GPU each where SEMIF_DEVICE is cuda),
answering a batch exactly as the local run answers a window (`BatchScorer` over the real app).
At most AHEAD batches run or wait on each actor and at most UNWRITTEN batches are out at once,
so neither the driver nor the object store ever holds more than the lines in flight. Results
are written in input order with the local run's writer, so both runs write the same lines.

Without an address (neither --ray-address nor RAY_ADDRESS) the job starts a Ray of its own: on
127.0.0.1 only (every process binds and dials loopback), in a fresh temporary directory, with
a token of its own, never attaching to a cluster an earlier Ray left on the machine.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import secrets
import shutil
import sys
import tempfile
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.util import find_spec
from types import ModuleType
from typing import Any, TextIO

from semif_serve.batch.files import BatchRefused
from semif_serve.batch.job import Plan
from semif_serve.batch.lines import RawLine, parse_line
from semif_serve.batch.progress import Progress, Summary
from semif_serve.batch.runner import BatchScorer, Pacing, ResultWriter
from semif_serve.service.settings import Settings

#: Set on every Ray worker of the job: nothing is downloaded there either.
OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "SEMIF_CPU_KERNELS")
AHEAD = 2  # batches on one actor at once: one running, one queued behind it
UNWRITTEN_PER_ACTOR = 4  # batches out (running, or done and waiting for an earlier one) per actor
LOOPBACK = "127.0.0.1"
MISSING = "--ray needs Ray, which is not installed here: pip install 'semif-serve[ray]'"
# Ray sockets live under its temporary directory; AF_UNIX paths stop at 107 bytes.
_LONGEST_TEMP_BASE = 40


class RayJobFailed(RuntimeError):
    """The job failed on Ray (an actor could not start or died): one line saying how."""


@dataclass(frozen=True)
class RayPlan:
    """Where and how wide: the cluster's address (None: RAY_ADDRESS, else a local cluster), the
    engines (actors), the lines handed to an actor at once, and the GPUs per actor (None: one
    where SEMIF_DEVICE is cuda, else none)."""

    address: str | None = None
    num_actors: int = 1
    batch_size: int = 64
    gpus: float | None = None

    def gpus_for(self, settings: Settings) -> float:
        """GPUs each actor asks the cluster for."""
        if self.gpus is not None:
            return self.gpus
        return 1.0 if settings.device.startswith("cuda") else 0.0

    def cluster(self) -> str | None:
        """The address to join: --ray-address, else RAY_ADDRESS, else None (a Ray of the job's own)."""
        return self.address or os.environ.get("RAY_ADDRESS") or None


@dataclass(frozen=True)
class Session:
    """How the driver joins Ray: the environment set before ray is imported (its processes
    inherit it) and ray.init's arguments."""

    env: dict[str, str]
    init: dict[str, Any] = field(default_factory=dict)


def is_loopback(address: str) -> bool:
    """Whether a Ray address (`host:port`, `ray://host:port`) names this machine's loopback."""
    host = address.removeprefix("ray://").rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def session_for(address: str | None, num_actors: int, temp_dir: str) -> Session:
    """The session for `address` (None: a Ray of the job's own in `temp_dir`).

    Ray resolves 127.0.0.1 to the machine's network address unless told that this is not a
    multi-node cluster (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, as on a laptop): set for a Ray of
    the job's own and for a loopback address. Under `uv run` Ray would ship the working
    directory and a uv environment to its workers: the job's workers use semif-serve as
    installed (RAY_ENABLE_UV_RUN_RUNTIME_ENV=0)."""
    env = {"RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    if address is None:
        env.update(
            RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN=secrets.token_hex(32),  # its own token: none read from or left in ~/.ray
        )
        init = {
            "address": "local",
            "_node_ip_address": LOOPBACK,
            "include_dashboard": False,
            "_temp_dir": temp_dir,
            "num_cpus": max(os.cpu_count() or 1, num_actors),  # each actor asks for one CPU
        }
        return Session(env, init)
    if is_loopback(address):
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        return Session(env, {"address": address, "_node_ip_address": LOOPBACK})
    return Session(env, {"address": address})


def require_ray() -> None:
    """BatchRefused (saying how to install it) unless Ray can be imported."""
    if find_spec("ray") is None:
        raise BatchRefused(MISSING)


def _temp_base() -> str:
    base = tempfile.gettempdir()
    return base if len(base) <= _LONGEST_TEMP_BASE or not os.path.isdir("/tmp") else "/tmp"


@contextmanager
def ray_session(where: RayPlan) -> Iterator[ModuleType]:
    """Ray, joined (or started) for the job and shut down after it; a Ray of the job's own is
    removed with its temporary directory."""
    temp_dir = tempfile.mkdtemp(prefix="semif-ray-", dir=_temp_base())
    session = session_for(where.cluster(), where.num_actors, temp_dir)
    saved = {name: os.environ.get(name) for name in session.env}
    os.environ.update(session.env)  # before ray is imported: it reads some of them then
    try:
        try:
            import ray
        except ImportError:
            raise BatchRefused(MISSING) from None
        offline = {name: os.environ[name] for name in OFFLINE_ENV if name in os.environ}
        try:
            ray.init(**session.init, runtime_env={"env_vars": offline}, log_to_driver=False)
        except Exception as exc:  # noqa: BLE001 - a bad address, no cluster there, no token: one line
            joined = session.init["address"]
            what = "start a Ray of its own" if joined == "local" else f"join the Ray at {joined}"
            raise BatchRefused(f"--ray: cannot {what}: {_first_line(exc)}") from None
        try:
            yield ray
        finally:
            ray.shutdown()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(temp_dir, ignore_errors=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


class LineScorer:
    """A Ray actor: the real service started once in `__init__`, a batch of lines answered per
    call (each `(number, line)` as read; one output line's dict each, in order)."""

    def __init__(self, settings: Settings, pacing: Pacing) -> None:
        from semif_serve.service.startup import Service

        self.scorer = BatchScorer(Service.start(settings))
        self.pacing = pacing
        self.loop = asyncio.new_event_loop()

    def score(self, batch: list[tuple[int, RawLine]]) -> list[dict[str, Any]]:
        """The output lines of `batch`, in its order."""
        lines = [parse_line(number, raw) for number, raw in batch]
        results: list[dict[str, Any]] = []
        self.loop.run_until_complete(self.scorer.score([lines], results.extend, self.pacing))
        return results


def batches_of(items: Iterator[tuple[int, RawLine]], size: int) -> Iterator[list[tuple[int, RawLine]]]:
    """`items` in consecutive lists of at most `size`."""
    batch: list[tuple[int, RawLine]] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def in_order(ray: ModuleType, actors: list[Any], batches: Iterator[list[Any]]) -> Iterator[list[Any]]:
    """Each batch's results, in the batches' order. A batch goes to the actor with the fewest
    running (at most AHEAD each), while fewer than UNWRITTEN_PER_ACTOR per actor are out."""
    out: deque[Any] = deque()  # refs in input order, not yet yielded
    running: dict[Any, int] = {}  # ref -> actor index, not finished
    load = [0] * len(actors)
    cap = UNWRITTEN_PER_ACTOR * len(actors)

    def hand_out() -> None:
        while len(out) < cap:
            actor = min(range(len(actors)), key=load.__getitem__)
            if load[actor] >= AHEAD:
                return
            batch = next(batches, None)
            if batch is None:
                return
            ref = actors[actor].score.remote(batch)
            out.append(ref)
            running[ref] = actor
            load[actor] += 1

    hand_out()
    while out:
        if out[0] in running:
            ready, _ = ray.wait(list(running), num_returns=1)
            for ref in ready:
                load[running.pop(ref)] -= 1
            hand_out()
            continue
        yield ray.get(out.popleft())
        hand_out()


def score_on_ray(
    settings: Settings,
    plan: Plan,
    pacing: Pacing,
    where: RayPlan,
    bar: bool | None = None,
    stream: TextIO = sys.stderr,
) -> Summary:
    """Score the plan's remaining lines on `where.num_actors` engines on Ray and write every
    result (in input order) to the output. RayJobFailed when an actor cannot start or dies."""
    if plan.lines == plan.skipped:  # a finished job run again: nothing to start
        return Progress(plan.summary(), stream, bar=False).close()
    with ray_session(where) as ray:
        remote = ray.remote(num_cpus=1, num_gpus=where.gpus_for(settings))(LineScorer)
        actors = [remote.remote(settings, pacing) for _ in range(where.num_actors)]
        progress = Progress(plan.summary(), stream, bar=bar)
        try:
            with plan.appendable_output() as out:
                writer = ResultWriter(out)
                for results in in_order(ray, actors, batches_of(plan.pending(), where.batch_size)):
                    writer(results)
                    for result in results:
                        progress(result)
        except ray.exceptions.RayError as exc:
            raise RayJobFailed(f"the job failed on Ray: {_first_line(exc)}") from exc
        finally:
            progress.close()
    return progress.summary
