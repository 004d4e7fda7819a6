"""Prefilled model states kept for reuse: a byte-budgeted, least-recently-used cache keyed by the
exact prefix token ids, and the two operations around it (prefill a prefix in chunks, score
suffixes over a state).

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
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Per-layer tensor dicts of a linear-attention cache layer, written in place by the forward.
_LINEAR_STATE_DICTS = ("conv_states", "recurrent_states")


def prefix_digest(ids: Sequence[int]) -> str:
    """A digest of a token-id sequence (with its length), used as the cache's lookup key."""
    h = hashlib.blake2b(digest_size=16)
    h.update(len(ids).to_bytes(8, "little"))
    h.update(array("q", ids).tobytes())
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
    """A prefilled state at the exact boundary of `ids`; hand out `fork(rows)`, never the cache."""

    def __init__(self, ids: Sequence[int], cache: Any) -> None:
        self.ids: tuple[int, ...] = tuple(int(t) for t in ids)
        self.digest = prefix_digest(self.ids)
        self.nbytes = state_bytes(cache)
        self._cache = cache

    def __len__(self) -> int:
        return len(self.ids)

    def fork(self, rows: int = 1) -> Any:
        """A consumable cache over `rows` rows; the stored tensors stay bit-unchanged."""
        return fork_cache(self._cache, rows)

    def tensors(self) -> list[Any]:
        """The stored tensors themselves (read-only use: tests, accounting)."""
        return list(_state_tensors(self._cache))


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of the cache's counters and size."""

    budget_bytes: int
    bytes: int
    entries: int
    hits: int
    misses: int
    evictions: int
    refused: int  # states larger than the whole budget, never stored


class StateCache:
    """Prefilled states under a byte budget, evicted least-recently-used.

    Keyed by the digest of the exact prefix ids; a hit also compares the full ids, so a digest
    collision is a miss, never a wrong state. One engine thread mutates; any thread may read
    `stats()`. A budget of 0 disables storing (every lookup misses).
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, StoredState] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._evictions = self._refused = 0
        self._lock = threading.Lock()

    def get(self, ids: Sequence[int]) -> StoredState | None:
        """The state stored for exactly `ids` (now most recently used), or None; counts a hit or miss."""
        key = prefix_digest(ids)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.ids != tuple(ids):
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return entry

    def longest_prefix(self, ids: Sequence[int]) -> StoredState | None:
        """The longest stored state whose ids start `ids` (a shorter state to extend), or None.
        Counts nothing: callers count the exact `get` they make first."""
        wanted = tuple(ids)
        with self._lock:
            best = None
            for entry in self._entries.values():
                n = len(entry.ids)
                if n <= len(wanted) and (best is None or n > len(best)) and wanted[:n] == entry.ids:
                    best = entry
            if best is not None:
                self._entries.move_to_end(best.digest)
            return best

    def put(self, ids: Sequence[int], cache: Any) -> StoredState:
        """Take ownership of `cache` (prefilled over exactly `ids`, one row) and store it, evicting
        least-recently-used states to fit; a state larger than the budget is returned unstored.
        The caller must use the returned state's `fork`, never `cache` again."""
        state = StoredState(ids, cache)
        with self._lock:
            old = self._entries.pop(state.digest, None)
            if old is not None:
                self._bytes -= old.nbytes
            if state.nbytes > self.budget_bytes:
                self._refused += 1
                return state
            self._evict_to(self.budget_bytes - state.nbytes)
            self._entries[state.digest] = state
            self._bytes += state.nbytes
        return state

    def holds(self, ids: Sequence[int]) -> bool:
        """Whether a state is stored for exactly `ids` (counts nothing, changes no order)."""
        with self._lock:
            entry = self._entries.get(prefix_digest(ids))
            return entry is not None and entry.ids == tuple(ids)

    def discard(self, ids: Sequence[int]) -> None:
        """Drop the state stored for exactly `ids`, if any (a slice superseded by a longer one)."""
        with self._lock:
            entry = self._entries.get(prefix_digest(ids))
            if entry is not None and entry.ids == tuple(ids):
                del self._entries[entry.digest]
                self._bytes -= entry.nbytes

    def shrink_to(self, max_bytes: int) -> int:
        """Evict least-recently-used states until at most `max_bytes` are held; the bytes freed."""
        with self._lock:
            before = self._bytes
            self._evict_to(max(0, max_bytes))
            return before - self._bytes

    def clear(self) -> int:
        """Drop every state (memory pressure); the bytes freed."""
        return self.shrink_to(0)

    def stats(self) -> CacheStats:
        """Counters and size, consistent with each other."""
        with self._lock:
            return CacheStats(
                self.budget_bytes,
                self._bytes,
                len(self._entries),
                self._hits,
                self._misses,
                self._evictions,
                self._refused,
            )

    def _evict_to(self, max_bytes: int) -> None:
        while self._entries and self._bytes > max_bytes:
            _, entry = self._entries.popitem(last=False)
            self._bytes -= entry.nbytes
            self._evictions += 1


