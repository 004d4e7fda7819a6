"""The gated delta rule's recurrence on the CPU, compiled (numba): one token at a time per
(sequence, value head) row, the state kept in the core's L1 cache, rows split across threads.

Why a recurrence and not chunks: Qwen3.5's heads are small (64 x 64 states), and on this CPU
the chunked form's many small batched products, triangular solves and elementwise passes ran
at a fraction of the matmul peak; the recurrence does fewer operations per token (four passes
over the state) as vectorised loops over contiguous rows, ~2x faster on a packed forward
(bench/RESULTS.md, docs/packing.md). It is the reference's recurrent rule
(transformers' `torch_recurrent_gated_delta_rule`), token by token:

    S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  out = S^T q

with the decay applied after the key's product (one pass fewer), the output read from the state
before this token's write (`S'^T q = exp(g) S^T q + (k . q) delta`: both products in one pass
over the state, and the write no longer waits on a sum), and decays under exp(-50) taken as
exactly 0, as the chunked kernel did: a term that small cannot move a float32 sum,
and its products would be subnormals (every op on one takes the CPU's slow path).

The state is held transposed, `[value dim, key dim]`, so each value column's key row is
contiguous. Rows are split across the forward's threads (`engine.compiled_parts`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from semif_serve.engine.bf16_bits import store_rounded
from semif_serve.engine.compiled_parts import compiled, run_split

SMALLEST_DECAY_LOG = -50.0  # exp(-50) ~ 2e-22: a term that small cannot move a float32 sum
# Each part at least this many token-rows (below it a call runs on the calling thread alone): a
# lone ~250-token prompt's value heads still run on both threads (docs/packing.md).
_SPLIT_AT = 512


@compiled
def _unit(source, into, normed, scale):
    """`source` (any strides) into the contiguous `into`, scaled to unit length if `normed` (the
    reference's l2 norm, eps 1e-6), then times `scale`. The sum reads `into`, so its order (and
    rounding) is the same whatever the source's strides."""
    for i in range(into.shape[0]):
        into[i] = source[i]
    total = np.float32(0.0)
    for i in range(into.shape[0]):
        total += into[i] * into[i]
    factor = np.float32(scale)
    if normed:
        factor = factor / np.float32(math.sqrt(total + np.float32(1e-6)))
    for i in range(into.shape[0]):
        into[i] *= factor


@compiled
def _rows(q, k, v, g, beta, lengths, state_t, out, starts, as_bits, lo, hi, smallest, normed):
    """Rows `lo:hi` (batch row times value heads + head) of the rule: see the module docstring.
    Batch row b's token t is written to `out[starts[b] + t, head]`, as float32 or as bf16 bits
    (`as_bits`, `out` of uint16: rounded to nearest even, as torch rounds). Every token runs the same loops
    whatever came before it in this call, so a run continued from a stored state gives the bits
    of one unbroken run."""
    _, _, key_heads, key_dim = k.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    share = value_heads // key_heads
    scale = np.float32(key_dim**-0.5)
    key = np.empty(key_dim, np.float32)
    query = np.empty(key_dim, np.float32)
    result = np.empty(value_dim, np.float32)
    for r in range(lo, hi):
        b, h = r // value_heads, r % value_heads
        hk = h // share
        state = state_t[b, h]
        for t in range(lengths[b]):
            _unit(k[b, t, hk], key, normed, 1.0)
            _unit(q[b, t, hk], query, normed, scale)
            key_query = np.float32(0.0)
            for i in range(key_dim):
                key_query += key[i] * query[i]
            log_decay = g[b, t, h]
            decay = np.float32(math.exp(log_decay)) if log_decay >= smallest else np.float32(0.0)
            rate = beta[b, t, h]
            value = v[b, t, h]
            for j in range(value_dim):
                column = state[j]
                keyed = np.float32(0.0)  # S^T k and S^T q, both before the decay, in one pass
                queried = np.float32(0.0)
                for i in range(key_dim):
                    keyed += column[i] * key[i]
                    queried += column[i] * query[i]
                delta = (value[j] - decay * keyed) * rate
                result[j] = decay * queried + key_query * delta
                for i in range(key_dim):
                    column[i] = decay * column[i] + delta * key[i]
            row_out = out[starts[b] + t, h]
            if as_bits:
                store_rounded(result, row_out)
            else:
                for j in range(value_dim):
                    row_out[j] = result[j]


def recurrence(
    query: Any,
    key: Any,
    value: Any,
    g: Any,
    beta: Any,
    lengths: Any,
    state_t: Any,
    threads: int,
    normed: bool,
    into: tuple[Any, Any] | None = None,
) -> Any:
    """Run the rule over `[batch, tokens, heads, dim]` float32 numpy arrays of any strides (query
    and key may hold fewer heads than the value, each shared by consecutive value heads; both
    scaled to unit length first if `normed`, the query then by `k_dim ** -0.5`), from and into
    `state_t` `[batch, v_heads, v_dim, k_dim]`, each row b stopping after `lengths[b]` tokens.
    Returns the float32 output `[batch, tokens, v_heads, v_dim]`, zeros past each row's length;
    or, given `into` (`out` `[n, v_heads, v_dim]` float32 or bf16 bits as uint16, and `starts`),
    writes row b's token t to `out[starts[b] + t]` (a packed forward's rows) and returns None."""
    batch, tokens = value.shape[0], value.shape[1]
    rows = batch * value.shape[2]
    if into is None:
        out = np.zeros((batch * tokens, *value.shape[2:]), dtype=np.float32)
        starts = np.arange(batch, dtype=np.int64) * tokens
    else:
        out, starts = into
    at = np.asarray(starts, dtype=np.int64)
    arrays = (query, key, value, g, beta, lengths, state_t, out, at, out.dtype == np.uint16)

    def part(lo: int, hi: int) -> None:
        _rows(*arrays, lo, hi, SMALLEST_DECAY_LOG, normed)

    run_split(part, rows, threads, min_items=max(1, _SPLIT_AT // max(1, tokens)))
    return out.reshape(value.shape) if into is None else None
