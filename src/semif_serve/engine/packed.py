"""One forward over many sequences packed end to end: rows of different requests over different
states, without padding (docs/packing.md).

A forward is a list of `Segment`s. A segment is a run of tokens that continues a state: nothing
(a new sequence from position 0), a stored state (`StoredState`, from the state cache), or an
earlier segment of the same forward (a new state's tokens, then each of its rows). Its tokens
sit end to end with every other segment's in one `[tokens, hidden]` tensor, laid out by adapter,
so the token-wise work (embeddings, norms, every projection, the MLP, the batched LoRA) runs
once over all of them as one matrix; only the sequence mixers run per segment, each told where
its segment starts and what it continues:

- a linear-attention layer (Qwen3.5's gated delta rule) runs its causal convolution over the
  segment's inputs after the last `kernel` inputs of what it continues, and its chunked scan from
  that state's recurrent state (flash-linear-attention's `cu_seqlens` and `initial_state`, as a
  loop over the segments);
- a full-attention layer attends from the segment's queries to the keys and values of
  everything it continues and its own, causally (a block-diagonal causal mask, per segment).

Each segment's state at its end is kept where asked (`keep`): a `DynamicCache` over exactly its
chain's tokens, never a neighbour's or padding, ready for `StateCache.put`; its last position's
hidden state is returned where asked (`read`). The last layer's output feeds only those read
positions, so past its sequence mixer it computes them alone. Every row equals its sequence run
alone within float32 rounding (tests/engine/test_packed.py compares with a plain forward of the
whole row).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from semif_serve.domain.requests import BASE
from semif_serve.engine import bf16_passes
from semif_serve.engine.adapters import AdapterBank
from semif_serve.engine.forwards import RowImages
from semif_serve.engine.linear_attention_cpu import accelerated_kernels, causal_conv1d_silu, gated_delta_rule
from semif_serve.engine.state_cache import StoredState

LENGTH_STEP = 32  # tokens: the segments a linear-attention batch runs together differ by less


class Handover:
    """A segment's state at its end per layer, handed from the forward that computes it to a forward
    running at the same time that continues it (`engine.lanes` splits a long sequence across two
    lanes this way): `publish` gives each layer's as soon as it is computed, `layer_state` waits
    for it; `fail` wakes every waiter for a layer not published with the producer's failure."""

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids: tuple[int, ...] = tuple(ids)
        self._states: dict[int, tuple[Any, Any]] = {}
        self._failure: BaseException | None = None
        self._changed = threading.Condition()

    def __len__(self) -> int:
        return len(self.ids)

    def publish(self, layer: int, state: tuple[Any, Any]) -> None:
        """Layer `layer`'s state at the segment's end (read only from here on)."""
        with self._changed:
            self._states[layer] = state
            self._changed.notify_all()

    def fail(self, failure: BaseException) -> None:
        """The producing forward failed or ended: a wait for a layer it did not publish raises."""
        with self._changed:
            self._failure = self._failure or failure
            self._changed.notify_all()

    def layer_state(self, layer: int) -> tuple[Any, Any]:
        """Layer `layer`'s state at the segment's end, once published (the `StoredState` protocol)."""
        with self._changed:
            self._changed.wait_for(lambda: layer in self._states or self._failure is not None)
            if layer not in self._states:
                failure = HandoverFailed(f"the forward computing this state gave no layer {layer}")
                raise failure from self._failure
            return self._states[layer]


class HandoverFailed(RuntimeError):
    """A forward's state came from another forward that failed."""


