"""The packed forward against independent computations: transformers' own classes loaded fresh
from the same checkpoint (their reference kernels, not the engine's), one plain forward of each
whole sequence alone, and PEFT's own LoRA forward for an adapter's rows.

Every row packed beside others, whatever it continues (nothing, a stored state, a new state
computed in the same forward), equals its sequence alone within 1e-5 in float32; the state kept
at a segment's end equals transformers' own prefill of exactly its tokens."""

from __future__ import annotations

import random

import pytest
import torch

from semif_serve.domain.requests import BASE, RowsRequest
from semif_serve.domain.types import PromptRow
from semif_serve.engine import packed as packed_module
from semif_serve.engine.batching import Group
from semif_serve.engine.forwards import head_logits
from semif_serve.engine.packed import Segment, _causal_attention, _over_shared_past, packed_forward
from semif_serve.engine.runner import _whole
from semif_serve.engine.state_cache import StoredState
from tests.support.peft_oracle import fresh_base, peft_last, peft_model

pytestmark = pytest.mark.engine
TOLERANCE = 1e-5
COLUMNS = list(range(1000, 1032))  # the token ids compared (any ids: the head's rows for them)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return fresh_base(checkpoint)


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 140_000) for _ in range(n)]


def alone(reference, sequence) -> torch.Tensor:
    """The logits at COLUMNS after `sequence`, by one plain forward of it alone."""
    with torch.no_grad():
        return reference(input_ids=torch.tensor([list(sequence)]), logits_to_keep=1).logits[0, -1, COLUMNS]


def packed_logits(engine, packed, segment: int, adapter: int = BASE) -> torch.Tensor:
    with torch.inference_mode(), engine.adapters.rows([adapter]):
        return head_logits(engine.model, packed.hidden[segment][None], COLUMNS)[0]


def stored(reference, sequence) -> StoredState:
    """transformers' own one-row cache after `sequence`."""
    with torch.no_grad():
        out = reference(input_ids=torch.tensor([list(sequence)]), use_cache=True)
    return StoredState(sequence, out.past_key_values)


@pytest.mark.parametrize(
    "lengths", [(20, 21, 22), (20, 300, 1100), (4000, 20)], ids=["short", "mixed", "long"]
)
def test_new_sequences_packed_together_each_equal_their_plain_forward(engine, reference, lengths):
    sequences = [ids(n, seed) for seed, n in enumerate(lengths)]
    packed = packed_forward(engine.model, [Segment(tuple(s), read=True) for s in sequences])
    assert packed.tokens == sum(lengths)  # nothing padded
    for i, sequence in enumerate(sequences):
        got = packed_logits(engine, packed, i)
        assert torch.allclose(got, alone(reference, sequence), atol=TOLERANCE, rtol=0), i


def test_rows_over_a_new_state_a_stored_state_and_nothing_share_one_forward_and_each_equals_alone(
    engine, reference
):
    new_state, old_state = ids(150, 1), ids(90, 2)
    rows = [ids(n, 10 + n) for n in (1, 7, 33)]
    cached = stored(reference, old_state)
    segments = [Segment(tuple(new_state), keep=True)]
    segments += [Segment(tuple(r), parent=0, read=True) for r in rows]
    segments += [Segment(tuple(r), start=cached, read=True) for r in rows]
    segments += [Segment(tuple(ids(40, 3)), read=True)]
    packed = packed_forward(engine.model, segments)
    for n, row in enumerate(rows):
        assert torch.allclose(
            packed_logits(engine, packed, 1 + n), alone(reference, new_state + row), atol=TOLERANCE
        )
        assert torch.allclose(
            packed_logits(engine, packed, 4 + n), alone(reference, old_state + row), atol=TOLERANCE
        )
    assert torch.allclose(packed_logits(engine, packed, 7), alone(reference, segments[7].ids), atol=TOLERANCE)


