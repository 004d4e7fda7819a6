"""Device memory behind one small interface: the hard cap, what is reserved, and the release policy.

`CudaMemory` is the only code that touches `torch.cuda`; the CPU tests drive the same
`ReleasePolicy` through a simulated allocator.
"""

from __future__ import annotations

import gc
import logging
import os
from typing import Protocol

from .settings import ConfigurationError

log = logging.getLogger("semif_serve.memory")

GIB = 1024**3
MIB = 1024**2


class DeviceMemory(Protocol):
    """What the engine needs to know and do about its device's memory."""

    def cap_bytes(self) -> int | None:
        """The hard cap in bytes, or None where the device has none (CPU)."""

    def reserved_bytes(self) -> int:
        """Memory currently held by the process's allocator."""

    def release(self) -> None:
        """Return cached, unused memory to the device."""

    def synchronize(self) -> None:
        """Wait for queued device work, so timings measure it."""


class CudaMemory:
    """One CUDA device with a per-process memory fraction set before the weights load."""

    def __init__(self, cap_gib: float, cuda=None) -> None:
        if cuda is None:
            import torch

            cuda = torch.cuda
        self._cuda = cuda
        self.cap_gib = cap_gib

    def apply_cap(self) -> float:
        """Turn the cap into `set_per_process_memory_fraction(cap / total)`; returns the fraction."""
        if not self.cap_gib > 0:
            raise ConfigurationError("SEMIF_VRAM_CAP_GIB must be > 0 (0 never means uncapped)")
        total = self._cuda.get_device_properties(0).total_memory
        cap = int(self.cap_gib * GIB)
        if cap > total:
            raise ConfigurationError(
                f"SEMIF_VRAM_CAP_GIB: {self.cap_gib} GiB is more than the card's "
                f"{total / GIB:.2f} GiB"
            )
        fraction = cap / total
        self._cuda.set_per_process_memory_fraction(fraction, 0)
        return fraction

    def cap_bytes(self) -> int | None:
        return int(self.cap_gib * GIB)

    def reserved_bytes(self) -> int:
        return int(self._cuda.memory_reserved(0))

    def release(self) -> None:
        self._cuda.empty_cache()

    def synchronize(self) -> None:
        self._cuda.synchronize()


class HostMemory:
    """The CPU: no cap; 'reserved' is the resident set size; the allocator keeps its own pages."""

    def cap_bytes(self) -> int | None:
        return None

    def reserved_bytes(self) -> int:
        try:
            with open("/proc/self/statm") as fh:
                return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0

    def release(self) -> None:
        return None

    def synchronize(self) -> None:
        return None


class ReleasePolicy:
    """Gives a burst's memory back: after a request that left reserved memory past baseline +
    margin, and after every failure that is not a refusal of the request."""

    def __init__(self, memory: DeviceMemory, margin_bytes: int) -> None:
        self.memory = memory
        self.margin_bytes = margin_bytes
        self.baseline_bytes: int | None = None
        self.releases = 0

    def mark_baseline(self) -> int:
        """Record reserved memory after warm-up (released first, so it is the floor)."""
        self._release()
        self.baseline_bytes = self.memory.reserved_bytes()
        return self.baseline_bytes

    def after_success(self) -> bool:
        """Release when the request left reserved memory above baseline + margin."""
        if self.baseline_bytes is None:
            return False
        if self.memory.reserved_bytes() > self.baseline_bytes + self.margin_bytes:
            self._release()
            return True
        return False

    def after_failure(self) -> None:
        """Break the failed forward's reference cycles, then release; never raises."""
        gc.collect()
        self._release()

    def _release(self) -> None:
        try:
            self.memory.release()
            self.releases += 1
        except Exception as exc:  # noqa: BLE001 - a failed release must not mask the request's error
            log.warning("memory release failed: %s", type(exc).__name__)