@dataclass(frozen=True)
class Segment:
    """Tokens one forward computes after what they continue: `parent` (an earlier segment of
    the same forward, by its index), else `start` (a stored state), else nothing, read by
    `adapter` (the adapter bank's index; BASE: the base weights alone), or a `Handover` from a
    forward running beside it. `keep`: return the state at its end; `read`: return its last
    position's hidden state. `images` gives the embeddings and 3-D positions where the chain holds
    image tokens (negative ids). `hand_to`: publish its state at its end, layer by layer, there."""

    ids: tuple[int, ...]
    parent: int | None = None
    start: StoredState | Handover | None = None
    adapter: int = BASE
    keep: bool = False
    read: bool = False
    images: RowImages | None = field(default=None, compare=False)
    hand_to: Handover | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.ids:
            raise ValueError("a segment needs at least one token")
        if self.parent is not None and self.start is not None:
            raise ValueError("a segment continues an earlier segment or a stored state, not both")


@dataclass
class Packed:
    """What a packed forward returns: each read segment's last hidden state (after the final
    norm, the decoder's dtype) and each kept segment's cache, by segment index; `lanes`: how
    many forwards ran its shares at once (`engine.lanes`)."""

    hidden: dict[int, Any]
    caches: dict[int, Any]
    tokens: int
    lanes: int = 1


def packed_forward(model: Any, segments: Sequence[Segment], adapters: AdapterBank | None = None) -> Packed:
    """Run every segment in one forward of `model`'s decoder (see the module docstring); a
    parent must come before its children. Rows of adapters read their own (`adapters.rows`)."""
    import torch

    _check(segments)
    decoder = model.get_decoder()
    # Each adapter's tokens contiguous: the batched LoRA reads runs of one adapter.
    layout = sorted(range(len(segments)), key=lambda i: segments[i].adapter)
    spans: dict[int, tuple[int, int]] = {}
    at = 0
    for i in layout:
        spans[i] = (at, at + len(segments[i].ids))
        at += len(segments[i].ids)
    chains = _chains(segments)
    with torch.inference_mode():
        hidden = _inputs(model, segments, layout, chains, at)
        positions = _positions(segments, layout, chains, hidden.device)
        cos, sin = decoder.rotary_emb(hidden[None], positions[:, None, :])
        token_adapters = [segments[i].adapter for i in layout for _ in segments[i].ids]
        mixers = _Mixers(decoder, segments, spans, cos, sin)
        reads = {i: spans[i][1] - 1 for i, s in enumerate(segments) if s.read}
        rows = list(reads.values())
        final = len(decoder.layers) - 1
        with accelerated_kernels(decoder) as kernels:
            mixers.kernels = kernels
            with _selected(adapters, token_adapters):
                for index, layer in enumerate(decoder.layers):
                    mixed = _norm(layer.input_layernorm, hidden)
                    if layer.block_type == "linear_attention":
                        mixed = mixers.linear(index, layer.linear_attn, mixed)
                    else:
                        last_only = frozenset(reads) if index == final else None
                        mixed = mixers.attention(index, layer.self_attn, mixed, last_only)
                    if index == final:  # its outputs feed only the read rows: the rest is not computed
                        break
                    hidden = hidden + mixed
                    hidden = hidden + _mlp(layer.mlp, _norm(layer.post_attention_layernorm, hidden))
            hidden_reads: dict[int, Any] = {}
            if rows:
                with _selected(adapters, [token_adapters[r] for r in rows]):
                    read = hidden[rows] + mixed[rows]
                    read = read + _mlp(layer.mlp, _norm(layer.post_attention_layernorm, read))
                hidden_reads = dict(zip(reads, decoder.norm(read), strict=True))
        caches = {i: mixers.cache(i) for i, s in enumerate(segments) if s.keep}
    return Packed(hidden_reads, caches, at)


def _check(segments: Sequence[Segment]) -> None:
    if not segments:
        raise ValueError("a packed forward needs at least one segment")
    for i, segment in enumerate(segments):
        if segment.parent is not None and not 0 <= segment.parent < i:
            raise ValueError(f"segment {i} continues segment {segment.parent}, which does not come before it")


