"""How many CPU threads a forward uses: chosen per forward from the machine and the work.

torch's intra-op threads run every parallel op of a forward. The engine thread asks
`EngineThreads.use(tokens)` before each forward: one thread per `PARALLEL_TOKENS` tokens
computed, never more than the cores other processes leave free (from /proc/stat, read every
`SAMPLE_SECONDS` by a thread of its own, `SampledLoad`; a core others keep busy more than
`BUSY_CORE` of the time is theirs). On free cores two threads beat one at
every forward size measured here, from 8 tokens (`bench/threads.py --only crossover`); on a
machine where another process holds a core a second OpenMP thread makes every op wait at its
barrier for the descheduled one, so a forward then runs on the cores left.

Forwards run on the engine thread only (`EngineWorker.run_now` too), but for a forward split into
lanes (`engine.lanes`), whose other lanes run on threads that never open a team (one intra-op
thread each). OpenMP keeps a team of
threads for each thread that opens parallel regions, and with more of its threads than cores it
stops spinning between regions: every parallel op of a forward then waits for a sleeping thread
to wake. Measured: a warm-up forward on the main thread left the engine thread's ~1k-token
prefill ~30% slower and a short forward slower on two threads than on one (which is why an
earlier policy kept forwards under 384 tokens on one thread).

The operator pins the count with `SEMIF_TORCH_THREADS`, or with `OMP_NUM_THREADS` /
`MKL_NUM_THREADS` in the environment (the engine then never changes it). Inter-op threads are set
once at load (`set_interop_threads`): the engine runs no inter-op parallel work, so one. The
tokenizer encodes one text per call (its Rust pool runs only for batch encodes, which the engine
never makes) and Pillow decodes an image on one thread: neither needs a setting.
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

# Tokens computed per forward for each intra-op thread: a forward of 16 tokens or more runs on two.
# Measured on this 2-core machine with both cores free and one OpenMP team in the process: two
# threads beat one at every size, 8 tokens 1.13x, 40 1.27x, 300 1.61x, 2,000 1.86x
# (`bench/threads.py --only crossover`); in the server the short noul's forwards (77 and 2 x 34
# tokens) ran ~1.3x faster on two (`--only servers`). Only a second thread is measured here: a
# larger machine re-measures its crossover with the same command.
PARALLEL_TOKENS = 8
# How often the free cores are read again (a read costs two small /proc reads).
SAMPLE_SECONDS = 0.5
# A reading over a window this long says nothing of now: this process did not run to read sooner
# (stopped, or starved), so the estimate stays as it was (a server resumed after SIGSTOP otherwise
# counted the other server that ran meanwhile, and ran its next long prefill on one thread).
STALE_SECONDS = 4 * SAMPLE_SECONDS
# A core counts as held when others keep it busy more than this share of the last sample. Measured
# with a process busy part of each 20 ms (`bench/threads.py --only contention`): with others read at
# up to 0.40 of a core, two threads were level with one at 40 tokens and ahead from 116 (1.08-1.22x);
# from 0.56, one thread was ahead up to 116 tokens (1.1-1.2x) and level at 1,100.
BUSY_CORE = 0.45
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
    """The intra-op thread count for a forward: `pinned` where the operator pinned it, else one
    per `parallel_tokens` tokens computed, at most the cores others leave free."""

    cores: int
    pinned: int | None = None
    parallel_tokens: int = PARALLEL_TOKENS

    @classmethod
    def of_machine(cls, setting: int | None = None) -> ThreadPolicy:
        """The policy for this machine under the operator's pin (`SEMIF_TORCH_THREADS`)."""
        return cls(usable_cores(), pinned_threads(setting))

    def wanted(self, tokens: int, others_busy: float = 0.0) -> int:
        """Threads for a forward computing `tokens` tokens while others keep `others_busy` cores busy."""
        if self.pinned is not None:
            return self.pinned
        by_work = max(1, tokens // self.parallel_tokens)
        held = max(0, math.ceil(others_busy - BUSY_CORE))  # cores others hold, a sliver of one not counted
        return max(1, min(by_work, self.cores - held))


class EngineThreads:
    """Applies a `ThreadPolicy` on the thread that runs the forwards (torch's count is per
    process; only the engine thread calls `use`)."""

    def __init__(self, policy: ThreadPolicy, torch: Any, load: OtherLoad | SampledLoad | None = None) -> None:
        self.policy = policy
        self.torch = torch
        self.load = load  # None: the process's `sampled_load()`, started by the first adaptive forward
        self.switches = 0

    def use(self, tokens: int) -> int:
        """Set the intra-op threads of the calling thread for a forward computing `tokens`
        tokens (a pinned count once per thread); the count set."""
        if self.policy.pinned is not None:
            if self.torch.get_num_threads() != self.policy.pinned:
                self._set(self.policy.pinned)
            return self.policy.pinned
        if self.load is None:
            self.load = sampled_load()
        wanted = self.policy.wanted(tokens, self.load.busy_cores())
        # OpenMP's count is the calling thread's own: read it here, not from another thread.
        if wanted != self.torch.get_num_threads():
            self._set(wanted)
        return wanted

    def _set(self, count: int) -> None:
        self.torch.set_num_threads(count)
        self.switches += 1


def set_interop_threads(torch: Any, count: int = 1) -> None:
    """Inter-op threads, once per process before any inter-op work (torch refuses a second call;
    a process that loads a second model keeps the first setting)."""
    try:
        torch.set_num_interop_threads(count)
    except RuntimeError:
        log.debug("inter-op threads already set (%d)", torch.get_num_interop_threads())
