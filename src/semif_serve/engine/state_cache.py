"""Prefilled model states kept for reuse: a byte-budgeted, least-recently-used cache keyed by the
exact prefix token ids (the forwards that fill and read it live in `engine.forwards`).

A state is transformers' hybrid `DynamicCache` for Qwen3.5 at the exact prefix boundary: per
full-attention layer its keys and values (`[1, kv_heads, prefix, head_dim]`), per
linear-attention layer its convolution state (`[1, conv_dim, kernel]`) and recurrent state
(`[1, v_heads, k_dim, v_dim]`). Stored states are never handed out: `StoredState.fork(rows)`
builds a new cache object that the caller may consume freely. Why a fork is exact and cheap:

- full-attention keys/values are only ever replaced (`torch.cat` in `DynamicLayer.update`,
  `index_select` in `reorder_cache`), never written in place, so the fork shares them, expanded
  over the rows as a stride-0 view (no copy; the forward's `cat` materialises the rows once);
- linear-attention states ARE written in place (`copy_` in `update_conv_state`,
  `update_recurrent_state` and the one-token `causal_conv1d_update`), so the fork gets its own
  replicas; their size does not depend on the prefix length;
- per-layer bookkeeping (`has_previous_state` and friends) lives in dicts, which the fork copies.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from semif_serve.domain.requests import BASE

# Per-layer tensor dicts of a linear-attention cache layer, written in place by the forward.
_LINEAR_STATE_DICTS = ("conv_states", "recurrent_states")


def prefix_digest(ids: Sequence[int]) -> str:
    """A digest of a token-id sequence (with its length), used as the cache's lookup key."""
    h = hashlib.blake2b(digest_size=16)
    h.update(len(ids).to_bytes(8, "little"))
    h.update(array("q", ids).tobytes())
    return h.hexdigest()


def state_key(ids: Sequence[int], adapter: int = BASE) -> str:
    """The cache's key of a state: the digest of its ids, and the adapter it was prefilled under
    (the base keeps the bare digest), so one adapter's state is never served for another's."""
    digest = prefix_digest(ids)
    return digest if adapter == BASE else f"{adapter}:{digest}"


