"""Qwen3.5's linear-attention kernels on the CPU, the same arithmetic as transformers' reference
torch code laid out for a CPU: the GPU image uses flash-linear-attention and causal-conv1d,
which have no CPU build, and the reference fallbacks spend most of a short forward outside
the arithmetic (measured in bench/RESULTS.md, "Linear attention on the CPU").

What differs from the reference, and why each is exact to float32 rounding:
- the gated delta rule runs its chunks chunk-major and contiguous, 32 tokens each (the
  reference's 64: the chunk's triangular systems and its elementwise terms halve, and on this
  CPU that outweighs twice the scan's steps; bench/RESULTS.md); the key products are computed
  once per key head, not per value head after a repeat; the chunk's triangular system is
  inverted once and applied to both right-hand sides in one batched product; the sequential
  scan does only what the next chunk's state needs, and the queries read every chunk's start
  state afterwards in one batched product;
- the last chunk is as long as the tokens left, not padded (the padded rows were zeros that
  only cost work: zero keys, values and gates);
- decays under exp(-50) (~2e-22) are exactly 0: the CPU's exp takes a ~10x slower path where
  its result underflows, and products of tiny decays are subnormals, on which every later op
  takes a slow path on threads that do not flush them (`_decays`); a term that small cannot
  move a float32 sum of the terms a row reads;
- the causal convolution runs on the `[batch, tokens, channels]` layout the projection wrote,
  as K shifted multiply-adds in float32 rounded once to the weights' dtype, reading a bf16 input
  as it is (the reference transposed to `[batch, channels, tokens]` first: a copy at a 4 KiB
  stride);
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
_SMALLEST_DECAY_LOG = -50.0  # exp(-50) ~ 2e-22: a term that small cannot move a float32 sum of O(1e-6) terms
SCAN_CHUNK = 32  # tokens per chunk of the scan: measured faster than 64 on this CPU (docs/packing.md)


def _decays(log_decay: Any) -> Any:
    """exp of log-decays (<= 0) in place, those under exp(-50) (~2e-22) taken as exactly 0: the
    CPU's exp is ~10x slower where its result underflows, and every op on a subnormal product
    (a tiny decay times a key product or a state entry) takes a slow path, on threads whose
    subnormals `torch.set_flush_denormal` does not flush (measured: 5 ms -> 870 ms for one
    triangular solve of a packed forward)."""
    import torch.nn.functional as F

    return F.threshold(log_decay, _SMALLEST_DECAY_LOG, float("-inf"), inplace=True).exp_()


def _unit_normed(x: Any) -> Any:
    """`x` in float32 scaled to unit length along its last axis (the reference's l2 norm)."""
    import torch

    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def chunk_gated_delta_rule(
    query: Any,
    key: Any,
    value: Any,
    g: Any,
    beta: Any,
    chunk_size: int = SCAN_CHUNK,
    initial_state: Any | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[Any, Any | None]:
    """transformers' `torch_chunk_gated_delta_rule`, same arguments and results
    (`[batch, tokens, v_heads, v_dim]` in the value's dtype, the float32 state or None); the
    query and key may hold fewer heads than the value (each shared by consecutive value heads, as
    `repeat_interleave` would lay them out), so callers need not repeat them."""
    import torch

    batch, tokens, k_heads, k_dim = key.shape
    v_heads, v_dim = value.shape[2], value.shape[3]
    rows = batch * v_heads
    if use_qk_l2norm_in_kernel:
        query, key = _unit_normed(query), _unit_normed(key)
    if initial_state is None:
        state = torch.zeros(rows, k_dim, v_dim, dtype=torch.float32, device=key.device)
    else:
        state = initial_state.to(torch.float32).reshape(rows, k_dim, v_dim)
    pieces = []
    full = tokens // chunk_size * chunk_size
    for start, stop in ((0, full), (full, tokens)):
        if stop > start:
            length = min(chunk_size, stop - start)
            out, state = _chunks(query, key, value, g, beta, (start, stop, length), state)
            pieces.append(out)
    result = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
    final = state.reshape(batch, v_heads, k_dim, v_dim) if output_final_state else None
    return result, final


def _chunks(
    query: Any, key: Any, value: Any, g: Any, beta: Any, span: tuple[int, int, int], state: Any
) -> Any:
    """Tokens `start:stop` as chunks of `length` from `state` `[rows, k_dim, v_dim]`: the output
    `[batch, stop - start, v_heads, v_dim]` in the value's dtype, and the state after them."""
    import torch

    start, stop, length = span
    batch, _, k_heads, k_dim = key.shape
    v_heads, v_dim = value.shape[2], value.shape[3]
    n, share = (stop - start) // length, v_heads // k_heads
    rows = batch * v_heads

    def chunk_major(t: Any, heads: int) -> Any:
        """`[batch, tokens, heads, ...]` -> float32 `[chunks, batch, heads, length, ...]`, one copy."""
        part = t[:, start:stop].reshape(batch, n, length, heads, *t.shape[3:])
        return _copied(part.permute(1, 0, 3, 2, *range(4, part.dim())), torch.float32)

    q = chunk_major(query, k_heads).mul_(k_dim**-0.5)
    k = chunk_major(key, k_heads)
    v = chunk_major(value, v_heads).view(n, batch, k_heads, share, length, v_dim)
    cumulative = chunk_major(g, v_heads).cumsum_(-1)  # [chunks, batch, v_heads, length]
    b = chunk_major(beta, v_heads).view(n, batch, k_heads, share, length, 1)
    # exp(c_i - c_j) at and below the diagonal, exactly 0 above
    later = torch.ones(length, length, dtype=torch.bool, device=key.device).triu_(1)
    pairwise = (cumulative.unsqueeze(-1) - cumulative.unsqueeze(-2)).masked_fill_(later, float("-inf"))
    pairwise = _decays(pairwise)
    pairwise = pairwise.view(n, batch, k_heads, share, length, length)
    keys_t = k.transpose(-1, -2)
    # Key products once per key head, shared by its value heads.
    system = (k @ keys_t).unsqueeze(3).mul(pairwise).mul_(b).view(-1, length, length)
    intra = (q @ keys_t).unsqueeze(3).mul(pairwise).view(n, rows, length, length)
    from_start = _decays(cumulative.clone()).view(n, batch, k_heads, share, length, 1)
    right = torch.empty(n, batch, k_heads, share, length, v_dim + k_dim, device=key.device)
    torch.mul(v, b, out=right[..., :v_dim])
    torch.mul(k.unsqueeze(3), b * from_start, out=right[..., v_dim:])
    # (I + strictly lower system)^-1 once, then one batched product for both right-hand sides.
    eye = torch.eye(length, device=key.device).expand(system.shape[0], length, length)
    inverse = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)
    solved = torch.bmm(inverse, right.view(-1, length, v_dim + k_dim)).view(n, rows, length, v_dim + k_dim)
    new_values, k_cumdecay = solved[..., :v_dim], solved[..., v_dim:]
    last = cumulative[..., -1:]
    to_end = _decays(last - cumulative).view(n, batch, k_heads, share, length, 1)
    keys_to_end = (k.unsqueeze(3) * to_end).view(n, rows, length, k_dim).transpose(-1, -2)
    decay = _decays(last.clone()).view(n, rows, 1, 1)
    # The scan: only what the next chunk's state needs; the queries read every start state after.
    starts = torch.empty(n + 1, rows, k_dim, v_dim, device=key.device)
    starts[0] = state
    corrected = torch.empty(n, rows, length, v_dim, device=key.device)
    for i in range(n):
        torch.baddbmm(new_values[i], k_cumdecay[i], starts[i], alpha=-1, out=corrected[i])
        torch.mul(starts[i], decay[i], out=starts[i + 1])
        starts[i + 1].baddbmm_(keys_to_end[i], corrected[i])
    reads = (q.unsqueeze(3) * from_start).view(-1, length, k_dim)
    out = torch.baddbmm(
        torch.bmm(reads, starts[:n].view(-1, k_dim, v_dim)),
        intra.view(-1, length, length),
        corrected.view(-1, length, v_dim),
    )
    # [chunks, batch, heads, length, v] -> [batch, chunks * length, heads, v], in the output dtype
    moved = out.view(n, batch, v_heads, length, v_dim).permute(1, 0, 3, 2, 4)
    return _copied(moved, value.dtype).view(batch, n * length, v_heads, v_dim), starts[n]


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

    x = hidden_states.transpose(1, 2)  # a view when the projection wrote [b, t, c]
    taps = weight.to(torch.float32).t().contiguous()  # [kernel, channels]
    kernel, tokens = taps.shape[0], x.shape[1]
    out = x * taps[kernel - 1]  # float32: each product of the input's dtype rounds once, no copy first
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