def _selected(adapters: AdapterBank | None, token_adapters: list[int]) -> Any:
    """The adapter rows of a forward over these tokens (nothing to select without a bank)."""
    return adapters.rows(token_adapters) if adapters is not None else _nothing()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _chains(segments: Sequence[Segment]) -> list[tuple[int, ...]]:
    """Each segment's whole sequence: what it continues, then its own ids."""
    chains: list[tuple[int, ...]] = []
    for segment in segments:
        if segment.parent is not None:
            before = chains[segment.parent]
        elif segment.start is not None:
            before = segment.start.ids
        else:
            before = ()
        chains.append((*before, *segment.ids))
    return chains


def _inputs(
    model: Any, segments: Sequence[Segment], layout: list[int], chains: list[tuple[int, ...]], n: int
) -> Any:
    """The input embeddings `[n, hidden]` of every segment's tokens, in the packed layout."""
    import torch

    embed = model.get_input_embeddings()
    device = embed.weight.device
    if not any(t < 0 for s in segments for t in s.ids):
        ids = torch.tensor([t for i in layout for t in segments[i].ids], device=device)
        return embed(ids)
    rows = []
    for i in layout:
        segment, chain = segments[i], chains[i]
        offset = len(chain) - len(segment.ids)
        if segment.images is not None and any(t < 0 for t in segment.ids):
            rows.append(segment.images.embeddings(embed, list(chain), offset, len(chain)))
        else:
            rows.append(embed(torch.tensor(list(segment.ids), device=device)))
    return torch.cat(rows)


def _positions(
    segments: Sequence[Segment], layout: list[int], chains: list[tuple[int, ...]], device: Any
) -> Any:
    """The 3-D rotary positions `[3, n]` of every segment's tokens: after its chain's own (the
    model's image positions where the chain shows an image, else the token's index)."""
    import torch

    parts = []
    for i in layout:
        segment, chain = segments[i], chains[i]
        offset = len(chain) - len(segment.ids)
        if segment.images is not None and any(t < 0 for t in chain):
            parts.append(segment.images.positions(list(chain))[:, offset:].to(torch.long))
        else:
            parts.append(torch.arange(offset, len(chain), dtype=torch.long).expand(3, -1))
    return torch.cat(parts, dim=1).to(device)


def _norm(norm: Any, x: Any) -> Any:
    """A decoder norm over rows `x`: bf16 rows of Qwen3.5's norm in one compiled pass
    (`engine.bf16_passes`), else the module."""
    if type(norm).__name__ == "Qwen3_5RMSNorm" and bf16_passes.applies(x):
        return bf16_passes.rms_norm(x, norm.weight, norm.eps)
    return norm(x)


def _mlp(mlp: Any, x: Any) -> Any:
    """The decoder layer's MLP (`down(act(gate(x)) * up(x))`, each projection its own module, so
    adapter rows apply), the SiLU and the product in place: for bf16 rows one compiled pass
    (`engine.bf16_passes`), else torch's, the same bits as the module's, no new tensors."""
    import torch.nn.functional as F

    gate = mlp.gate_proj(x)
    silu = mlp.config.hidden_act == "silu"
    if silu and bf16_passes.applies(gate):
        return mlp.down_proj(bf16_passes.silu_times(gate, mlp.up_proj(x)))
    active = F.silu(gate, inplace=True) if silu else mlp.act_fn(gate)
    return mlp.down_proj(active.mul_(mlp.up_proj(x)))


def _gated_norm(norm: Any, x: Any, gate: Any) -> Any:
    """Qwen3.5's gated norm (`weight * rms_norm(x)` in x's dtype, times `act(gate)` in float32):
    for bf16 rows and SiLU one compiled pass (`engine.bf16_passes`); else the norm as torch's
    `F.rms_norm` and the product in place, the same bits as transformers' module in fewer passes
    (bench/RESULTS.md)."""
    import torch
    import torch.nn.functional as F
    from transformers.activations import ACT2FN

    if norm.activation == "silu" and bf16_passes.applies(x) and bf16_passes.applies(gate):
        return bf16_passes.gated_norm(x, gate, norm.weight, norm.variance_epsilon)
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)
    return (norm.weight * normed).float().mul_(ACT2FN[norm.activation](gate.to(torch.float32))).to(x.dtype)


