"""Qwen3.5's linear-attention kernels on the CPU, the same arithmetic as transformers' reference
torch code laid out for a CPU: the GPU image uses flash-linear-attention and causal-conv1d,
which have no CPU build, and the reference fallbacks spend most of a short forward outside
the arithmetic (measured in bench/RESULTS.md, "Linear attention on the CPU").

What differs from the reference, and why each is exact to float32 rounding:
- the gated delta rule runs its per-chunk scan on chunk-major contiguous blocks (a strided
  64x64 slice made each of the scan's matmuls ~2x slower), reads the old state for the keys and
  the queries in one matmul, and solves the chunk's triangular system once for both right-hand
  sides;
- the last chunk is as long as the tokens left, not padded to 64 (the padded rows were zeros
  that only cost work: zero keys, values and gates);
- decays below exp(-87) (1.6e-38, the edge of float32's normal range) are 0, not subnormals:
  the reference's `exp` and every product after it take a slow path on subnormals, and a term
  under 1e-37 cannot move a float32 sum of terms over 1e-30;
- the causal convolution runs on the `[batch, tokens, channels]` layout the projection wrote,
  as K shifted multiply-adds in float32 rounded once to the weights' dtype (the reference
  transposed to `[batch, channels, tokens]` first: a copy at a 4 KiB stride);
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
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("semif_serve.engine")

# How many accelerated decoders are running in this context (each engine thread has its own).
_ACTIVE: contextvars.ContextVar[int] = contextvars.ContextVar("semif_cpu_linear_attention", default=0)
# The module-level names the reference layer's forward calls, and their replacements here.
_KERNEL_NAMES = ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")
_LAYER_CLASS = "Qwen3_5GatedDeltaNet"
_SMALLEST_DECAY_LOG = -87.0  # exp(-87) ~ 1.6e-38: smaller decays are subnormal in float32


def decay_exp(log_decay: Any) -> Any:
    """exp of a log-decay (<= 0), with decays under exp(-87) as 0 instead of subnormals."""
    too_small = log_decay < _SMALLEST_DECAY_LOG
    return log_decay.clamp(min=_SMALLEST_DECAY_LOG).exp_().masked_fill_(too_small, 0.0)


def _chunk_terms(query: Any, key: Any, value: Any, log_decay: Any, beta: Any) -> dict[str, Any]:
    """The intra-chunk quantities of equal-length chunks, given and returned chunk-major
    (`[chunks, rows, length, dim]`, contiguous) for the scan."""
    import torch

    length = query.shape[-2]
    cumulative = log_decay.cumsum(dim=-1)  # [chunks, rows, length]
    later = torch.ones(length, length, dtype=torch.bool, device=query.device).triu(1)
    pairwise = (cumulative.unsqueeze(-1) - cumulative.unsqueeze(-2)).masked_fill_(later, 0.0)
    pairwise = decay_exp(pairwise).masked_fill_(later, 0.0)
    k_beta = key * beta.unsqueeze(-1)
    from_start = decay_exp(cumulative).unsqueeze(-1)
    ut_system = (k_beta @ key.transpose(-1, -2)).mul_(pairwise)
    intra = (query @ key.transpose(-1, -2)).mul_(pairwise)
    right = torch.cat([value * beta.unsqueeze(-1), k_beta * from_start], dim=-1)
    solved = torch.linalg.solve_triangular(ut_system, right, upper=False, unitriangular=True)
    new_values, k_cumdecay = solved.split([value.shape[-1], key.shape[-1]], dim=-1)
    to_end = decay_exp(cumulative[..., -1:] - cumulative).unsqueeze(-1)
    return {
        "reads": torch.cat([k_cumdecay, query * from_start], dim=-2),  # both read the old state
        "new_values": new_values,
        "intra": intra,
        "keys_t": (key * to_end).transpose(-1, -2),
        "decay": decay_exp(cumulative[..., -1]),  # [chunks, rows]
    }


def _scan(terms: dict[str, Any], state: Any, out: Any) -> Any:
    """Run chunks in order over the recurrent state `[rows, k_dim, v_dim]`, writing each chunk's
    output into `out[chunk]`; returns the state after the last chunk."""
    import torch

    length = terms["new_values"].shape[-2]
    for i in range(terms["new_values"].shape[0]):
        read = torch.bmm(terms["reads"][i], state)
        v_new = terms["new_values"][i] - read[:, :length]
        torch.baddbmm(read[:, length:], terms["intra"][i], v_new, out=out[i])
        state = torch.baddbmm(state * terms["decay"][i][:, None, None], terms["keys_t"][i], v_new)
    return state


def chunk_gated_delta_rule(
    query: Any,
    key: Any,
    value: Any,
    g: Any,
    beta: Any,
    chunk_size: int = 64,
    initial_state: Any | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[Any, Any | None]:
    """transformers' `torch_chunk_gated_delta_rule`, same arguments and results
    (`[batch, tokens, v_heads, v_dim]` in the query's dtype, the float32 state or None)."""
    import torch

    batch, tokens, heads, k_dim = key.shape
    v_dim = value.shape[-1]
    rows = batch * heads
    if use_qk_l2norm_in_kernel:
        query = query.float()
        key = key.float()
        query = query * torch.rsqrt((query * query).sum(dim=-1, keepdim=True) + 1e-6)
        key = key * torch.rsqrt((key * key).sum(dim=-1, keepdim=True) + 1e-6)
    if initial_state is None:
        state = torch.zeros(rows, k_dim, v_dim, dtype=torch.float32, device=key.device)
    else:
        state = initial_state.to(torch.float32).reshape(rows, k_dim, v_dim)
    scale = k_dim**-0.5
    pieces = []
    full = tokens // chunk_size * chunk_size
    for start, stop, length in ((0, full, chunk_size), (full, tokens, tokens - full)):
        if stop == start:
            continue
        n = (stop - start) // length

        def chunk_major(
            t: Any, n: int = n, length: int = length, start: int = start, stop: int = stop
        ) -> Any:
            """`[batch, tokens, heads, ...]` -> float32 `[chunks, batch * heads, length, ...]`, one copy."""
            part = t[:, start:stop].reshape(batch, n, length, heads, *t.shape[3:])
            moved = part.permute(1, 0, 3, 2, *range(4, part.dim()))
            return _copied(moved, torch.float32).view(n, rows, length, *t.shape[3:])

        q, k, v, log_decay, beta_ = (chunk_major(t) for t in (query, key, value, g, beta))
        terms = _chunk_terms(q * scale, k, v, log_decay, beta_)
        chunk_out = torch.empty(n, rows, length, v_dim, dtype=torch.float32, device=key.device)
        state = _scan(terms, state, chunk_out)
        # [chunks, batch, heads, length, v] -> [batch, chunks, length, heads, v], in the output dtype
        moved = chunk_out.view(n, batch, heads, length, v_dim).permute(1, 0, 3, 2, 4)
        pieces.append(_copied(moved, value.dtype).view(batch, n * length, heads, v_dim))
    result = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
    final = state.reshape(batch, heads, k_dim, v_dim) if output_final_state else None
    return result, final


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
    import torch
    from transformers.activations import ACT2FN

    x = hidden_states.transpose(1, 2).to(torch.float32)  # a view when the projection wrote [b, t, c]
    taps = weight.to(torch.float32).t()  # [kernel, channels]
    kernel, tokens = taps.shape[0], x.shape[1]
    out = x * taps[kernel - 1]
    for shift in range(1, min(kernel, tokens)):
        out[:, shift:].addcmul_(x[:, : tokens - shift], taps[kernel - 1 - shift])
    if bias is not None:
        out += bias.to(torch.float32)
    out = out.to(weight.dtype)
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(hidden_states.dtype).transpose(1, 2)


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
        "torch_chunk_gated_delta_rule": chunk_gated_delta_rule,
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
            yield chunk_gated_delta_rule, causal_conv1d
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
