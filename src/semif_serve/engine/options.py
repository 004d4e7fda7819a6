"""How an engine runs over its weights: its memory, state cache, prefill steps, lone-row path,
threads and lanes (`EngineOptions`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from semif_serve.engine.lanes import MOST_LANES
from semif_serve.engine.lone import KEEP_STATE_TOKENS
from semif_serve.engine.memory import DeviceMemory
from semif_serve.engine.state_cache import StateCache
from semif_serve.engine.threads import ThreadPolicy

# How a lone row (no orderings) is run: "reuse" serves it from a cached state when there is one
# (and keeps a long state by its own pass: prefill, store, suffix); "plain" always runs SemIf's plain
# forward and never touches the cache (parity runs against upstream's predictions).
DirectPath = Literal["reuse", "plain"]
DIRECT_PATHS: tuple[DirectPath, ...] = ("reuse", "plain")


@dataclass(frozen=True)
class EngineOptions:
    """How an engine runs over its weights; changed with `dataclasses.replace` (`with_options`).

    `headroom_bytes` (bytes between the warm baseline and the cap; None where the device has
    no cap or splitting is off) decides when a shared batch is split across forwards.
    `cache` keeps prefilled states for reuse; `prefill_chunk_tokens` bounds one prefill
    forward (None: the whole prefix at once); `direct_path` says how lone rows run."""

    memory: DeviceMemory
    headroom_bytes: int | None = None
    cache: StateCache = field(default_factory=lambda: StateCache(0))
    prefill_chunk_tokens: int | None = None
    direct_path: DirectPath = "reuse"
    keep_state_tokens: int = KEEP_STATE_TOKENS  # a lone row's state this long is kept by its own pass
    threads: ThreadPolicy = field(default_factory=ThreadPolicy.of_machine)  # a CPU's threads per forward
    forward_lanes: int = MOST_LANES  # a CPU's packed forward split into at most this many at once

    def __post_init__(self) -> None:
        if self.direct_path not in DIRECT_PATHS:
            raise ValueError(f"direct_path must be one of {DIRECT_PATHS}")
        if self.forward_lanes < 1:
            raise ValueError("forward_lanes must be at least 1")