def test_the_state_kept_at_a_segments_end_is_its_own_not_its_neighbours(engine, reference):
    state, neighbour = ids(130, 4), ids(300, 5)
    packed = packed_forward(
        engine.model,
        [
            Segment(tuple(neighbour), read=True),
            Segment(tuple(state), keep=True),
            Segment(tuple(ids(3, 6)), parent=1),
        ],
    )
    kept = StoredState(state, packed.caches[1])
    own = stored(reference, state)
    assert len(kept.tensors()) == len(own.tensors())
    for layer in range(len(engine.model.get_decoder().layers)):
        for got, want in zip(kept.layer_state(layer), own.layer_state(layer), strict=True):
            assert got.shape == want.shape
            assert torch.allclose(got.float(), want.float(), atol=TOLERANCE), layer
    follow = ids(12, 7)
    again = packed_forward(engine.model, [Segment(tuple(follow), start=kept, read=True)])
    assert torch.allclose(packed_logits(engine, again, 0), alone(reference, state + follow), atol=TOLERANCE)


def test_a_segment_must_come_after_the_one_it_continues(engine):
    with pytest.raises(ValueError, match="does not come before"):
        packed_forward(engine.model, [Segment((5, 6), parent=1), Segment((7,))])


def test_adapter_rows_and_base_rows_in_one_packed_forward_equal_peft_and_the_base_and_keep_peft_s_state(
    engine, reference, checkpoint, tmp_path
):
    from semif_serve.engine.adapters import AdapterBank
    from tests.engine.test_adapters import write_adapter

    directory = write_adapter(
        checkpoint,
        tmp_path / "lora",
        7,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "in_proj_qkv", "up_proj", "out_proj"],
    )
    bank = AdapterBank(engine.model)
    try:
        adapter = bank.add("lora", directory)
        state, rows = ids(120, 8), [ids(5, 9), ids(17, 10)]
        segments = [
            Segment(tuple(state), adapter=adapter, keep=True),
            Segment(tuple(rows[0]), parent=0, adapter=adapter, read=True),
            Segment(tuple(state + rows[1]), adapter=BASE, read=True),
            Segment(tuple(rows[1]), parent=0, adapter=adapter, read=True),
        ]
        packed = packed_forward(engine.model, segments, bank)
        with torch.inference_mode(), bank.rows([adapter, BASE, adapter]):
            got = head_logits(engine.model, torch.stack([packed.hidden[i] for i in (1, 2, 3)]), COLUMNS)
    finally:
        bank.close()
    lora = peft_model(checkpoint, directory)
    for at, row in ((0, rows[0]), (2, rows[1])):
        want = peft_last(lora, state + row)[0][COLUMNS]
        assert torch.allclose(got[at], want, atol=TOLERANCE)
    assert torch.allclose(got[1], alone(reference, state + rows[1]), atol=TOLERANCE)
    # The state kept under the adapter is PEFT's own prefill of exactly its tokens.
    kept, own = StoredState(state, packed.caches[0]), stored(lora, state)
    for layer in range(len(engine.model.get_decoder().layers)):
        for have, want in zip(kept.layer_state(layer), own.layer_state(layer), strict=True):
            assert have.shape == want.shape
            assert torch.allclose(have.float(), want.float(), atol=TOLERANCE), layer
    base_state = stored(reference, state)
    assert any(  # the adapter moves the state: the base's would not pass for it
        not torch.allclose(a.float(), b.float(), atol=TOLERANCE)
        for layer in range(len(engine.model.get_decoder().layers))
        for a, b in zip(kept.layer_state(layer), base_state.layer_state(layer), strict=True)
    )


def test_one_engine_turn_answers_rows_of_requests_over_different_states_as_plain_forwards(engine, reference):
    """Sixteen requests, each its own new state and several orderings, in one `run_groups` call:
    one packed forward, every row equal to a plain forward of its whole prompt."""
    rows = [
        PromptRow("Is it resolved?", ("Yes.", "No.", "Unclear.")),
        PromptRow("Is it resolved?", ("No.", "Unclear.", "Yes.")),
    ]
    prepared = [
        engine.prepare(
            RowsRequest.of(
                f"Ticket {n}: " + "the refund was issued twice. " * (n + 1),
                rows,
                shared=True,
                max_input_tokens=4096,
            )
        )
        for n in range(16)
    ]
    groups = []
    for n, p in enumerate(prepared):
        job = p.job(("turn", n))
        groups.append(Group(job.prefix_key, job.prefix_tokens, (_whole(job),)))
    before = engine.groups.shapes.snapshot()["requests"].observations
    outcomes = engine.run_groups(groups)
    assert engine.groups.shapes.snapshot()["requests"].observations == before + 1  # one forward
    slots = engine.codec.slots
    for n, (p, outcome) in enumerate(zip(prepared, outcomes, strict=True)):
        for prompt, row in zip(p.prompts, outcome[("turn", n)], strict=True):
            with torch.no_grad():
                want = reference(input_ids=torch.tensor([prompt.ids]), logits_to_keep=1).logits[
                    0, -1, slots[:3]
                ]
            assert row.run.forward_requests == 16 and row.run.packed
            assert torch.allclose(torch.tensor(row.option_logits), want, atol=TOLERANCE), n