def state_digest(state: Any, images: Sequence[str] = (), model: str | None = None) -> str:
    """A digest of a request's raw state as the prompt renders it (JSON, keys in their order),
    of its images' SHA-256s and of the served model that reads it (`model`, its name; None: the
    base): equal digests render the same state prefix under one model, so requests in flight can
    be matched before they are encoded. Only ever steers which path runs, never what a row
    computes."""
    text = json.dumps(state, ensure_ascii=False)
    h = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16)
    for sha in images:
        h.update(sha.encode("ascii"))
    if model is not None:
        h.update(b"\0model:" + model.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def state_bytes(cache: Any) -> int:
    """Bytes held by a cache's tensors: keys/values and linear-attention states, counted once each."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in _state_tensors(cache):
        ident = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if ident not in seen:
            seen.add(ident)
            total += tensor.untyped_storage().nbytes()
    return total


def _state_tensors(cache: Any):
    for layer in cache.layers:
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if tensor is not None and tensor.numel():
                yield tensor
        for name in _LINEAR_STATE_DICTS:
            for tensor in (getattr(layer, name, None) or {}).values():
                if tensor is not None:
                    yield tensor


def fork_cache(cache: Any, rows: int = 1) -> Any:
    """A new cache equal to `cache` replicated over `rows` batch rows, consumable by a forward
    (extended, reordered) without changing `cache` or its tensors; see the module docstring."""
    from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

    layers = []
    for layer in cache.layers:
        if type(layer) not in (DynamicLayer, LinearAttentionLayer):
            raise TypeError(f"cannot fork a {type(layer).__name__} cache layer safely")
        twin = copy.copy(layer)
        for name, value in vars(layer).items():
            if isinstance(value, dict):
                setattr(twin, name, dict(value))
        if type(layer) is DynamicLayer:
            if layer.is_initialized and layer.keys is not None and layer.keys.numel():
                twin.keys = _expand_rows(layer.keys, rows)
                twin.values = _expand_rows(layer.values, rows)
        else:
            for name in _LINEAR_STATE_DICTS:
                states = getattr(twin, name)
                for idx, tensor in states.items():
                    if tensor is not None:
                        states[idx] = _expand_rows(tensor, rows).clone()
        layers.append(twin)
    twin_cache = copy.copy(cache)
    twin_cache.layers = layers
    return twin_cache


def _expand_rows(tensor: Any, rows: int) -> Any:
    if tensor.shape[0] != 1:
        raise ValueError(f"a stored state has one batch row, this one has {tensor.shape[0]}")
    return tensor.expand(rows, *tensor.shape[1:])


class StoredState:
    """A prefilled state at the exact boundary of `ids` under `adapter` (the adapter bank's
    index, BASE for the base); hand out `fork(rows)`, never the cache."""

    def __init__(
        self, ids: Sequence[int], cache: Any, adapter: int = BASE, is_preamble: bool = False
    ) -> None:
        self.ids: tuple[int, ...] = tuple(int(t) for t in ids)
        self.adapter = adapter
        self.is_preamble = is_preamble  # the ids every prompt starts with: no request's state
        self.digest = state_key(self.ids, adapter)
        self.nbytes = state_bytes(cache)
        self._cache = cache

    def __len__(self) -> int:
        return len(self.ids)

    def fork(self, rows: int = 1) -> Any:
        """A consumable cache over `rows` rows; the stored tensors stay bit-unchanged."""
        return fork_cache(self._cache, rows)

    def layer_state(self, layer: int) -> tuple[Any, Any]:
        """What a forward continuing this state reads at decoder layer `layer` (read only): the
        keys and values of a full-attention layer, or a linear-attention layer's last convolution
        inputs and recurrent state."""
        cached = self._cache.layers[layer]
        if hasattr(cached, "recurrent_states"):
            return cached.conv_states[0], cached.recurrent_states[0]
        return cached.keys, cached.values

    def tensors(self) -> list[Any]:
        """The stored tensors themselves (read-only use: tests, accounting)."""
        return list(_state_tensors(self._cache))


# The two tiers of the cache: question-independent state prefixes (what follow-ups reuse) and
# longer prefixes that also hold one request's question (what its orderings share).
STATE = "state"
QUESTION = "question"
KINDS = (STATE, QUESTION)


@dataclass(frozen=True)
class KindStats:
    """One tier's lookups and contents."""

    hits: int = 0
    misses: int = 0
    entries: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of the cache's counters and size (totals over both tiers, and per tier)."""

    budget_bytes: int
    bytes: int
    entries: int
    hits: int
    misses: int
    evictions: int
    refused: int  # states larger than the whole budget (or a question prefix larger than what states leave)
    by_kind: dict[str, KindStats] = field(default_factory=dict)


class Demand:
    """How many requests now in flight (queued, encoding or running) are about each state;
    thread-safe. The engine asks it whether a new state is wanted by more than one request."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def enter(self, key: str) -> None:
        with self._lock:
            self._counts[key] += 1

    def leave(self, key: str) -> None:
        with self._lock:
            self._counts[key] -= 1
            if self._counts[key] <= 0:
                del self._counts[key]

    def count(self, key: str | None) -> int:
        with self._lock:
            return self._counts.get(key, 0) if key is not None else 0


class StateCache:
    """Prefilled states under a byte budget in two tiers, evicted least-recently-used.

    The `state` tier holds question-independent state prefixes (what another question about
    the same state reuses); the `question` tier holds longer prefixes that also cover one
    request's question (what its orderings shared; almost nothing else reuses them). A
    question prefix is evicted before any state prefix and never evicts one: it is stored only
    in what the states leave of the budget. Keyed by the digest of the exact prefix ids and
    the adapter (`state_key`); a hit also compares the full ids, so a digest collision is a
    miss, never a wrong state. An entry may be pinned (`pin`: the slice of a prefill in progress),
    which no `put` evicts; only `shrink_to` (memory pressure) drops pinned entries. One
    engine thread mutates; any thread may read `stats()`. A budget of 0 disables storing.
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self.budget_bytes = budget_bytes
        self._tiers: dict[str, OrderedDict[str, StoredState]] = {kind: OrderedDict() for kind in KINDS}
        self._tier_bytes = dict.fromkeys(KINDS, 0)
        self._lookups = {kind: [0, 0] for kind in KINDS}  # hits, misses
        self._evictions = self._refused = 0
        self._pinned: set[str] = set()  # keys no put may evict (the slices of prefills in progress)
        self._lock = threading.Lock()
        self.demand = Demand()

    def get(self, ids: Sequence[int], kind: str = STATE, adapter: int = BASE) -> StoredState | None:
        """The state stored for exactly `ids` under `adapter` in tier `kind` (now most recently
        used), or None; counts a hit or miss of that kind."""
        with self._lock:
            entry = self._recent(ids, kind, adapter)
            self._lookups[kind][0 if entry is not None else 1] += 1
            return entry

    def peek(self, ids: Sequence[int], kind: str = STATE, adapter: int = BASE) -> StoredState | None:
        """`get` without counting a hit or miss (a lookup no request asked for: the preamble's)."""
        with self._lock:
            return self._recent(ids, kind, adapter)

    def _recent(self, ids: Sequence[int], kind: str, adapter: int) -> StoredState | None:
        """The entry for exactly `ids` in tier `kind`, now most recently used (the lock held)."""
        key = state_key(ids, adapter)
        tier = self._tiers[kind]
        entry = tier.get(key)
        if entry is None or entry.ids != tuple(ids):
            return None
        tier.move_to_end(key)
        return entry

    def has(self, ids: Sequence[int], kind: str | None = None, adapter: int = BASE) -> bool:
        """Whether exactly `ids` is stored under `adapter` in tier `kind` (None: in either tier);
        counts nothing, changes no order."""
        key = state_key(ids, adapter)
        wanted = tuple(ids)
        with self._lock:
            for tier_kind in KINDS if kind is None else (kind,):
                entry = self._tiers[tier_kind].get(key)
                if entry is not None and entry.ids == wanted:
                    return True
            return False

    def longest_prefix(self, ids: Sequence[int], adapter: int = BASE) -> StoredState | None:
        """The longest stored state under `adapter` (either tier) whose ids start `ids` (a shorter
        state to extend), or None. Counts nothing: callers count the exact `get` they make first."""
        wanted = tuple(ids)
        with self._lock:
            best, best_kind = None, STATE
            for kind, tier in self._tiers.items():
                for entry in tier.values():
                    n = len(entry.ids)
                    if (
                        entry.adapter == adapter
                        and n <= len(wanted)
                        and (best is None or n > len(best))
                        and wanted[:n] == entry.ids
                    ):
                        best, best_kind = entry, kind
            if best is not None:
                self._tiers[best_kind].move_to_end(best.digest)
            return best

    def put(
        self,
        ids: Sequence[int],
        cache: Any,
        kind: str = STATE,
        adapter: int = BASE,
        is_preamble: bool = False,
    ) -> StoredState:
        """Take ownership of `cache` (prefilled over exactly `ids` under `adapter`, one row) and
        store it in tier `kind`, evicting least-recently-used entries to fit (question prefixes
        first; a question prefix never evicts a state prefix); what cannot fit is returned
        unstored, as is what would need a pinned entry evicted (`is_preamble`: the state of the
        preamble every prompt starts with, docs/state-cache.md). The caller must use the returned
        state's `fork`, never `cache` again."""
        state = StoredState(ids, cache, adapter, is_preamble)
        with self._lock:
            for tier_kind, tier in self._tiers.items():
                old = tier.pop(state.digest, None)
                if old is not None:
                    self._tier_bytes[tier_kind] -= old.nbytes
            kept = self._pinned_bytes(QUESTION) + (
                self._pinned_bytes(STATE) if kind == STATE else self._tier_bytes[STATE]
            )
            if state.nbytes > self.budget_bytes - kept:
                self._refused += 1
                return state
            self._evict_to(self.budget_bytes - state.nbytes, QUESTION, spare_pinned=True)
            if kind == STATE:
                self._evict_to(self.budget_bytes - state.nbytes, STATE, spare_pinned=True)
            self._tiers[kind][state.digest] = state
            self._tier_bytes[kind] += state.nbytes
        return state

    def discard(self, ids: Sequence[int], adapter: int = BASE) -> None:
        """Drop the state stored for exactly `ids` under `adapter`, in whichever tier (a slice
        superseded by a longer one)."""
        key = state_key(ids, adapter)
        with self._lock:
            for kind, tier in self._tiers.items():
                entry = tier.get(key)
                if entry is not None and entry.ids == tuple(ids):
                    del tier[key]
                    self._tier_bytes[kind] -= entry.nbytes

    def pin(self, key: str) -> None:
        """Keep the entry under `key` (a `StoredState.digest`) from being evicted by any `put`."""
        with self._lock:
            self._pinned.add(key)

    def unpin(self, key: str) -> None:
        """Let the entry under `key` be evicted again (least recently used first)."""
        with self._lock:
            self._pinned.discard(key)

    def shrink_to(self, max_bytes: int) -> int:
        """Evict least-recently-used entries (question prefixes first) until at most
        `max_bytes` are held; the bytes freed."""
        with self._lock:
            before = self._bytes
            for kind in (QUESTION, STATE):
                self._evict_to(max(0, max_bytes), kind)
            return before - self._bytes

    def clear(self) -> int:
        """Drop every state (memory pressure); the bytes freed."""
        return self.shrink_to(0)

    def stats(self) -> CacheStats:
        """Counters and size, consistent with each other."""
        with self._lock:
            by_kind = {
                kind: KindStats(
                    self._lookups[kind][0], self._lookups[kind][1], len(tier), self._tier_bytes[kind]
                )
                for kind, tier in self._tiers.items()
            }
            return CacheStats(
                budget_bytes=self.budget_bytes,
                bytes=self._bytes,
                entries=sum(k.entries for k in by_kind.values()),
                hits=sum(k.hits for k in by_kind.values()),
                misses=sum(k.misses for k in by_kind.values()),
                evictions=self._evictions,
                refused=self._refused,
                by_kind=by_kind,
            )

    @property
    def _bytes(self) -> int:
        return sum(self._tier_bytes.values())

    def _pinned_bytes(self, kind: str) -> int:
        tier = self._tiers[kind]
        return sum(tier[key].nbytes for key in self._pinned if key in tier)

    def _evict_to(self, max_bytes: int, kind: str, spare_pinned: bool = False) -> None:
        """Evict tier `kind`, least recently used first (pinned entries spared where asked),
        while the cache holds more than `max_bytes`."""
        tier = self._tiers[kind]
        for key in list(tier):
            if self._bytes <= max_bytes:
                return
            if spare_pinned and key in self._pinned:
                continue
            entry = tier.pop(key)
            self._tier_bytes[kind] -= entry.nbytes
            self._evictions += 1
