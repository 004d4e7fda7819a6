"""How many CPU threads a forward uses: chosen per forward, and per matmul, from the machine and
the work.

torch's intra-op threads run every parallel op of a forward. On a CPU most ops of a small
forward cannot use two (each is too small to split: the fork and join cost more than the op),
and on a machine where another process holds a core a second OpenMP thread makes every op wait
at its barrier for the descheduled one (`bench/threads.py` measures both). Its Linear layers are
the exception: a matmul of a million multiply-adds over 8 rows already runs faster on two
threads, and they are most of a small forward's time. So the engine thread asks
`EngineThreads.use(tokens)` before each forward:
- the forward's count: one thread per `PARALLEL_TOKENS` tokens computed, never more than the
  cores other processes leave free (from /proc/stat, read every `SAMPLE_SECONDS` by a thread of
  its own, `SampledLoad`), so a long prefill on an idle machine uses every core;
- in a forward kept on fewer threads than the free cores, each Linear layer of the model of at
  least `MATMUL_ROWS` rows runs on one more thread per `MATMUL_MACS` multiply-adds it computes,
  up to the free cores, and sets the forward's count back after (`torch.set_num_threads` costs a
  few microseconds a call). `LinearHooks` does it with a pre- and a post-hook on each Linear,
  present only while such forwards run: a hooked module leaves torch's fast call path, so a
  forward that raises nothing (a long prefill already on every free core, a pinned count) runs
  with none.

Forwards run on the engine thread only (`EngineWorker.run_now` too): OpenMP keeps a team of
threads per thread that opens parallel regions, and with more of its threads than cores it stops
spinning between regions, so every parallel op of a forward waits for a sleeping thread to wake
(measured: a warm-up that raised its Linears on the main thread left a ~1k-token prefill on the
engine thread ~30% slower).

The operator pins the count with `SEMIF_TORCH_THREADS`, or with `OMP_NUM_THREADS` /
`MKL_NUM_THREADS` in the environment (the engine then never changes it, per forward or per
matmul). Inter-op threads are set once at load (`set_interop_threads`): the engine runs no
inter-op parallel work, so one. The tokenizer encodes one text per call (its Rust pool runs
only for batch encodes, which the engine never makes) and Pillow decodes an image on one
thread: neither needs a setting.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("semif_serve.engine")

# Tokens computed per forward for each intra-op thread: a forward of 384 tokens or more runs on
# two. Measured on this 2-core machine with both cores free: alone, two threads beat one at every
# size from 40 tokens (1.23x) to 2,000 (1.83x) (`bench/threads.py --only crossover`); in the
# server, whose event loop and encoder share the cores, the short noul's forwards (77 and 2 x 34
# tokens) ran faster on one (16.2 vs 14.7 req/s) and 8 choices over a ~1k state (a ~1,000-token
# prefill, 8 x ~60 suffix tokens) faster on two (1.76 vs 1.42) (`bench/peers.py`, RESULTS.md).
# Under load two lost at every size, which the free-core count below answers, not this number.
PARALLEL_TOKENS = 192
# One Linear in a forward kept on fewer threads runs on one more thread per MATMUL_MACS
# multiply-adds, when it has at least MATMUL_ROWS rows. Measured on this machine, switching the
# count there and back included (`bench/threads.py --only matmul`): 8 rows of 256 -> 512 (1M
# multiply-adds) 1.19x on two threads, 8 rows of 1,024 -> 256 (2M) 1.21x, 77 rows of 256 -> 2,048
# 1.70x; under 8 rows two threads lost at every width (4 rows of 256 -> 2,048, 2M: 0.97x), and
# under 1M multiply-adds the gain is a few microseconds at most.
MATMUL_MACS = 1_000_000
MATMUL_ROWS = 8
# How often the free cores are read again (a read costs two small /proc reads).
SAMPLE_SECONDS = 0.5
# A reading over a window this long says nothing of now: this process did not run to read sooner
# (stopped, or starved), so the estimate stays as it was (a server resumed after SIGSTOP otherwise
# counted the other server that ran meanwhile, and ran its next long prefill on one thread).
STALE_SECONDS = 4 * SAMPLE_SECONDS
# A core counts as free when others use less than this much of it over the last sample.
BUSY_CORE = 0.25
PIN_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def pinned_threads(setting: int | None, environ: Mapping[str, str] = os.environ) -> int | None:
    """The operator's pin: `SEMIF_TORCH_THREADS` (`setting`), else a positive `OMP_NUM_THREADS`
    or `MKL_NUM_THREADS`; None when nothing pins the count."""
    if setting is not None:
        return setting
    for name in PIN_VARIABLES:
        value = environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


class OtherLoad:
    """The cores other processes keep busy, from /proc/stat less this process's own CPU time
    (/proc/self/stat), over the interval since the last reading (kept as it was when that
    interval is longer than `STALE_SECONDS`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._last: tuple[float, int, int] | None = None
        self._busy = 0.0
        self._ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def busy_cores(self) -> float:
        """Cores others used since the previous call (0.0 the first time, or off Linux)."""
        reading = self._read()
        if reading is None:
            return 0.0
        if self._last is not None:
            elapsed = reading[0] - self._last[0]
            wall = elapsed * self._ticks
            if 0 < elapsed <= STALE_SECONDS:
                others = (reading[1] - self._last[1]) - (reading[2] - self._last[2])
                self._busy = max(0.0, others / wall)
        self._last = reading
        return self._busy

    def _read(self) -> tuple[float, int, int] | None:
        try:
            with open("/proc/stat", encoding="ascii") as stat:
                fields = stat.readline().split()[1:]
            with open("/proc/self/stat", encoding="ascii") as own:
                mine = own.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        # user nice system idle iowait irq softirq steal: busy is all but idle and iowait.
        values = [int(v) for v in fields[:8]]
        busy = sum(values) - values[3] - values[4]
        return self.clock(), busy, int(mine[11]) + int(mine[12])  # utime + stime


class SampledLoad:
    """An `OtherLoad` read every `SAMPLE_SECONDS` by a daemon thread of its own: a forward reads
    the last window's estimate (no /proc read on its path), however long the engine was idle."""

    def __init__(self, load: OtherLoad | None = None, period: float = SAMPLE_SECONDS) -> None:
        self.load = load if load is not None else OtherLoad()
        self.period = period
        self._busy = self.load.busy_cores()
        self._thread = threading.Thread(target=self._sample, name="semif-load", daemon=True)
        self._thread.start()

    def busy_cores(self) -> float:
        """Cores others kept busy over the last sampled window."""
        return self._busy

    def _sample(self) -> None:
        while True:
            time.sleep(self.period)
            self._busy = self.load.busy_cores()


_SAMPLED: SampledLoad | None = None
_SAMPLED_LOCK = threading.Lock()


def sampled_load() -> SampledLoad:
    """The process's one `SampledLoad` (started on the first call: a pinned engine never starts it)."""
    global _SAMPLED
    with _SAMPLED_LOCK:
        if _SAMPLED is None:
            _SAMPLED = SampledLoad()
        return _SAMPLED


@dataclass(frozen=True)
class ThreadPolicy:
    """The intra-op thread count for a forward and for each Linear in it: `pinned` where the
    operator pinned it, else one per `parallel_tokens` tokens computed (a Linear: one more per
    `matmul_macs` multiply-adds), at most the cores others leave free."""

    cores: int
    pinned: int | None = None
    parallel_tokens: int = PARALLEL_TOKENS
    matmul_macs: int = MATMUL_MACS
    matmul_rows: int = MATMUL_ROWS

    @classmethod
    def of_machine(cls, setting: int | None = None) -> ThreadPolicy:
        """The policy for this machine under the operator's pin (`SEMIF_TORCH_THREADS`)."""
        return cls(usable_cores(), pinned_threads(setting))

    def free(self, others_busy: float = 0.0) -> int:
        """The cores left to this process while others keep `others_busy` cores busy (at least one)."""
        held = max(0, math.ceil(others_busy - BUSY_CORE))  # cores others hold, a sliver of one not counted
        return max(1, self.cores - held)

    def wanted(self, tokens: int, others_busy: float = 0.0) -> int:
        """Threads for a forward computing `tokens` tokens while others keep `others_busy` cores busy."""
        if self.pinned is not None:
            return self.pinned
        return min(max(1, tokens // self.parallel_tokens), self.free(others_busy))

    def matmul(self, rows: int, macs: int, forward: int, free: int) -> int:
        """Threads for one Linear of `rows` rows and `macs` multiply-adds inside a forward on
        `forward` threads with `free` cores left (never fewer than the forward's, never more than
        the free cores)."""
        if self.pinned is not None:
            return self.pinned
        if rows < self.matmul_rows:
            return forward
        return max(forward, min(1 + macs // self.matmul_macs, free))


@dataclass
class _Forward:
    """The forward running on this thread: its count, the Linear's count while one runs."""

    policy: ThreadPolicy
    torch: Any
    threads: int
    free: int
    raised: bool = False


# The forward each engine thread runs now (set by `EngineThreads.use`; none on other threads).
_RUNNING = threading.local()


class EngineThreads:
    """Applies a `ThreadPolicy` on the thread that runs the forwards (torch's count is per
    process; only the engine thread calls `use`)."""

    def __init__(
        self,
        policy: ThreadPolicy,
        torch: Any,
        load: OtherLoad | SampledLoad | None = None,
        linears: LinearHooks | None = None,
    ) -> None:
        self.policy = policy
        self.torch = torch
        self.load = load  # None: the process's `sampled_load()`, started by the first adaptive forward
        self.linears = linears  # None: no Linear is raised
        self.switches = 0

    def use(self, tokens: int) -> int:
        """Set the intra-op threads of the calling thread for a forward computing `tokens`
        tokens (a pinned count once per thread), and what its Linear layers may raise it to;
        the count set."""
        if self.policy.pinned is not None:
            _RUNNING.forward = None
            if self.linears is not None:
                self.linears.hooked(False)
            if self.torch.get_num_threads() != self.policy.pinned:
                self._set(self.policy.pinned)
            return self.policy.pinned
        if self.load is None:
            self.load = sampled_load()
        others = self.load.busy_cores()
        wanted = self.policy.wanted(tokens, others)
        free = self.policy.free(others)
        # OpenMP's count is the calling thread's own: read it here, not from another thread.
        if wanted != self.torch.get_num_threads():
            self._set(wanted)
        raising = free > wanted and self.linears is not None
        _RUNNING.forward = _Forward(self.policy, self.torch, wanted, free) if raising else None
        if self.linears is not None:
            self.linears.hooked(raising)
        return wanted

    def _set(self, count: int) -> None:
        self.torch.set_num_threads(count)
        self.switches += 1


class LinearHooks:
    """The per-Linear raise of one model: a pre- and a post-hook on each of its Linear layers (the
    output head aside: the engine reads its columns itself), present only while `hooked(True)`;
    one per model (`of`), switched only from the engine thread, before a forward."""

    def __init__(self, model: Any) -> None:
        import torch

        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
        self._handles: list[Any] = []

    @classmethod
    def of(cls, model: Any) -> LinearHooks:
        """The model's one `LinearHooks` (engines over the same weights share it)."""
        hooks: LinearHooks | None = getattr(model, "__semif_linear_hooks__", None)
        if hooks is None:
            hooks = cls(model)
            model.__semif_linear_hooks__ = hooks
        return hooks

    @property
    def on(self) -> bool:
        return bool(self._handles)

    def hooked(self, on: bool) -> None:
        """Install the hooks (on) or remove them (off); nothing when they already are so."""
        if on and not self._handles:
            for linear in self.linears:
                self._handles.append(linear.register_forward_pre_hook(_matmul_entered))
                self._handles.append(linear.register_forward_hook(_matmul_left, always_call=True))
        elif not on and self._handles:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()


def _matmul_entered(module: Any, args: tuple[Any, ...]) -> None:
    forward: _Forward | None = getattr(_RUNNING, "forward", None)
    if forward is None or not args:
        return
    rows = args[0].numel() // max(1, module.in_features)
    macs = rows * module.in_features * module.out_features
    count = forward.policy.matmul(rows, macs, forward.threads, forward.free)
    if count != forward.threads:
        forward.torch.set_num_threads(count)
        forward.raised = True


def _matmul_left(_module: Any, _args: tuple[Any, ...], _output: Any) -> None:
    forward: _Forward | None = getattr(_RUNNING, "forward", None)
    if forward is not None and forward.raised:
        forward.torch.set_num_threads(forward.threads)
        forward.raised = False


def set_interop_threads(torch: Any, count: int = 1) -> None:
    """Inter-op threads, once per process before any inter-op work (torch refuses a second call;
    a process that loads a second model keeps the first setting)."""
    try:
        torch.set_num_interop_threads(count)
    except RuntimeError:
        log.debug("inter-op threads already set (%d)", torch.get_num_interop_threads())
