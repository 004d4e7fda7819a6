"""Qwen3.5's linear-attention kernels on the CPU, the same arithmetic as transformers' reference
torch code laid out for a CPU: the GPU image uses flash-linear-attention and causal-conv1d,
which have no CPU build, and the reference fallbacks spend most of a short forward outside
the arithmetic (measured in bench/RESULTS.md, "Linear attention on the CPU").

What differs from the reference, and why each is exact to float32 rounding:
- the gated delta rule runs as its recurrence, compiled (`engine.delta_rule_rows`: why, and
  how it is laid out), not as the reference's chunks: the same sums in another order; the key
  products are computed once per key head, not per value head after a repeat; decays under
  exp(-50) (~2e-22) are exactly 0 (a term that small cannot move a float32 sum, and its
  products would be subnormals, on which every op takes the CPU's slow path);
- the causal convolution runs on the `[batch, tokens, channels]` layout the projection wrote
  (the reference transposed to `[batch, channels, tokens]` first: a copy at a 4 KiB stride),
  its float32 sum rounded once to the weights' dtype: for a bf16 model compiled, one pass from
  bf16 to bf16 (`engine.causal_conv_rows`), else as K shifted multiply-adds in float32;
- subnormal floats are flushed to zero while the decoder runs (`torch.set_flush_denormal`): with
  strong decays the state's terms fall under 1e-38, where every CPU op takes a slow path.

`accelerate(model)` switches one model's decoder onto these kernels with forward hooks (the
decoder's own class forward still runs, as code that patches it expects); any other model in the
process (the tests' references) keeps transformers' code.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

log = logging.getLogger("semif_serve.engine")

# How many accelerated decoders are running in this context (each engine thread has its own).
_ACTIVE: contextvars.ContextVar[int] = contextvars.ContextVar("semif_cpu_linear_attention", default=0)
# The module-level names the reference layer's forward calls, and their replacements here.
_KERNEL_NAMES = ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")
_LAYER_CLASS = "Qwen3_5GatedDeltaNet"


def gated_delta_rule(
    query: Any,
    key: Any,
    value: Any,
    g: Any,
    beta: Any,
    initial_state: Any | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    lengths: Sequence[int] | None = None,
    into: tuple[Any, Sequence[int]] | None = None,
    **kwargs: Any,
) -> tuple[Any | None, Any | None]:
    """transformers' `torch_chunk_gated_delta_rule`, same arguments and results
    (`[batch, tokens, v_heads, v_dim]` in the value's dtype, the float32 state or None), run as
    the compiled recurrence of `engine.delta_rule_rows`. The query and key may hold fewer heads
    than the value (each shared by consecutive value heads, as `repeat_interleave` would lay them
    out), so callers need not repeat them; `lengths` (per batch row) stops each row after its own
    tokens: the state returned is the one at its end, and the output after it is zeros. `into`
    (a packed forward's `[n, v_heads, v_dim]` float32 or bf16 tensor, and each batch row's first
    row in it): the output is written there, rounded once to its dtype, and None returned."""
    import numpy as np
    import torch

    from semif_serve.engine.bf16_bits import bits_of
    from semif_serve.engine.delta_rule_rows import recurrence

    batch, tokens, _, k_dim = key.shape
    v_heads, v_dim = value.shape[2], value.shape[3]
    if initial_state is None:
        state_t = torch.zeros(batch, v_heads, v_dim, k_dim, dtype=torch.float32)
    else:
        state_t = _copied(initial_state.transpose(-1, -2), torch.float32)
    counts = np.asarray(lengths if lengths is not None else [tokens] * batch, dtype=np.int64)
    q, k, v, decays, rates = (t.float().numpy() for t in (query, key, value, g, beta))  # views if float32
    threads = torch.get_num_threads()
    arrays = (q, k, v, decays, rates, counts, state_t.numpy(), threads, use_qk_l2norm_in_kernel)
    final = state_t.transpose(-1, -2) if output_final_state else None
    if into is not None:
        target, starts = into
        if target.dtype not in (torch.float32, torch.bfloat16) or not target.is_contiguous():
            raise ValueError("the rule writes into a contiguous float32 or bf16 tensor")
        bf16 = target.dtype == torch.bfloat16
        rows = bits_of(target) if bf16 else target.numpy()
        recurrence(*arrays, into=(rows, starts))
        return None, final
    return torch.from_numpy(recurrence(*arrays)).to(value.dtype), final


def _copied(tensor: Any, dtype: Any) -> Any:
    """A contiguous copy of `tensor` in `dtype`: one pass, whatever the strides and dtypes."""
    import torch

    out = torch.empty(tensor.shape, dtype=dtype, device=tensor.device)
    return out.copy_(tensor)


def causal_conv1d(
    hidden_states: Any, weight: Any, bias: Any | None = None, activation: str | None = None, **kwargs: Any
) -> Any:
    """transformers' `causal_conv1d_fn`: the depthwise causal convolution of `[batch, channels,
    tokens]` (zero left padding), optionally activated; returns the same layout (a view of a
    `[batch, tokens, channels]` tensor)."""
    import numpy as np
    import torch
    from transformers.activations import ACT2FN

    x = hidden_states.transpose(1, 2)  # a view when the projection wrote [b, t, c]
    taps, shift = _taps(weight, bias)
    kernel, tokens = taps.shape[0], x.shape[1]
    if x.dtype == weight.dtype == torch.bfloat16:
        from semif_serve.engine.bf16_bits import bits_of
        from semif_serve.engine.causal_conv_rows import convolve_bf16

        bits = convolve_bf16(bits_of(x), taps.numpy(), shift.numpy(), torch.get_num_threads())
        out = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
        if activation is not None:
            out = ACT2FN[activation](out)
        return out.transpose(1, 2)
    out = x * taps[kernel - 1]  # float32: each product of the input's dtype rounds once, no copy first
    for shift in range(1, min(kernel, tokens)):
        out[:, shift:].addcmul_(x[:, : tokens - shift], taps[kernel - 1 - shift])
    if bias is not None:
        out += bias.to(torch.float32)
    out = out.to(weight.dtype)
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(hidden_states.dtype).transpose(1, 2)


def causal_conv1d_silu(inputs: Any, weight: Any, bias: Any | None, skip: int) -> Any:
    """The packed forward's convolution before the CPU's gated delta rule, for a bf16 model:
    bf16 `inputs` `[batch, tokens, channels]` (the first `skip` the inputs of what each row
    continues) convolved by the depthwise `weight` `[channels, kernel]` and SiLU'd, each rounded
    to bf16 as `causal_conv1d` rounds them; float32 `[batch, tokens - skip, channels]`, as the
    rule reads it (engine.causal_conv_rows)."""
    import torch

    from semif_serve.engine.bf16_bits import bits_of
    from semif_serve.engine.causal_conv_rows import convolve_bf16_silu

    taps, shift = _taps(weight, bias)
    out = convolve_bf16_silu(bits_of(inputs), taps.numpy(), shift.numpy(), skip, torch.get_num_threads())
    return torch.from_numpy(out)


def _taps(weight: Any, bias: Any | None) -> tuple[Any, Any]:
    """A depthwise convolution's `[channels, kernel]` weight as float32 `[kernel, channels]`,
    and its bias as float32 (zeros where it has none)."""
    import torch

    taps = weight.to(torch.float32).t().contiguous()
    return taps, bias.to(torch.float32) if bias is not None else torch.zeros(taps.shape[1])


def _dispatching(reference: Callable[..., Any], own: Callable[..., Any]) -> Callable[..., Any]:
    """`reference` everywhere except inside an accelerated decoder on the CPU."""

    @functools.wraps(reference)
    def chosen(*args: Any, **kwargs: Any) -> Any:
        if _ACTIVE.get() and args[0].device.type == "cpu":
            return own(*args, **kwargs)
        return reference(*args, **kwargs)

    chosen.__semif_reference__ = reference  # type: ignore[attr-defined]
    return chosen


def _install(module: Any) -> bool:
    """Route the modeling module's kernel names through `_dispatching` (once per process)."""
    own: dict[str, Callable[..., Any]] = {
        "torch_chunk_gated_delta_rule": gated_delta_rule,
        "causal_conv1d_fn": causal_conv1d,
    }
    if not all(callable(getattr(module, name, None)) for name in _KERNEL_NAMES):
        return False
    for name in _KERNEL_NAMES:
        current = getattr(module, name)
        if not hasattr(current, "__semif_reference__"):
            setattr(module, name, _dispatching(current, own[name]))
    return True


def _entered(_module: Any, _args: Any) -> None:
    import torch

    _ACTIVE.set(_ACTIVE.get() + 1)
    # Subnormals flushed to zero on this thread while the decoder runs (the CPU's slow path).
    torch.set_flush_denormal(True)


def _left(_module: Any, _args: Any, _output: Any) -> None:
    import torch

    depth = _ACTIVE.get() - 1
    _ACTIVE.set(depth)
    if depth == 0:
        torch.set_flush_denormal(False)


@contextlib.contextmanager
def accelerated_kernels(decoder: Any) -> Iterator[tuple[Callable[..., Any], Callable[..., Any]]]:
    """The gated delta rule and the causal convolution a forward outside the decoder's own code
    (`engine.packed`) calls: these kernels, with subnormals flushed, where `accelerate` switched
    the decoder and it runs on the CPU; else the modeling code's own (flash-linear-attention's
    on a GPU image)."""
    import sys

    on_cpu = next(decoder.parameters()).device.type == "cpu"
    if on_cpu and getattr(decoder, "__semif_accelerated__", False):
        _entered(decoder, ())
        try:
            yield gated_delta_rule, causal_conv1d
        finally:
            _left(decoder, (), None)
        return
    module = sys.modules[type(decoder).__module__]
    yield module.torch_chunk_gated_delta_rule, module.causal_conv1d_fn


def accelerate(model: Any) -> int:
    """Run this model's decoder on the kernels above (on the CPU), with subnormal floats flushed
    to zero while it runs; returns how many linear-attention layers that covers (0: the modeling
    code is not the one these match, and nothing changed)."""
    import sys

    decoder = model.get_decoder()
    layers = [m for m in decoder.modules() if type(m).__name__ == _LAYER_CLASS]
    if not layers:
        return 0
    if not _install(sys.modules[type(layers[0]).__module__]):
        log.warning(
            "linear attention stays on transformers' CPU code: its kernel names are not the ones expected"
        )
        return 0
    if not getattr(decoder, "__semif_accelerated__", False):
        # Hooks, not a wrapped forward: the class's forward stays the one that runs.
        decoder.register_forward_pre_hook(_entered)
        decoder.register_forward_hook(_left, always_call=True)
        decoder.__semif_accelerated__ = True
        log.info("linear attention on the engine's CPU kernels: %d layers", len(layers))
    return len(layers)
