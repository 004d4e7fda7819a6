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


def own_peak_bytes() -> int:
    """This process's peak resident set so far (VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def peak_bytes(who: int = resource.RUSAGE_SELF) -> int:
    """The peak resident set of this process (or of the largest child it waited for), in bytes."""
    return resource.getrusage(who).ru_maxrss * 1024


def descendants_peak() -> tuple[int, str]:
    """The largest peak resident set (VmHWM) among this process's live descendants, and its
    command line: a child still running is seen before it is reaped."""
    import os

    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
    own, best = os.getpid(), (0, "")
    for pid in parents:
        ancestor = parents.get(pid)
        while ancestor not in (None, 0, 1, own):
            ancestor = parents.get(ancestor)
        if ancestor != own:
            continue
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                best = max(best, (int(line.split()[1]) * 1024, command[:120]))
    return best


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
    raised: dict[str, int] = field(default_factory=dict)  # tests that raised the process's peak, by how much
    peak_before: int = 0

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
        self.watch_children()
        self.module = None

    def before_test(self) -> None:
        """Note the process's peak before a test runs."""
        self.peak_before = own_peak_bytes()

    def after_test(self, test: str) -> None:
        """Note a test that raised the process's peak by more than 256 MiB."""
        raised = own_peak_bytes() - self.peak_before
        if raised > 256 << 20:
            self.raised[test] = raised

    def watch_children(self) -> None:
        """Note the largest process the tests started so far: reaped ones, then live ones."""
        child = peak_bytes(resource.RUSAGE_CHILDREN)
        if child > self.largest_child[0]:
            self.largest_child = (child, f"{self.module} (reaped)")
        live, command = descendants_peak()
        if live > self.largest_child[0]:
            self.largest_child = (live, f"{self.module}: {command}")

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
        if self.raised:
            out.append("tests that raised the test process's peak by over 256 MiB:")
            top_raised = sorted(self.raised.items(), key=lambda item: -item[1])[:top]
            out += [f"  {delta / (1 << 20):+8.0f} MiB  {name}" for name, delta in top_raised]
        return out