def _causal_attention(query: Any, keys: Any, values: Any, past: int, scale: float, groups: int) -> Any:
    """Queries `[1, heads, n, dim]` at positions `past..past + n` over every key, causally, key
    heads shared by `groups` query heads. SDPA's causal flag (its fused kernel) where the past is
    no longer than the queries: they are padded in front by the past's length and those rows'
    outputs dropped (the same bits as a mask, half the time on 1,500 queries after a 39-token
    preamble); a mask offset by the past where it is longer (a question over a long stored state,
    where padding would cost the past's square); no mask for a lone query (the last position sees
    every key: the last layer's reads)."""
    import torch

    sdpa = torch.nn.functional.scaled_dot_product_attention
    n = query.shape[2]
    if n == 1:  # the last position sees every key: no mask
        return sdpa(query, keys, values, scale=scale, enable_gqa=groups > 1)
    if past > n:
        allowed = torch.ones(n, past + n, dtype=torch.bool, device=query.device).tril(past)
        return sdpa(query, keys, values, attn_mask=allowed, scale=scale, enable_gqa=groups > 1)
    if past:
        query = torch.cat([query.new_zeros(*query.shape[:2], past, query.shape[3]), query], dim=2)
    return sdpa(query, keys, values, is_causal=True, scale=scale, enable_gqa=groups > 1)[:, :, past:]


