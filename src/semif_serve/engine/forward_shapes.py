"""What each forward carried, as histograms: rows, requests and sequences per forward, the
share of its computed tokens that was padding, and the lanes it ran in (the `/metrics` histograms
of docs/packing.md)."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

COUNT_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)  # rows, requests, sequences, lanes
SHARE_BUCKETS = (0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0)  # the padding share
SHAPES = ("rows", "requests", "sequences", "padding_share", "lanes")


@dataclass
class Histogram:
    """Cumulative-ready bucket counts and a sum (Prometheus' shape), for one quantity."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    observations: int = 0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.buckets) + 1)  # the last: above every bucket

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.observations += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound, observations at or under it), `+Inf` last."""
        bounds = [*(repr(b) for b in self.buckets), "+Inf"]
        running, out = 0, []
        for bound, count in zip(bounds, self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out


class ForwardShapes:
    """Every forward's shape, observed on the engine thread, read from any (a copy)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._histograms = {
            name: Histogram(SHARE_BUCKETS if name == "padding_share" else COUNT_BUCKETS) for name in SHAPES
        }

    def observe(
        self, rows: int, requests: int, sequences: int, tokens: int, padded_tokens: int, lanes: int = 1
    ) -> None:
        """One forward: its rows, requests, sequences, the tokens it computed with and without
        padding, and the lanes its shares ran in at once (`engine.lanes`)."""
        share = 1 - tokens / padded_tokens if padded_tokens else 0.0
        with self._lock:
            for name, value in zip(SHAPES, (rows, requests, sequences, share, lanes), strict=True):
                self._histograms[name].observe(value)

    def snapshot(self) -> dict[str, Histogram]:
        """A copy of each histogram, by name."""
        with self._lock:
            return {
                name: Histogram(h.buckets, list(h.counts), h.total, h.observations)
                for name, h in self._histograms.items()
            }
