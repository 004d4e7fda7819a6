"""The lone-row policy: whether a lone row (one request, one row, no orderings) runs over its
state or as SemIf's plain forward, and the deferred prefills that keep a plain row's state for
a follow-up, run a step at a time while the engine is idle.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from semif_serve.engine.forwards import prefill
from semif_serve.engine.memory import DeviceMemory
from semif_serve.engine.state_cache import STATE, StateCache, StoredState, prefix_digest
from semif_serve.engine.vision import has_image_tokens

IDLE_PREFILL_TOKENS = 512  # one idle step of a deferred prefill: what a newcomer may wait behind
MAX_DEFERRED = 4  # states waiting for an idle prefill (the newest first; older ones are dropped)
# The longest state a lone row's plain forward covers: SemIf's own per-row limit (/decide's 4096);
# System One's longer states are prefilled in chunks (two forwards cost about one at that length).
DIRECT_MAX_TOKENS = 4096


@dataclass
class DeferredFill:
    """A state waiting for an idle prefill, and how far it got (a private partial state)."""

    ids: tuple[int, ...]
    partial: StoredState | None = None

    @property
    def done(self) -> int:
        return len(self.partial) if self.partial is not None else 0


class LoneRowPolicy:
    """Decides the path of lone rows and keeps their deferred prefills (engine thread only)."""

    def __init__(self, model: Any, cache: StateCache, memory: DeviceMemory) -> None:
        self.model = model
        self.cache = cache
        self.memory = memory
        self._deferred: OrderedDict[str, DeferredFill] = OrderedDict()

    def reuses(self, ids: tuple[int, ...], demand_keys: Sequence[str | None]) -> bool:
        """Whether lone rows over state `ids` (one per request of `demand_keys`) run over the
        state: it is cached, several want it, or it is longer than DIRECT_MAX_TOKENS (prefilled
        in chunks like any state, never one unbounded plain forward)."""
        if self.cache.has(ids, STATE):
            return True
        if len(ids) > DIRECT_MAX_TOKENS:
            return True
        if self.cache.budget_bytes and has_image_tokens(ids):
            return True  # kept now: an idle prefill later would have to run the tower again
        if self.cache.budget_bytes == 0:
            return len(demand_keys) > 1  # one prefill still serves them all, nothing to keep
        wanted = max(self.cache.demand.count(key) for key in demand_keys)
        return len(demand_keys) > 1 or wanted > 1

    def defer(self, ids: tuple[int, ...]) -> None:
        """Queue a state for an idle prefill (newest first; the oldest dropped past MAX_DEFERRED)."""
        if not ids or self.cache.budget_bytes == 0 or self.cache.has(ids, STATE) or has_image_tokens(ids):
            return
        key = prefix_digest(ids)
        self._deferred.pop(key, None)
        self._deferred[key] = DeferredFill(ids)
        while len(self._deferred) > MAX_DEFERRED:
            self._deferred.popitem(last=False)

    @property
    def deferred(self) -> int:
        """States queued for an idle prefill."""
        return len(self._deferred)

    def fill_idle_step(self) -> bool:
        """One step (at most IDLE_PREFILL_TOKENS) of the newest deferred prefill, while nothing is
        queued; a finished state is stored in the cache. Whether more remains."""
        while self._deferred:
            key, fill = next(reversed(self._deferred.items()))
            if self.cache.has(fill.ids, STATE):  # a follow-up prefilled it meanwhile
                del self._deferred[key]
                continue
            upto = min(len(fill.ids), fill.done + IDLE_PREFILL_TOKENS)
            cache = prefill(self.model, fill.ids[:upto], start=fill.partial, chunk_tokens=IDLE_PREFILL_TOKENS)
            if upto == len(fill.ids):
                self.cache.put(fill.ids, cache, STATE)
                del self._deferred[key]
            else:
                fill.partial = StoredState(fill.ids[:upto], cache)
            self.memory.synchronize()
            return bool(self._deferred)
        return False

    def drop(self) -> None:
        """Forget every deferred prefill (after a failure: memory comes first)."""
        self._deferred.clear()
