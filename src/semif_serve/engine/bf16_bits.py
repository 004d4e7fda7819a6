"""bf16 values written as their 16 bits by the engine's compiled CPU kernels (numba has no bf16):
a float32 rounded to nearest even, as torch rounds, a NaN kept a NaN."""

from __future__ import annotations

import numpy as np

from semif_serve.engine.compiled_parts import compiled

_BF16_NAN = 0x7FC0


@compiled
def store_rounded(values, bits, target):
    """`values` (float32; `bits`, the same memory as uint32) into `target` (uint16) as bf16 bits."""
    for c in range(target.shape[0]):
        u = bits[c]
        rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        target[c] = np.uint16(_BF16_NAN) if values[c] != values[c] else np.uint16(rounded)
