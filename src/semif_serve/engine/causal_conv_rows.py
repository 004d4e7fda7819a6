"""Qwen3.5's causal convolution on the CPU for a bf16 model, compiled (numba): one pass from the
projection's bf16 output to the convolution's bf16 output, where the torch form took five over
float32 intermediates (a product, three multiply-adds, a rounding); or, for the packed forward's
gated delta rule, to its SiLU's float32 input (`convolve_bf16_silu`), where torch took two more
passes and a copy.

For each token and channel: the sum of its `kernel` taps times the inputs up to it (zeros before
the first), most recent first, plus the bias, in float32, rounded once to bf16 to nearest even
(as torch rounds); a NaN stays a NaN. The bf16 values are read and written as their 16 bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from semif_serve.engine.bf16_bits import rounded, value_of
from semif_serve.engine.bf16_passes import silu
from semif_serve.engine.compiled_parts import compiled, run_split

_SPLIT_AT = 64 * 1024  # values: below this a call runs on the calling thread alone


@compiled
def _sum(x, taps, bias, b, t, total):
    """`total[c]`: token t of batch row b convolved (see the module docstring), in float32."""
    kernel = taps.shape[0]
    for c in range(total.shape[0]):
        total[c] = 0.0
    for back in range(min(kernel, t + 1)):
        row = x[b, t - back]
        tap = taps[kernel - 1 - back]
        for c in range(total.shape[0]):
            total[c] += tap[c] * value_of(row[c])
    for c in range(total.shape[0]):
        total[c] += bias[c]


@compiled
def _tokens(x, taps, bias, out, lo, hi):
    """Tokens `lo:hi` (batch row times tokens + token) of the convolution, as bf16 bits."""
    tokens = x.shape[1]
    total = np.empty(x.shape[2], np.float32)
    for item in range(lo, hi):
        b, t = item // tokens, item % tokens
        _sum(x, taps, bias, b, t, total)
        for c in range(total.shape[0]):
            out[b, t, c] = rounded(total[c])


@compiled
def _tokens_silu(x, taps, bias, out, skip, lo, hi):
    """Output tokens `lo:hi` of the convolution from input token `skip` on, each rounded to
    bf16, its SiLU rounded to bf16 (as torch's bf16 SiLU), written as float32."""
    tokens = out.shape[1]
    total = np.empty(x.shape[2], np.float32)
    for item in range(lo, hi):
        b, t = item // tokens, item % tokens
        _sum(x, taps, bias, b, t + skip, total)
        for c in range(total.shape[0]):
            out[b, t, c] = value_of(rounded(silu(value_of(rounded(total[c])))))


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


def convolve_bf16_silu(x_bits: Any, taps: Any, bias: Any, skip: int, threads: int) -> Any:
    """As `convolve_bf16`, then SiLU, for tokens `skip:` only (the first `skip` are inputs from
    before, convolved over but not output): `[batch, tokens - skip, channels]` float32 of bf16
    values, as the gated delta rule reads them."""
    batch, tokens, channels = x_bits.shape
    out = np.empty((batch, tokens - skip, channels), dtype=np.float32)

    def part(lo: int, hi: int) -> None:
        _tokens_silu(x_bits, taps, bias, out, skip, lo, hi)

    run_split(part, batch * (tokens - skip), threads, min_items=max(1, _SPLIT_AT // max(1, channels)))
    return out
