"""The suite's resident memory, measured as it runs: each module's growth and the peak of the test
process and of the largest process it started, printed at the end of the run (issue 49 holds the
suite under 6 GiB on a CI machine)."""

from __future__ import annotations

import ctypes
import gc
import resource
from dataclasses import dataclass, field
from pathlib import Path

GIB = 1 << 30


def resident_bytes() -> int:
    """This process's resident set now (VmRSS), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def peak_bytes(who: int = resource.RUSAGE_SELF) -> int:
    """The peak resident set of this process (or of the largest child it waited for), in bytes."""
    return resource.getrusage(who).ru_maxrss * 1024


def give_back_freed_memory() -> None:
    """Collect cycles and hand glibc's freed heap pages back to the kernel, so one module's
    tensors do not stay resident under the next's."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


@dataclass
class MemoryReport:
    """Each module's resident memory at its start and end, and the run's peaks."""

    growth: dict[str, int] = field(default_factory=dict)
    module: str | None = None
    started_at: int = 0
    largest_child: tuple[int, str] = (0, "")  # the peak of a process the tests started, and whose module

    def enter(self, module: str) -> None:
        """A test of `module` is about to run: close the previous module's account on a change."""
        if module == self.module:
            return
        self.leave()
        self.module, self.started_at = module, resident_bytes()

    def leave(self) -> None:
        """The current module is done: free what it left, then count what stays."""
        if self.module is None:
            return
        give_back_freed_memory()
        self.growth[self.module] = resident_bytes() - self.started_at
        child = peak_bytes(resource.RUSAGE_CHILDREN)
        if child > self.largest_child[0]:
            self.largest_child = (child, self.module)
        self.module = None

    def peak_gib(self) -> float:
        """The larger peak: the test process's or the largest process it started."""
        return max(peak_bytes(), self.largest_child[0]) / GIB

    def lines(self, top: int = 8) -> list[str]:
        """The summary: the peaks, then the modules that left the most resident."""
        self.leave()
        child, where = self.largest_child
        out = [
            f"peak resident memory: {peak_bytes() / GIB:.2f} GiB (the test process, now "
            f"{resident_bytes() / GIB:.2f} GiB); {child / GIB:.2f} GiB (the largest process it started, "
            f"in {where or 'no module'})"
        ]
        grown = sorted(self.growth.items(), key=lambda item: -item[1])[:top]
        out += [f"  {delta / (1 << 20):+8.0f} MiB  {name}" for name, delta in grown]
        return out
