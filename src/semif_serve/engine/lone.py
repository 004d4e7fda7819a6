"""The lone-row policy: whether a lone row (one request, one row, no orderings) runs over its
state or as SemIf's plain forward. Nothing is prefilled for a possible future request: a state
worth keeping is kept by the request that brings it (its own pass ends at the state, stores it
and goes on to the suffix), so no request ever waits behind speculative work (issue 29).

A short state read by the plain forward is remembered by its key (`ReturnVisits`: a bounded
LRU of digests, each for `RETURN_WINDOW_SECONDS`); a request about it that comes back in that
window keeps it by its own pass, so the third question about it is read from the cache
(issue 39). A state asked about once costs what it did: one plain forward.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from semif_serve.domain.requests import BASE
from semif_serve.engine.state_cache import STATE, StateCache, state_key
from semif_serve.engine.vision import has_image_tokens

# The longest state a lone row's plain forward covers: SemIf's own per-row limit (/decide's 4096);
# System One's longer states are prefilled in chunks (two forwards cost about one at that length).
DIRECT_MAX_TOKENS = 4096
# The shortest state a lone row keeps by its own pass: that pass is one packed forward (the state
# kept at its own end, then the question), about the plain one's cost (1% more at 1,547 tokens,
# bench/reuse.py --only back), so a ~1,100-word state is kept at its first visit (issue 50).
KEEP_STATE_TOKENS = 1024
# How many short states read without keeping are remembered (32 bytes of key and a float each),
# and for how long: a client that comes back within the window finds its state kept the second time.
RETURN_MEMORY = 4096
RETURN_WINDOW_SECONDS = 600.0


class ReturnVisits:
    """The keys of states read without keeping them, the most recent `capacity` within
    `window` seconds; thread-safe."""

    def __init__(
        self,
        capacity: int = RETURN_MEMORY,
        window: float = RETURN_WINDOW_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.capacity = capacity
        self.window = window
        self.clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def returned(self, key: str) -> bool:
        """Whether `key` was seen within the window (forgotten now: its state is being kept);
        else it is remembered as seen now (the oldest key beyond `capacity` forgotten)."""
        now = self.clock()
        with self._lock:
            seen = self._seen.pop(key, None)
            if seen is not None and now - seen <= self.window:
                return True
            self._seen[key] = now
            while len(self._seen) > self.capacity:
                self._seen.popitem(last=False)
            return False


class LoneRowPolicy:
    """Decides the path of lone rows over one state cache."""

    def __init__(
        self, cache: StateCache, keep_tokens: int = KEEP_STATE_TOKENS, visits: ReturnVisits | None = None
    ) -> None:
        self.cache = cache
        self.keep_tokens = keep_tokens
        self.visits = visits if visits is not None else ReturnVisits()

    def reuses(self, ids: tuple[int, ...], demand_keys: Sequence[str | None], adapter: int = BASE) -> bool:
        """Whether lone rows over state `ids` under `adapter` (one per request of `demand_keys`)
        run over the state: it is cached, several rows or requests in flight want it (one prefill, joined by
        all), it is long enough to keep (`keep_tokens`), it was read without keeping before
        (`visits`: a client came back to it) or longer than DIRECT_MAX_TOKENS (prefilled in
        chunks like any state, never one unbounded plain forward)."""
        if self.cache.has(ids, STATE, adapter):
            return True
        if len(ids) > DIRECT_MAX_TOKENS:
            return True
        if self.cache.budget_bytes == 0:
            return len(demand_keys) > 1  # one prefill still serves them all, nothing to keep
        if len(ids) >= self.keep_tokens or has_image_tokens(ids):
            return True  # kept by this request's own pass (an image's tower runs once)
        wanted = max(self.cache.demand.count(key) for key in demand_keys)
        if len(demand_keys) > 1 or wanted > 1:
            return True
        return self.visits.returned(state_key(ids, adapter))