@pytest.mark.parametrize("n", [20, 1], ids=["queries", "lone-query"])
@pytest.mark.parametrize("past", [0, 7, 20, 63])  # none, shorter than the queries, as long, longer
def test_attention_after_a_past_equals_a_softmax_written_out(past, n):
    torch.manual_seed(past)
    heads, key_heads, dim, scale = 4, 2, 16, 0.25
    query = torch.randn(1, heads, n, dim)
    keys, values = torch.randn(1, key_heads, past + n, dim), torch.randn(1, key_heads, past + n, dim)

    got = _causal_attention(query, keys, values, past, scale, heads // key_heads)

    shared_keys = keys.repeat_interleave(heads // key_heads, dim=1)
    shared_values = values.repeat_interleave(heads // key_heads, dim=1)
    scores = (query @ shared_keys.transpose(-1, -2)) * scale
    later = torch.arange(past + n)[None, :] > (past + torch.arange(n))[:, None]  # keys after each query
    weights = torch.exp(scores.masked_fill(later, float("-inf")) - scores.amax(-1, keepdim=True))
    want = (weights / weights.sum(-1, keepdim=True)) @ shared_values
    assert (got - want).abs().max().item() <= 1e-5


def softmax_written_out(query, keys, values, positions, scale):
    """Attention of queries at `positions` over `keys` (key heads shared in turn), causally."""
    groups = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = (query @ keys.transpose(-1, -2)) * scale
    later = torch.arange(keys.shape[2])[None, :] > positions[:, None]
    weights = torch.exp(scores.masked_fill(later, float("-inf")) - scores.amax(-1, keepdim=True))
    return (weights / weights.sum(-1, keepdim=True)) @ values


@pytest.mark.parametrize("last_only", [False, True], ids=["every-query", "last-query"])
def test_siblings_over_one_shared_past_read_it_together_and_equal_a_softmax_written_out(last_only):
    torch.manual_seed(5)
    heads, key_heads, dim, scale, past = 4, 2, 16, 0.25, 50
    spans = [(0, 1), (1, 8), (8, 28)]  # own lengths 1, 7 and 20 after the same 50-token past
    query = torch.randn(1, heads, 28, dim)
    key, value = torch.randn(1, key_heads, 28, dim), torch.randn(1, key_heads, 28, dim)
    past_keys, past_values = torch.randn(1, key_heads, past, dim), torch.randn(1, key_heads, past, dim)
    own = [(hi - 1 if last_only else lo, (lo, hi)) for lo, hi in spans]

    got = _over_shared_past(query, key, value, (past_keys, past_values), own, scale, heads // key_heads)

    for (first, (lo, hi)), read in zip(own, got, strict=True):
        keys = torch.cat([past_keys, key[:, :, lo:hi]], dim=2)
        values = torch.cat([past_values, value[:, :, lo:hi]], dim=2)
        positions = past + torch.arange(first - lo, hi - lo)
        want = softmax_written_out(query[:, :, first:hi], keys, values, positions, scale)
        assert (read - want).abs().max().item() <= 1e-5


def test_rows_over_one_stored_state_read_its_keys_once_a_layer_and_equal_their_plain_forwards(
    engine, reference, monkeypatch
):
    state, rows = ids(120, 21), [ids(n, 30 + n) for n in (3, 9, 17)]
    calls: list[int] = []
    real = packed_module._over_shared_past

    def counted(query, key, value, past, own, scale, groups):
        calls.append(len(own))
        return real(query, key, value, past, own, scale, groups)

    monkeypatch.setattr(packed_module, "_over_shared_past", counted)
    cached = stored(reference, state)
    packed = packed_forward(engine.model, [Segment(tuple(r), start=cached, read=True) for r in rows])
    attention_layers = engine.model.config.get_text_config().layer_types.count("full_attention")
    assert calls == [len(rows)] * attention_layers  # every full-attention layer: one read of the past
    for n, row in enumerate(rows):
        assert torch.allclose(packed_logits(engine, packed, n), alone(reference, state + row), atol=TOLERANCE)


def test_in_float32_the_norms_and_the_mlp_give_the_bits_of_transformers_own_modules():
    """(bf16 rows take the compiled passes: tests/engine/test_bf16_passes.py.)"""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5MLP, Qwen3_5RMSNorm, Qwen3_5RMSNormGated

    generator = torch.Generator().manual_seed(21)
    gated = Qwen3_5RMSNormGated(64, eps=1e-6)
    norm = Qwen3_5RMSNorm(64, eps=1e-6)
    mlp = Qwen3_5MLP(Qwen3_5TextConfig(hidden_size=64, intermediate_size=128), 128)
    with torch.inference_mode():
        gated.weight.copy_(torch.rand(64, generator=generator) + 0.5)
        norm.weight.copy_(torch.rand(64, generator=generator) - 0.5)
        x, gate = (torch.randn(3000, 64, generator=generator) * 3 for _ in range(2))
        assert torch.equal(packed_module._gated_norm(gated, x, gate), gated(x, gate))
        assert torch.equal(packed_module._norm(norm, x), norm(x))
        assert torch.equal(packed_module._mlp(mlp, x), mlp(x))


def rows_into_last_mlp(model, segments) -> list[int]:
    """How many rows the decoder's last MLP computed in one packed forward of `segments` (its
    gate projection's input rows: the first of its products)."""
    seen: list[int] = []
    gate = model.get_decoder().layers[-1].mlp.gate_proj
    handle = gate.register_forward_hook(lambda module, args, output: seen.append(args[0].shape[0]))
    try:
        packed_forward(model, segments)
    finally:
        handle.remove()
    return seen


def test_the_last_layer_computes_only_the_rows_read_and_still_keeps_every_state(engine, reference):
    state, rows = ids(200, 11), [ids(9, 12), ids(30, 13)]
    segments = [Segment(tuple(state), keep=True)]
    segments += [Segment(tuple(r), parent=0, read=True) for r in rows]
    segments += [Segment(tuple(ids(50, 14)), keep=True), Segment(tuple(ids(60, 15)), read=True)]

    assert rows_into_last_mlp(engine.model, segments) == [3]  # of 349 tokens, the 3 read
    assert rows_into_last_mlp(engine.model, [Segment(tuple(state), keep=True)]) == []

    packed = packed_forward(engine.model, segments)
    kept, own = StoredState(state, packed.caches[0]), stored(reference, state)
    last = len(engine.model.get_decoder().layers) - 1
    for got, want in zip(kept.layer_state(last), own.layer_state(last), strict=True):
        assert got.shape == want.shape and torch.allclose(got.float(), want.float(), atol=TOLERANCE)
    for n, row in enumerate(rows):
        want = alone(reference, state + row)
        assert torch.allclose(packed_logits(engine, packed, 1 + n), want, atol=TOLERANCE)


def test_a_model_whose_last_layer_is_linear_attention_reads_its_rows_as_plain_forwards(tmp_path):
    from semif_serve.service.startup import load_engine
    from semif_serve.tools.demo import CheckpointShape, write_checkpoint
    from tests.support import make_settings
    from tests.support.peft_oracle import fresh_base

    directory = write_checkpoint(tmp_path / "five", CheckpointShape(num_hidden_layers=5), seed=3)
    engine = load_engine(make_settings(directory))
    model = fresh_base(directory)
    assert engine.model.config.get_text_config().layer_types[-1] == "linear_attention"
    state, rows = ids(120, 16), [ids(4, 17), ids(25, 18)]
    segments = [Segment(tuple(state), keep=True)]
    segments += [Segment(tuple(r), parent=0, read=True) for r in rows]
    segments += [Segment(tuple(ids(70, 19)), read=True)]

    assert rows_into_last_mlp(engine.model, segments) == [3]
    packed = packed_forward(engine.model, segments)
    wanted = [state + rows[0], state + rows[1], list(segments[3].ids)]
    for i, sequence in zip((1, 2, 3), wanted, strict=True):
        assert torch.allclose(packed_logits(engine, packed, i), alone(model, sequence), atol=TOLERANCE), i
