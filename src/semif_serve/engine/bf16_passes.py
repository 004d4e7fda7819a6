"""Qwen3.5's elementwise passes over a bf16 model's packed rows on the CPU, compiled (numba): one
pass each, where torch runs one per operation over float32 intermediates (the RMS norm ten, the
gated norm nine), with each float32 result rounded to bf16 where transformers' module rounds it:

- `rms_norm`: the decoder's norm (`Qwen3_5RMSNorm`): `x / rms(x) * (1 + w)` in float32, rounded once;
- `gated_norm`: a linear-attention layer's (`Qwen3_5RMSNormGated`): `x / rms(x)` rounded, times `w`
  rounded, times `silu(gate)` in float32, rounded;
- `silu_times`: the MLP's `silu(gate)` rounded, times `up`, rounded, into the gate's rows.

Two things differ from torch's arithmetic, each within float32 rounding: the sum of squares is
added in this loop's order, and SiLU's `exp` is Cephes' `expf` (a degree-5 polynomial after
Cody-Waite range reduction, ~1 ulp) written out so the loops vectorise: numba's own `exp` calls
libm once per value, ~10x torch's vectorised SiLU (bench/RESULTS.md). A bf16 result can thus
differ from transformers' by one unit in its last place where the float32 value lies next to a
rounding boundary (tests/engine/test_bf16_passes.py bounds both against float64).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from semif_serve.engine.bf16_bits import bits_of, rounded, value_of
from semif_serve.engine.compiled_parts import compiled, run_split

_SPLIT_AT = 64 * 1024  # values: below this a call runs on the calling thread alone

# Cephes' expf: exp(t) = 2^k * p(r), r = t - k ln 2 (ln 2 split in two for an exact product).
_LOG2E = np.float32(1.44269504088896341)
_LN2_HIGH = np.float32(0.693359375)
_LN2_LOW = np.float32(-2.12194440e-4)
_P0, _P1, _P2 = np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3)
_P3, _P4, _P5 = np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1)
# -x is clamped to [-87, 88] (exp stays a normal float): past it SiLU is x or 0 to float32 rounding.
_LOW, _HIGH = np.float32(-87.0), np.float32(88.0)
_HALF, _ONE = np.float32(0.5), np.float32(1.0)


@intrinsic
def _power_of_two(typingctx: Any, k: Any) -> Any:
    """2^k for a whole float32 `k` in [-126, 127], built from its exponent bits (in 32-bit IR, so
    the loop vectorises: see `engine.bf16_bits`)."""
    if k != types.float32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i32 = ir.IntType(32)
        biased = builder.add(builder.fptosi(args[0], i32), ir.Constant(i32, 127))
        return builder.bitcast(builder.shl(biased, ir.Constant(i32, 23)), ir.FloatType())

    return types.float32(types.float32), codegen


@compiled
def silu(x):
    """x / (1 + exp(-x)) in float32, exp as Cephes' expf (see the module docstring)."""
    t = min(max(-x, _LOW), _HIGH)
    k = np.floor(t * _LOG2E + _HALF)
    r = t - k * _LN2_HIGH - k * _LN2_LOW
    p = ((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5
    e = p * (r * r) + r + _ONE
    return x / (_ONE + e * _power_of_two(k))


@compiled
def silu_values(values, out):
    """`out[i] = silu(values[i])` over float32 arrays: the passes' own SiLU, on its own."""
    for i in range(values.shape[0]):
        out[i] = silu(values[i])


@compiled
def _inverse_rms(x, r, eps):
    """1 / sqrt(mean(x[r]^2) + eps) over the bf16 bits of row r, in float32."""
    total = np.float32(0.0)
    for c in range(x.shape[1]):
        v = value_of(x[r, c])
        total += v * v
    return _ONE / np.sqrt(total / np.float32(x.shape[1]) + eps)


@compiled
def _rms_rows(x, weight, eps, out, lo, hi):
    for r in range(lo, hi):
        factor = _inverse_rms(x, r, eps)
        for c in range(x.shape[1]):
            out[r, c] = rounded(value_of(x[r, c]) * factor * weight[c])


@compiled
def _gated_rows(x, gate, weight, eps, out, lo, hi):
    for r in range(lo, hi):
        factor = _inverse_rms(x, r, eps)
        for c in range(x.shape[1]):
            weighted = value_of(rounded(weight[c] * value_of(rounded(value_of(x[r, c]) * factor))))
            out[r, c] = rounded(weighted * silu(value_of(gate[r, c])))


@compiled
def _silu_times_rows(gate, up, lo, hi):
    for r in range(lo, hi):
        for c in range(gate.shape[1]):
            active = value_of(rounded(silu(value_of(gate[r, c]))))
            gate[r, c] = rounded(active * value_of(up[r, c]))


def applies(x: Any) -> bool:
    """Whether these passes take `x`: bf16 rows `[n, d]` on the CPU, each row contiguous."""
    import torch

    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2 and x.stride(-1) == 1


def rms_norm(x: Any, weight: Any, eps: float) -> Any:
    """`Qwen3_5RMSNorm` of bf16 rows `x` `[n, d]`: a new bf16 tensor (`weight` the module's own,
    applied as `1 + weight`)."""
    import torch

    scale = (1.0 + weight.detach().float()).numpy()
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    bits, out_bits = bits_of(x), bits_of(out)
    _split(lambda lo, hi: _rms_rows(bits, scale, np.float32(eps), out_bits, lo, hi), x)
    return out


def gated_norm(x: Any, gate: Any, weight: Any, eps: float) -> Any:
    """`Qwen3_5RMSNormGated` (SiLU) of bf16 rows `x` and `gate` `[n, d]`: a new bf16 tensor."""
    import torch

    scale = weight.detach().float().numpy()
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    bits, gate_bits, out_bits = bits_of(x), bits_of(gate), bits_of(out)
    _split(lambda lo, hi: _gated_rows(bits, gate_bits, scale, np.float32(eps), out_bits, lo, hi), x)
    return out


def silu_times(gate: Any, up: Any) -> Any:
    """The MLP's `silu(gate) * up` over bf16 rows `[n, d]`, written into `gate` (returned)."""
    gate_bits, up_bits = bits_of(gate), bits_of(up)
    _split(lambda lo, hi: _silu_times_rows(gate_bits, up_bits, lo, hi), gate)
    return gate


def _split(work: Any, x: Any) -> None:
    import torch

    rows, width = x.shape
    run_split(work, rows, torch.get_num_threads(), min_items=max(1, _SPLIT_AT // max(1, width)))
