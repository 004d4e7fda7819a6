"""One status snapshot, built in one function, read by both /health and the metrics collector."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from semif_serve.engine.batching import BatchStats, Bounds
from semif_serve.engine.forward_shapes import Histogram
from semif_serve.engine.state_cache import CacheStats
from semif_serve.service.startup import Service


class QueueState(Protocol):
    """What the snapshot reads of the HTTP admission layer (which sits above this one)."""

    @property
    def draining(self) -> bool: ...
    @property
    def in_progress(self) -> int: ...
    @property
    def reading_bodies(self) -> int: ...
    @property
    def refused(self) -> int: ...


@dataclass(frozen=True)
class StatusSnapshot:
    """The live state of a running process at one moment."""

    ready: bool
    draining: bool
    in_progress: int
    reading_bodies: int
    engine_pending: int
    busy_rejections: int
    out_of_memory_events: int
    reserved_bytes: int
    baseline_bytes: int | None
    releases: int
    bounds: Bounds
    prefill_chunk_tokens: int | None
    batches: BatchStats
    cache: CacheStats
    shapes: dict[str, Histogram] = field(
        default_factory=dict
    )  # each forward's rows, requests, sequences, padding
    cap_bytes: int | None = None  # the device's hard memory cap (None: none, the CPU)
    release_margin_bytes: int = 0  # reserved memory above baseline that triggers a release

    @property
    def status(self) -> str:
        """`ok`, `starting` or `draining`, as /health reports it."""
        if self.draining:
            return "draining"
        return "ok" if self.ready else "starting"


def take_snapshot(service: Service, admission: QueueState | None) -> StatusSnapshot:
    """Read the queue, drain state, worker and memory once."""
    policy = service.worker.policy
    draining = bool(admission and admission.draining)
    return StatusSnapshot(
        ready=service.ready and not draining,
        draining=draining,
        in_progress=admission.in_progress if admission else 0,
        reading_bodies=admission.reading_bodies if admission else 0,
        engine_pending=service.worker.pending,
        busy_rejections=admission.refused if admission else 0,
        out_of_memory_events=service.worker.out_of_memory_events,
        reserved_bytes=policy.memory.reserved_bytes(),
        baseline_bytes=policy.baseline_bytes,
        releases=policy.releases,
        bounds=service.worker.batcher.bounds,
        prefill_chunk_tokens=service.engine.prefill_chunk_tokens,
        batches=service.worker.batcher.stats(),
        cache=service.engine.cache.stats(),
        shapes=service.engine.groups.shapes.snapshot(),
        cap_bytes=policy.memory.cap_bytes(),
        release_margin_bytes=policy.margin_bytes,
    )
