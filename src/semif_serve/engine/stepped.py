"""The stepped prefill: a long state prefilled one step (PREFILL_STEP_CHUNKS chunks) per engine
turn, each step's slice kept in the state cache, so the batcher runs other requests' groups
between the steps; the time spent so far is kept per prefix and reported when the state is done.

Progress is guaranteed (docs/state-cache.md, "Prefills in progress"): a prefix starts its steps
only when its whole state fits the cache beside the whole states of the prefixes already in
progress (it waits its turn otherwise), and the slice of a prefill in progress is pinned, so no
other prefill's step evicts it. A prefix whose requests are gone stops holding its place once
another request has taken two turns without it (the batcher gives every live round one turn
between any request's two).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from semif_serve.domain.requests import BASE
from semif_serve.engine.memory import DeviceMemory, MemoryEstimate
from semif_serve.engine.state_cache import QUESTION, STATE, StateCache, StoredState, state_key

PREFILL_STEP_CHUNKS = 1  # prefill chunks per engine step, between which other requests run
MAX_STEPPED = 1024  # prefixes whose step timings are kept (abandoned ones are forgotten past it)

# Prefill `ids` from `start` into the cache tier `kind` under an adapter, `start` dropped first where
# it is a superseded slice (the engine's chunked prefill and put).
Fill = Callable[[list[int], StoredState | None, str, Any, int, bool], StoredState]


@dataclass
class _InProgress:
    """A prefix being prefilled in steps: the bytes its whole state will hold, its pinned slice,
    and the engine turn it last took."""

    whole_bytes: int
    slice_key: str | None = None
    seen: int = 0


@dataclass(frozen=True)
class Step:
    """One step to prefill: `ids` (a prefix's first tokens) from `start`, into tier `kind`;
    `superseded`: `start` is an earlier step's slice, dropped before the store."""

    key: str
    ids: list[int]
    start: StoredState | None
    kind: str
    superseded: bool
    state_tokens: int


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
        self._in_progress: dict[str, _InProgress] = {}  # by prefix key, the oldest first
        self._turn = 0  # engine turns so far (`next_turn`; a lone `step` call is a turn of its own)
        self._last_turn: dict[Hashable, int] = {}  # each caller's last turn
        self._unkept: set[str] = set()  # prefixes whose step the cache could not keep

    @property
    def in_progress(self) -> int:
        """Prefixes now holding a place in the cache for their steps."""
        return len(self._in_progress)

    def step(
        self,
        prefix: list[int],
        state_tokens: int,
        images: Any = None,
        adapter: int = BASE,
        caller: Hashable = None,
    ) -> bool:
        """Prefill one step of a long `prefix` under `adapter` into the state cache, or wait while
        the prefills ahead of it need the room (True either way: the caller runs again next turn);
        False when what is left fits in one step (or the cache cannot keep the state), so the
        caller finishes it now. `caller` names who asks (the group's requests), so a prefix whose
        callers are gone gives its place up."""
        self.next_turn()
        planned = self.plan(prefix, state_tokens, adapter, caller)
        if not isinstance(planned, Step):
            return planned
        t0 = time.perf_counter()
        stored = self.fill(planned.ids, planned.start, planned.kind, images, adapter, planned.superseded)
        self.memory.synchronize()
        return self.finish(planned, stored, time.perf_counter() - t0)

    def next_turn(self) -> None:
        """A new engine turn: every caller planned in it counts as seen at it, whatever its order."""
        self._turn += 1

    def plan(
        self, prefix: list[int], state_tokens: int, adapter: int = BASE, caller: Hashable = None
    ) -> Step | bool:
        """`step` without running it: the `Step` to prefill now (then `finish` it with what was
        stored), True while it waits its turn, False when the caller finishes the prefix now."""
        if not prefix or not self.chunk_tokens or self.cache.has(prefix, adapter=adapter):
            return False
        step = self.chunk_tokens * PREFILL_STEP_CHUNKS
        whole_state = self.estimate.cache_per_token * len(prefix) + self.estimate.state_per_row
        if whole_state > self.cache.budget_bytes:
            return False  # the cache could not keep the steps: prefilled in one go
        start = self.cache.longest_prefix(prefix, adapter)
        done = len(start) if start is not None else 0
        if len(prefix) - done <= step:
            return False
        key = state_key(prefix, adapter)
        if key in self._unkept:
            return False
        if not self._holds_place(key, whole_state, caller):
            return True  # waits: the prefills in progress finish first
        boundary = state_tokens if done < state_tokens else len(prefix)
        target = min(boundary, done + step)
        kind = STATE if target <= state_tokens else QUESTION
        superseded = start is not None and start.digest in self._slices and len(start) != state_tokens
        return Step(key, prefix[:target], start, kind, superseded, state_tokens)

    def finish(self, planned: Step, stored: StoredState, seconds: float) -> bool:
        """Record a step that ran (`stored`: what the cache was given), pinning its slice; False
        when the cache could not keep it (the caller then finishes the prefix in one go)."""
        if not self.cache.has(stored.ids, adapter=stored.adapter):
            self._give_up(planned.key)
            if len(self._unkept) > MAX_STEPPED:
                self._unkept.clear()  # abandoned prefixes: they only step again
            self._unkept.add(planned.key)  # its next turn finishes it in one go
            return False
        self.drop_slice(planned.start, planned.state_tokens)
        if len(self._seconds) > MAX_STEPPED:
            self._seconds.clear()  # abandoned states' counters; only their timing is lost
        self._seconds[planned.key] = self._seconds.get(planned.key, 0.0) + seconds
        self._slices.add(stored.digest)
        self.cache.pin(stored.digest)
        progress = self._in_progress.get(planned.key)
        if progress is not None:
            progress.slice_key = stored.digest
        return True

    def take(self, prefix: list[int], adapter: int = BASE) -> float | None:
        """The seconds the steps over `prefix` under `adapter` took (None: it was not stepped);
        forgotten now, and its place in the cache given up (its last slice may go)."""
        key = state_key(prefix, adapter)
        self._give_up(key)
        self._unkept.discard(key)
        return self._seconds.pop(key, None)

    def drop_slice(self, start: StoredState | None, state_tokens: int) -> None:
        """Drop a step's slice once a longer one supersedes it (the state prefix itself stays)."""
        if start is not None and start.digest in self._slices:
            self._slices.discard(start.digest)
            self.cache.unpin(start.digest)
            if len(start) != state_tokens:
                self.cache.discard(start.ids, start.adapter)

    def _holds_place(self, key: str, whole_bytes: int, caller: Hashable) -> bool:
        """Whether the prefix `key` may take its step now: it is in progress, or its whole state
        fits beside those in progress (then it is from now on)."""
        previous = self._last_turn.pop(caller, None)
        self._last_turn[caller] = self._turn
        if len(self._last_turn) > MAX_STEPPED:
            self._last_turn.pop(next(iter(self._last_turn)))
        if previous is not None:  # every live prefix took a turn since the caller's last one
            for gone in [k for k, p in self._in_progress.items() if p.seen < previous and k != key]:
                self._give_up(gone)
        progress = self._in_progress.get(key)
        if progress is None:
            held = sum(p.whole_bytes for p in self._in_progress.values())
            if held + whole_bytes > self.cache.budget_bytes:
                return False
            progress = self._in_progress[key] = _InProgress(whole_bytes)
        progress.seen = self._turn
        return True

    def _give_up(self, key: str) -> None:
        """The prefix `key` holds no place any more: its slice is an ordinary cache entry."""
        progress = self._in_progress.pop(key, None)
        if progress is not None and progress.slice_key is not None:
            self.cache.unpin(progress.slice_key)
