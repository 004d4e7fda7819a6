"""The lone-row policy: whether a lone row (one request, one row, no orderings) runs over its
state or as SemIf's plain forward. Nothing is prefilled for a possible future request: a state
worth keeping is kept by the request that brings it (its own pass ends at the state, stores it
and goes on to the suffix), so no request ever waits behind speculative work (issue 29).
"""

from __future__ import annotations

from collections.abc import Sequence

from semif_serve.engine.state_cache import BASE_MODEL, STATE, StateCache
from semif_serve.engine.vision import has_image_tokens

# The longest state a lone row's plain forward covers: SemIf's own per-row limit (/decide's 4096);
# System One's longer states are prefilled in chunks (two forwards cost about one at that length).
DIRECT_MAX_TOKENS = 4096
# The shortest state a lone row keeps by its own pass (prefill to the state, store, suffix): below
# it the two forwards cost more than the plain one saves a follow-up (bench/traffic.py --only keep).
KEEP_STATE_TOKENS = 1536


class LoneRowPolicy:
    """Decides the path of lone rows over one state cache."""

    def __init__(self, cache: StateCache, keep_tokens: int = KEEP_STATE_TOKENS) -> None:
        self.cache = cache
        self.keep_tokens = keep_tokens

    def reuses(
        self, ids: tuple[int, ...], demand_keys: Sequence[str | None], model: int = BASE_MODEL
    ) -> bool:
        """Whether lone rows over state `ids` under `model` (one per request of `demand_keys`)
        run over the state: it is cached, several rows or requests in flight want it (one prefill, joined by
        all), it is long enough to keep (`keep_tokens`) or longer than DIRECT_MAX_TOKENS
        (prefilled in chunks like any state, never one unbounded plain forward)."""
        if self.cache.has(ids, STATE, model):
            return True
        if len(ids) > DIRECT_MAX_TOKENS:
            return True
        if self.cache.budget_bytes == 0:
            return len(demand_keys) > 1  # one prefill still serves them all, nothing to keep
        if len(ids) >= self.keep_tokens or has_image_tokens(ids):
            return True  # kept by this request's own pass (an image's tower runs once)
        wanted = max(self.cache.demand.count(key) for key in demand_keys)
        return len(demand_keys) > 1 or wanted > 1