def _over_shared_past(
    query: Any,
    key: Any,
    value: Any,
    past: tuple[Any, Any],
    own: list[tuple[int, tuple[int, int]]],
    scale: float,
    groups: int,
) -> list[Any]:
    """Each sibling's attention (its queries from `first` over the shared `past` keys, then its own
    keys `lo:hi`, causally), the past's part for all siblings in one call: a question's rows over
    one long stored state read its keys once, where one masked call per row ran at a fraction of
    the CPU's peak (cascade attention). The two parts are merged by their log-sum-exps: the
    softmax over the union, exact in float32 (within its rounding)."""
    import torch

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    dtype = query.dtype
    queries = torch.cat([query[:, :, first:hi] for first, (_, hi) in own], dim=2)
    heads, count, dim = queries.shape[1:]
    # Query head h reads key head h // groups (transformers' `repeat_kv`): with no mask, a key
    # head's query heads are one longer run of queries over it, so the past's keys are not copied.
    by_key_head = queries.reshape(1, heads // groups, groups * count, dim)
    from_past, past_lse = flash(by_key_head, past[0].to(dtype), past[1].to(dtype), 0.0, False, scale=scale)[
        :2
    ]
    from_past, past_lse = from_past.reshape(1, heads, count, dim), past_lse.reshape(1, heads, count)
    reads, at = [], 0
    for first, (lo, hi) in own:
        keys = key[:, :, lo:hi].repeat_interleave(groups, dim=1)
        values = value[:, :, lo:hi].repeat_interleave(groups, dim=1)
        # Own keys from the segment's start: the queries from `first` see those before them.
        mine, mine_lse = flash(
            query[:, :, first:hi], keys, values, 0.0, first == lo and hi - lo > 1, scale=scale
        )[:2]
        count = hi - first
        theirs, theirs_lse = from_past[:, :, at : at + count], past_lse[:, :, at : at + count]
        at += count
        top = torch.maximum(mine_lse, theirs_lse)
        w_mine, w_theirs = torch.exp(mine_lse - top)[..., None], torch.exp(theirs_lse - top)[..., None]
        merged = (w_mine * mine.float() + w_theirs * theirs.float()) / (w_mine + w_theirs)
        reads.append(merged.to(dtype))
    return reads


def _batches(segments: Sequence[Segment]) -> list[list[int]]:
    """The segments in the order the linear-attention layers run them: a tail continuing a state
    handed over by another forward, and what continues it, after every other segment (the other
    forward's state has the longest to be ready), a segment handing its state over first; then
    by depth (a parent's batch before its children's), then batched by length in steps of
    `LENGTH_STEP` tokens, so a batch's convolution pads each segment by less than a step (the rule
    stops at each one's own end)."""
    depth: list[int] = []
    waits: list[bool] = []  # continues a handed-over state, itself or through its parents
    for segment in segments:
        parent = segment.parent
        depth.append(depth[parent] + 1 if parent is not None else 0)
        waits.append(waits[parent] if parent is not None else isinstance(segment.start, Handover))
    keyed: dict[tuple[bool, int, bool, int], list[int]] = {}
    for i, segment in enumerate(segments):
        key = (waits[i], depth[i], segment.hand_to is None, -(-len(segment.ids) // LENGTH_STEP))
        keyed.setdefault(key, []).append(i)
    return [keyed[key] for key in sorted(keyed)]


class _Mixers:
    """The per-segment sequence mixers of one packed forward, and each segment's state at its end
    per layer (what its children and its kept cache continue)."""

    def __init__(
        self, decoder: Any, segments: Sequence[Segment], spans: dict[int, tuple[int, int]], cos: Any, sin: Any
    ) -> None:
        self.decoder, self.segments, self.spans, self.cos, self.sin = decoder, segments, spans, cos, sin
        self.modeling = sys.modules[type(decoder).__module__]
        self.kernels: Any = None
        # Per segment, per layer: (keys, values) over its whole chain, or (conv inputs, recurrent state).
        self.ends: list[dict[int, tuple[Any, Any]]] = [{} for _ in segments]
        # The segments whose keys over their whole chain outlive their layer: kept, or continued.
        self.continued = {i for i, s in enumerate(segments) if s.keep or s.hand_to is not None} | {
            s.parent for s in segments if s.parent is not None
        }
        self.batches = _batches(segments)

    def _chain(self, i: int, layer: int, key: Any, value: Any) -> tuple[Any, Any]:
        """Segment i's keys and values over its whole chain: what it continues, then its own."""
        import torch

        lo, hi = self.spans[i]
        keys, values = key[:, :, lo:hi], value[:, :, lo:hi]
        before = self._before(i, layer)
        if before is None:
            return keys, values
        keys = torch.cat([before[0].to(keys.dtype), keys], dim=2)
        return keys, torch.cat([before[1].to(values.dtype), values], dim=2)

    def _over_one_long_past(
        self, attending: list[tuple[int, int]], layer: int
    ) -> list[tuple[tuple[Any, Any], list[tuple[int, int]]]]:
        """The segments that continue one past (their parent, or one stored state) longer than
        their own queries, two or more to a past, with that past: its keys are read once for all."""
        siblings: dict[tuple[str, int], tuple[tuple[Any, Any], list[tuple[int, int]]]] = {}
        for i, first in attending:
            segment, hi = self.segments[i], self.spans[i][1]
            before = self._before(i, layer)
            if before is None or before[0].shape[2] <= hi - first:
                continue
            past = ("parent", segment.parent) if segment.parent is not None else ("start", id(segment.start))
            siblings.setdefault(past, (before, []))[1].append((i, first))
        return [shared for shared in siblings.values() if len(shared[1]) > 1]

    def _hand_over(self, i: int, layer: int) -> None:
        handover = self.segments[i].hand_to
        if handover is not None:
            handover.publish(layer, self.ends[i][layer])

    def _before(self, i: int, layer: int) -> tuple[Any, Any] | None:
        """What segment i continues at `layer`: its parent's end, its stored state's, or None."""
        segment = self.segments[i]
        if segment.parent is not None:
            return self.ends[segment.parent][layer]
        if segment.start is not None:
            return segment.start.layer_state(layer)
        return None

    def linear(self, layer: int, mixer: Any, hidden: Any) -> Any:
        """A gated delta-rule layer over every segment: the projections once, then the convolution
        and the chunked scan over batches of segments (`_batches`), each segment right-padded to
        its batch's longest with tokens that leave the state as it was (no decay, no write)."""
        import torch
        import torch.nn.functional as F

        n = hidden.shape[0]
        qkv = mixer.in_proj_qkv(hidden)  # [n, conv_dim]
        z = mixer.in_proj_z(hidden)
        beta = mixer.in_proj_b(hidden).sigmoid()
        g = -mixer.A_log.float().exp() * F.softplus(mixer.in_proj_a(hidden).float() + mixer.dt_bias)
        core = torch.empty(n, mixer.num_v_heads, mixer.head_v_dim, dtype=hidden.dtype, device=hidden.device)
        for batch in self.batches:
            self._linear_batch(layer, mixer, batch, (qkv, beta, g), core)
        normed = _gated_norm(mixer.norm, core.reshape(-1, mixer.head_v_dim), z.reshape(-1, mixer.head_v_dim))
        return mixer.out_proj(normed.reshape(n, -1))

    def _linear_batch(
        self, layer: int, mixer: Any, batch: list[int], projected: tuple[Any, Any, Any], core: Any
    ) -> None:
        """The convolution and scan of one batch of segments (no one the parent of another)."""
        import torch

        qkv, beta, g = projected
        kernel = mixer.conv_kernel_size
        lengths = [self.spans[i][1] - self.spans[i][0] for i in batch]
        width = max(lengths)
        rows = len(batch)
        # Token-major `[rows, kernel + width, conv_dim]`: `kernel` inputs of what each continues first.
        inputs = qkv.new_zeros(rows, kernel + width, qkv.shape[-1])
        gates = g.new_zeros(rows, width, g.shape[-1])  # padding: no decay ...
        betas = beta.new_zeros(rows, width, beta.shape[-1])  # ... and no write
        states = []
        for r, i in enumerate(batch):
            lo, hi = self.spans[i]
            before = self._before(i, layer)
            if before is not None:
                inputs[r, :kernel] = before[0][0].t()
            inputs[r, kernel : kernel + hi - lo] = qkv[lo:hi]
            gates[r, : hi - lo] = g[lo:hi]
            betas[r, : hi - lo] = beta[lo:hi]
            states.append(before[1] if before is not None else None)
        chunk_rule, conv_fn = self.kernels
        own_rule = chunk_rule is gated_delta_rule  # the CPU kernel: shared key heads, packed rows
        weight = mixer.conv1d.weight.squeeze(1)
        if own_rule and inputs.dtype == torch.bfloat16 and mixer.activation == "silu":
            # One compiled pass to the float32 the rule reads (the rounded bf16 values).
            mixed = causal_conv1d_silu(inputs, weight, mixer.conv1d.bias, kernel)
        else:
            conv = conv_fn(inputs.transpose(1, 2), weight, mixer.conv1d.bias, activation=mixer.activation)
            mixed = conv.transpose(1, 2)[:, kernel:]  # [rows, width, conv_dim]
            if own_rule:  # it reads float32 views of any strides: one conversion for all three
                mixed = mixed.float()
        repeat = mixer.num_v_heads // mixer.num_k_heads
        query, key, value = torch.split(mixed, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
        query = query.reshape(rows, width, -1, mixer.head_k_dim)
        key = key.reshape(rows, width, -1, mixer.head_k_dim)
        value = value.reshape(rows, width, -1, mixer.head_v_dim)
        if repeat > 1 and not own_rule:
            query = query.repeat_interleave(repeat, dim=2)
            key = key.repeat_interleave(repeat, dim=2)
        initial = None
        if any(s is not None for s in states):
            shape = (mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim)
            initial = torch.stack([s[0] if s is not None else g.new_zeros(shape) for s in states])
        out, final = chunk_rule(
            query,
            key,
            value,
            g=gates,
            beta=betas,
            initial_state=initial,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            # The CPU kernel: each row's own length, its output written straight into the packed rows.
            **({"lengths": lengths, "into": (core, [self.spans[i][0] for i in batch])} if own_rule else {}),
        )
        for r, i in enumerate(batch):
            lo, hi = self.spans[i]
            if out is not None:
                core[lo:hi] = out[r, : hi - lo]
            window = inputs[r : r + 1, hi - lo : kernel + hi - lo].transpose(1, 2)  # the last `kernel` inputs
            self.ends[i][layer] = (window, final[r : r + 1])
            self._hand_over(i, layer)

    def attention(self, layer: int, attn: Any, hidden: Any, last_only: frozenset[int] | None = None) -> Any:
        """A full-attention layer: projections once, each segment's queries over its chain's keys.
        With `last_only` (the decoder's last layer), only those segments' last queries attend; every
        other output row is zeros (no later layer reads it), and every kept or continued segment's
        keys are still stored."""
        import torch

        n = hidden.shape[0]
        head_dim = attn.head_dim
        query, gate = torch.chunk(attn.q_proj(hidden).view(n, -1, head_dim * 2), 2, dim=-1)
        gate = gate.reshape(n, -1)
        query = attn.q_norm(query).transpose(0, 1)[None]  # [1, heads, n, head_dim]
        key = attn.k_norm(attn.k_proj(hidden).view(n, -1, head_dim)).transpose(0, 1)[None]
        value = attn.v_proj(hidden).view(n, -1, head_dim).transpose(0, 1)[None]
        query, key = self.modeling.apply_rotary_pos_emb(query, key, self.cos, self.sin)
        out = torch.empty_like(query) if last_only is None else torch.zeros_like(query)
        groups = attn.num_key_value_groups
        attending: list[tuple[int, int]] = []  # (segment, its first query that attends)
        for i in range(len(self.segments)):
            lo, hi = self.spans[i]
            if i in self.continued:
                self.ends[i][layer] = self._chain(i, layer, key, value)
                self._hand_over(i, layer)
            if last_only is None or i in last_only:
                attending.append((i, lo if last_only is None else hi - 1))
        shared = self._over_one_long_past(attending, layer) if query.device.type == "cpu" else []
        apart = set(attending).difference(member for _, members in shared for member in members)
        for i, first in sorted(apart):
            hi = self.spans[i][1]
            keys, values = self.ends[i][layer] if i in self.continued else self._chain(i, layer, key, value)
            past = keys.shape[2] - (hi - first)
            out[:, :, first:hi] = _causal_attention(
                query[:, :, first:hi], keys, values, past, attn.scaling, groups
            )
        for past, members in shared:
            own = [(first, self.spans[i]) for i, first in members]
            reads = _over_shared_past(query, key, value, past, own, attn.scaling, groups)
            for (first, (_, hi)), read in zip(own, reads, strict=True):
                out[:, :, first:hi] = read
        attended = out[0].transpose(0, 1).reshape(n, -1) * torch.sigmoid(gate)
        return attn.o_proj(attended)

    def cache(self, i: int) -> Any:
        """Segment i's state at its end as a one-row `DynamicCache` (ready for `StateCache.put`)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.decoder.config)
        for layer, (first, second) in sorted(self.ends[i].items()):
            cached: Any = cache.layers[layer]
            if self.decoder.layers[layer].block_type == "linear_attention":
                cached.update_conv_state(first.clone(), conv_kernel_size=first.shape[-1])
                cached.update_recurrent_state(second)
            else:
                cached.update(first, second)
        return cache
