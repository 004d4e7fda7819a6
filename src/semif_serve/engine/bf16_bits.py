"""bf16 values read and written as their 16 bits by the engine's compiled CPU kernels (numba has
no bf16): a float32 rounded to nearest even, as torch rounds, a NaN kept a NaN.

The bit steps are LLVM IR on 32-bit integers (numba intrinsics), so a loop over them vectorises:
numba widens a uint32's arithmetic to 64 bits, which halves the vector width, and a float compare
under fastmath may assume no NaN, so a NaN is found on its bits.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from semif_serve.engine.compiled_parts import compiled

_I16, _I32, _F32 = ir.IntType(16), ir.IntType(32), ir.FloatType()


@intrinsic
def value_of(typingctx: Any, bits: Any) -> Any:
    """The bf16 whose bits are the uint16 `bits`, as float32."""
    if bits != types.uint16:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        wide = builder.shl(builder.zext(args[0], _I32), ir.Constant(_I32, 16))
        return builder.bitcast(wide, _F32)

    return types.float32(types.uint16), codegen


@intrinsic
def rounded(typingctx: Any, value: Any) -> Any:
    """float32 `value` rounded to bf16, as its uint16 bits."""
    if value != types.float32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        bits = builder.bitcast(args[0], _I32)
        magnitude = builder.and_(bits, ir.Constant(_I32, 0x7FFFFFFF))
        nan = builder.icmp_unsigned(">", magnitude, ir.Constant(_I32, 0x7F800000))
        odd = builder.and_(builder.lshr(bits, ir.Constant(_I32, 16)), ir.Constant(_I32, 1))
        nearest = builder.add(builder.add(bits, ir.Constant(_I32, 0x7FFF)), odd)
        upper = builder.trunc(builder.lshr(nearest, ir.Constant(_I32, 16)), _I16)
        return builder.select(nan, ir.Constant(_I16, 0x7FC0), upper)

    return types.uint16(types.float32), codegen


def bits_of(tensor: Any) -> Any:
    """A bf16 torch tensor's values as a uint16 numpy view of their bits (any strides, no copy)."""
    import numpy as np
    import torch

    return tensor.view(torch.int16).numpy().view(np.uint16)


@compiled
def store_rounded(values, target):
    """`values` (float32) into `target` (uint16) as bf16 bits."""
    for c in range(target.shape[0]):
        target[c] = rounded(values[c])
