"""A simulated CUDA allocator behind the real DeviceMemory interface (no GPU exists here)."""

from __future__ import annotations

import torch


class SimulatedMemory:
    """Reserved memory grows by `growth` at every device sync; `release` drops it to `floor`.

    `fail_next` makes the next sync raise the given exception, the way a CUDA OOM surfaces.
    """

    def __init__(self, floor: int = 1_000, growth: int = 0, cap: int | None = None) -> None:
        self.floor = floor
        self.reserved = floor
        self.growth = growth
        self.cap = cap
        self.releases = 0
        self.fail_next: BaseException | None = None
        self.on_release = None

    def cap_bytes(self) -> int | None:
        return self.cap

    def reserved_bytes(self) -> int:
        return self.reserved

    def release(self) -> None:
        if self.on_release:
            self.on_release()
        self.releases += 1
        self.reserved = self.floor

    def synchronize(self) -> None:
        self.reserved += self.growth
        if self.fail_next is not None:
            failure, self.fail_next = self.fail_next, None
            raise failure


def cuda_oom(message: str = "") -> BaseException:
    return torch.cuda.OutOfMemoryError(message)