def prefill(
    model: Any, ids: Sequence[int], start: StoredState | None = None, chunk_tokens: int | None = None
):
    """The one-row cache after `ids`, continuing from `start` (a state over a prefix of `ids`)
    and feeding the remaining tokens in chunks of at most `chunk_tokens` (bounds activation
    memory on long states; None: one chunk). Returns a fresh cache, ready for `StateCache.put`."""
    import torch
    from transformers import DynamicCache

    decoder = model.get_decoder()
    device = next(decoder.parameters()).device
    done = 0
    if start is not None:
        if tuple(ids[: len(start)]) != start.ids:
            raise ValueError("start is not a state over a prefix of ids")
        done = len(start)
        cache = start.fork(1)
    else:
        cache = DynamicCache(config=decoder.config)
    if done == len(ids):
        return cache
    step = chunk_tokens or len(ids)
    if step < 1:
        raise ValueError("chunk_tokens must be >= 1")
    with torch.inference_mode():
        while done < len(ids):
            chunk = list(ids[done : done + step])
            positions = torch.arange(done, done + len(chunk), device=device)[None]
            decoder(
                input_ids=torch.tensor([chunk], device=device),
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            )
            done += len(chunk)
    return cache


def padded_suffixes(suffixes: Sequence[Sequence[int]], n_prefix: int, pad_id: int) -> tuple[Any, Any]:
    """Suffix rows right-padded to the widest, and the attention mask over prefix + suffix."""
    import torch

    width = max(len(s) for s in suffixes)
    input_ids = torch.full((len(suffixes), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(suffixes), n_prefix + width), dtype=torch.long)
    mask[:, :n_prefix] = 1
    for i, suffix in enumerate(suffixes):
        input_ids[i, : len(suffix)] = torch.tensor(list(suffix), dtype=torch.long)
        mask[i, n_prefix : n_prefix + len(suffix)] = 1
    return input_ids, mask


def suffix_logits(
    model: Any,
    state: StoredState | None,
    suffixes: Sequence[Sequence[int]],
    pad_id: int,
    chunk_tokens: int | None = None,
):
    """Float32 full-vocabulary logits `[rows, vocab]` at each row's last real position, running
    every suffix over `state` (None: no prefix) in one right-padded forward (or, past
    `chunk_tokens`, in column chunks: see `logits_over`)."""
    import torch

    with torch.inference_mode():
        cache = state.fork(len(suffixes)) if state is not None else None
        n_prefix = len(state) if state is not None else 0
        return logits_over(model, cache, n_prefix, suffixes, pad_id, chunk_tokens)


def logits_over(
    model: Any,
    cache: Any,
    n_prefix: int,
    suffixes: Sequence[Sequence[int]],
    pad_id: int,
    chunk_tokens: int | None = None,
):
    """`suffix_logits` over an already forked cache of `n_prefix` tokens (None: no prefix), which
    the forward consumes: attention mask over prefix + suffix, explicit positions, only the read
    positions through the vocabulary head.

    Suffixes wider than `chunk_tokens` (None: never) run `chunk_tokens` columns per forward
    over the growing cache, like a chunked prefill, so a long question's activations are
    bounded like a long state's; each row is read in the chunk that holds its last position.
    """
    import torch

    decoder = model.get_decoder()
    device = next(decoder.parameters()).device
    lengths = [len(s) for s in suffixes]
    if not suffixes or min(lengths) < 1:
        raise ValueError("every row needs at least one suffix token")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError("chunk_tokens must be >= 1")
    width = max(lengths)
    input_ids, mask = padded_suffixes(suffixes, n_prefix, pad_id)
    positions = (torch.arange(width, dtype=torch.long) + n_prefix).expand(len(suffixes), width)
    last = [n - 1 for n in lengths]
    step = min(width, chunk_tokens or width)
    with torch.inference_mode():
        if step < width and cache is None:
            from transformers import DynamicCache

            cache = DynamicCache(config=decoder.config)
        reads: list[Any] = [None] * len(suffixes)
        for start in range(0, width, step):
            stop = min(width, start + step)
            hidden = decoder(
                input_ids=input_ids[:, start:stop].to(device),
                attention_mask=mask[:, : n_prefix + stop].to(device),
                position_ids=positions[:, start:stop].to(device),
                past_key_values=cache,
                use_cache=cache is not None,
            ).last_hidden_state
            for i, at in enumerate(last):
                if start <= at < stop:
                    reads[i] = hidden[i, at - start]
            del hidden
        return model.get_output_embeddings()(torch.stack(reads)).float()
