"""The gated delta rule's recurrence on the CPU, compiled (numba): one token at a time per
(sequence, value head) row, the state kept in the core's L1 cache, rows split across threads.

Why a recurrence and not chunks: Qwen3.5's heads are small (64 x 64 states), and on this CPU
the chunked form's many small batched products, triangular solves and elementwise passes ran
at a fraction of the matmul peak; the recurrence does fewer operations per token (four passes
over the state) as vectorised loops over contiguous rows, ~2x faster on a packed forward
(bench/RESULTS.md, docs/packing.md). It is the reference's recurrent rule
(transformers' `torch_recurrent_gated_delta_rule`), token by token:

    S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  out = S^T q

with the decay applied after the key's product (one pass fewer), and decays under exp(-50)
taken as exactly 0, as the chunked kernel did: a term that small cannot move a float32 sum,
and its products would be subnormals (every op on one takes the CPU's slow path).

The state is held transposed, `[value dim, key dim]`, so each value column's key row is
contiguous. Worker threads flush subnormals to zero for their whole life (they run only this).
"""

from __future__ import annotations

import logging
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numba
import numpy as np

log = logging.getLogger("semif_serve.engine")

SMALLEST_DECAY_LOG = -50.0  # exp(-50) ~ 2e-22: a term that small cannot move a float32 sum
# Below this many token-rows a call runs on the calling thread alone: handing work to another
# thread costs more than it saves.
_SPLIT_AT = 2048

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _compiled(function: Any) -> Any:
    """`function` compiled at first use, and cached on disk where numba finds a writable place
    (beside this file, else NUMBA_CACHE_DIR or ~/.cache/numba); else compiled anew each start."""
    try:
        return numba.njit(cache=True, nogil=True, fastmath=True, boundscheck=False)(function)
    except RuntimeError:  # numba found no writable cache directory
        log.warning("the gated delta rule's compiled kernel is not cached: no writable cache directory")
        return numba.njit(cache=False, nogil=True, fastmath=True, boundscheck=False)(function)


@_compiled
def _rows(q, k, v, g, beta, lengths, state_t, out, lo, hi, smallest):
    """Rows `lo:hi` (batch row times value heads + head) of the rule: see the module docstring."""
    _, tokens, key_heads, key_dim = k.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    share = value_heads // key_heads
    key_state = np.empty(value_dim, np.float32)  # S^T k of the token to come, before its decay
    for r in range(lo, hi):
        b, h = r // value_heads, r % value_heads
        hk = h // share
        state = state_t[b, h]
        length = lengths[b]
        for t in range(length, tokens):
            out[b, t, h, :] = 0.0
        if length == 0:
            continue
        first = k[b, 0, hk]
        for j in range(value_dim):
            column = state[j]
            total = np.float32(0.0)
            for i in range(key_dim):
                total += column[i] * first[i]
            key_state[j] = total
        for t in range(length):
            log_decay = g[b, t, h]
            decay = np.float32(math.exp(log_decay)) if log_decay >= smallest else np.float32(0.0)
            rate = beta[b, t, h]
            key, query, value, row_out = k[b, t, hk], q[b, t, hk], v[b, t, h], out[b, t, h]
            ahead = k[b, t + 1, hk] if t + 1 < length else key
            for j in range(value_dim):
                column = state[j]
                delta = (value[j] - decay * key_state[j]) * rate
                read = np.float32(0.0)
                next_read = np.float32(0.0)
                for i in range(key_dim):
                    s = decay * column[i] + delta * key[i]
                    column[i] = s
                    read += query[i] * s
                    next_read += ahead[i] * s
                row_out[j] = read
                key_state[j] = next_read


def _threads_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                max_workers=max(1, (os.cpu_count() or 1) - 1),
                thread_name_prefix="semif-delta-rule",
                initializer=_flush_subnormals,
            )
        return _pool


def _flush_subnormals() -> None:
    import torch

    torch.set_flush_denormal(True)


def recurrence(
    query: Any, key: Any, value: Any, g: Any, beta: Any, lengths: Any, state_t: Any, threads: int
) -> Any:
    """Run the rule over `[batch, tokens, heads, dim]` float32 C-contiguous numpy arrays (query
    and key may hold fewer heads than the value, each shared by consecutive value heads; the
    query already scaled), from and into `state_t` `[batch, v_heads, v_dim, k_dim]`, row b's
    tokens from `lengths[b]` on left as zeros; returns the float32 output `[batch, tokens,
    v_heads, v_dim]`."""
    batch, tokens = value.shape[0], value.shape[1]
    rows = batch * value.shape[2]
    out = np.empty(value.shape, dtype=np.float32)
    parts = max(1, min(threads, rows, rows * tokens // _SPLIT_AT))
    cuts = [rows * p // parts for p in range(parts + 1)]

    def part(p: int) -> None:
        _rows(query, key, value, g, beta, lengths, state_t, out, cuts[p], cuts[p + 1], SMALLEST_DECAY_LOG)

    others = [_threads_pool().submit(part, p) for p in range(1, parts)] if parts > 1 else []
    part(0)
    for other in others:
        other.result()
    return out
