"""Qwen3.5's causal convolution on the CPU for a bf16 model, compiled (numba): one pass from the
projection's bf16 output to the convolution's bf16 output, where the torch form took five over
float32 intermediates (a product, three multiply-adds, a rounding).

For each token and channel: the sum of its `kernel` taps times the inputs up to it (zeros before
the first), most recent first, plus the bias, in float32, rounded once to bf16 to nearest even
(as torch rounds); a NaN stays a NaN. The bf16 values are read and written as their 16 bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from semif_serve.engine.bf16_bits import store_rounded
from semif_serve.engine.compiled_parts import compiled, run_split

_SPLIT_AT = 64 * 1024  # values: below this a call runs on the calling thread alone


@compiled
def _tokens(x, taps, bias, out, lo, hi):
    """Tokens `lo:hi` (batch row times tokens + token) of the convolution: see the module docstring."""
    tokens, channels = x.shape[1], x.shape[2]
    kernel = taps.shape[0]
    bits = np.empty(channels, np.uint32)
    values = bits.view(np.float32)
    total = np.empty(channels, np.float32)
    total_bits = total.view(np.uint32)
    for item in range(lo, hi):
        b, t = item // tokens, item % tokens
        for c in range(channels):
            total[c] = 0.0
        for back in range(min(kernel, t + 1)):
            row = x[b, t - back]
            tap = taps[kernel - 1 - back]
            for c in range(channels):
                bits[c] = np.uint32(row[c]) << np.uint32(16)
            for c in range(channels):
                total[c] += tap[c] * values[c]
        for c in range(channels):
            total[c] += bias[c]
        store_rounded(total, total_bits, out[b, t])


def convolve_bf16(x_bits: Any, taps: Any, bias: Any, threads: int) -> Any:
    """The convolution of `x_bits` (`[batch, tokens, channels]` bf16 as uint16, any strides) by
    `taps` (`[kernel, channels]` float32, the last tap on the current token) plus `bias`
    (`[channels]` float32): `[batch, tokens, channels]` bf16 as uint16."""
    batch, tokens, channels = x_bits.shape
    out = np.empty((batch, tokens, channels), dtype=np.uint16)

    def part(lo: int, hi: int) -> None:
        _tokens(x_bits, taps, bias, out, lo, hi)

    run_split(part, batch * tokens, threads, min_items=max(1, _SPLIT_AT // max(1, channels)))
    return out
