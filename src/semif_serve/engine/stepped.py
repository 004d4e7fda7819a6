"""The stepped prefill: a long state prefilled one step (PREFILL_STEP_CHUNKS chunks) per engine
turn, each step's slice kept in the state cache, so the batcher runs other requests' groups
between the steps; the time spent so far is kept per prefix and reported when the state is done.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from semif_serve.engine.memory import DeviceMemory, MemoryEstimate
from semif_serve.engine.state_cache import BASE_MODEL, QUESTION, STATE, StateCache, StoredState, state_key

PREFILL_STEP_CHUNKS = 1  # prefill chunks per engine step, between which other requests run
MAX_STEPPED = 1024  # prefixes whose step timings are kept (abandoned ones are forgotten past it)

# Prefill `ids` from `start` into the cache tier `kind` under a model (the engine's chunked prefill and put).
Fill = Callable[[list[int], StoredState | None, str, Any, int], StoredState]


class SteppedPrefill:
    """Which prefixes are being prefilled in steps, their slices in the cache, and their time."""

    def __init__(
        self,
        cache: StateCache,
        estimate: MemoryEstimate,
        memory: DeviceMemory,
        chunk_tokens: int | None,
        fill: Fill,
    ) -> None:
        self.cache = cache
        self.estimate = estimate
        self.memory = memory
        self.chunk_tokens = chunk_tokens
        self.fill = fill
        self._seconds: dict[str, float] = {}  # prefixes being prefilled in steps -> seconds so far
        self._slices: set[str] = set()  # the step slices stored in the cache, by digest

    def step(self, prefix: list[int], state_tokens: int, images: Any = None, model: int = BASE_MODEL) -> bool:
        """Prefill one step of a long `prefix` under `model` into the state cache; False when what
        is left fits in one step (or the cache cannot keep a step), so the caller finishes it now."""
        if not prefix or not self.chunk_tokens or self.cache.has(prefix, model=model):
            return False
        step = self.chunk_tokens * PREFILL_STEP_CHUNKS
        whole_state = self.estimate.cache_per_token * len(prefix) + self.estimate.state_per_row
        if whole_state > self.cache.budget_bytes:
            return False  # the cache could not keep the steps: prefilled in one go
        start = self.cache.longest_prefix(prefix, model)
        done = len(start) if start is not None else 0
        if len(prefix) - done <= step:
            return False
        boundary = state_tokens if done < state_tokens else len(prefix)
        target = min(boundary, done + step)
        t0 = time.perf_counter()
        kind = STATE if target <= state_tokens else QUESTION
        stored = self.fill(prefix[:target], start, kind, images, model)
        self.memory.synchronize()
        if not self.cache.has(stored.ids, model=model):
            return False
        self.drop_slice(start, state_tokens)
        if len(self._seconds) > MAX_STEPPED:
            self._seconds.clear()  # abandoned states' counters; only their timing is lost
        key = state_key(prefix, model)
        self._seconds[key] = self._seconds.get(key, 0.0) + time.perf_counter() - t0
        self._slices.add(stored.digest)
        return True

    def take(self, prefix: list[int], model: int = BASE_MODEL) -> float | None:
        """The seconds the steps over `prefix` under `model` took (None: it was not stepped);
        forgotten now."""
        return self._seconds.pop(state_key(prefix, model), None)

    def drop_slice(self, start: StoredState | None, state_tokens: int) -> None:
        """Drop a step's slice once a longer one supersedes it (the state prefix itself stays)."""
        if start is not None and start.digest in self._slices:
            self._slices.discard(start.digest)
            if len(start) != state_tokens:
                self.cache.discard(start.ids, start.model)
