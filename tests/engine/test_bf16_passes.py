"""The compiled bf16 passes (engine.bf16_passes, the convolution's SiLU in engine.causal_conv_rows)
against float64 written out here, rounded to bf16 where transformers' modules round: each value
within one bf16 step of it, and transformers' own modules held to the same bound, so a pass is
as close to the exact value as the module it replaces."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

from semif_serve.engine import bf16_passes
from semif_serve.engine.linear_attention_cpu import causal_conv1d, causal_conv1d_silu

# Rows over one and both threads' shares (a pass splits its rows past 64 Ki values).
ROWS = [3, 300, 2500]


def draw(*shape: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def bf16(x: torch.Tensor) -> torch.Tensor:
    """float64 values rounded to bf16 (via float32, as torch rounds a float32 result), back in float64."""
    return x.float().bfloat16().double()


def silu64(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def within_a_step(got: torch.Tensor, exact: torch.Tensor, steps: float = 1.0) -> bool:
    """Every value of `got` within `steps` bf16 steps (2^-7 of its binade) of `exact`."""
    step = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    return bool(((got.double() - exact).abs() <= steps * step + 1e-30).all())


@pytest.mark.parametrize("rows", ROWS)
def test_the_rms_norm_is_within_a_bf16_step_of_float64_like_transformers_module(rows):
    norm = Qwen3_5RMSNorm(256, eps=1e-6)
    with torch.inference_mode():
        norm.weight.copy_(torch.rand(256, generator=torch.Generator().manual_seed(1)) - 0.5)
        x = draw(rows, 256, seed=rows)
        got = bf16_passes.rms_norm(x, norm.weight, norm.eps)
        x64 = x.double()
        exact = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + norm.weight.double())
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        assert within_a_step(got, exact)
        assert within_a_step(norm.bfloat16()(x), exact)


@pytest.mark.parametrize("rows", ROWS)
def test_the_gated_norm_rounds_where_transformers_module_rounds_and_is_within_a_bf16_step(rows):
    norm = Qwen3_5RMSNormGated(64, eps=1e-6).bfloat16()
    with torch.inference_mode():
        norm.weight.copy_(torch.rand(64, generator=torch.Generator().manual_seed(2)) + 0.5)
        x, gate = draw(rows * 8, 64, seed=rows), draw(rows * 8, 64, seed=rows + 1)
        got = bf16_passes.gated_norm(x, gate, norm.weight, norm.variance_epsilon)
        x64 = x.double()
        normed = bf16(x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6))
        exact = bf16(norm.weight.double() * normed) * silu64(gate.double())
        # Two roundings before the last: a float32 sum next to a boundary may step one of them.
        assert within_a_step(got, exact, steps=2)
        assert within_a_step(norm(x, gate), exact, steps=2)
        assert (got != norm(x, gate)).float().mean() < 1e-3  # and nearly always its very bits


@pytest.mark.parametrize("rows", ROWS)
def test_silu_times_up_is_written_into_the_gate_and_within_a_bf16_step(rows):
    gate, up = draw(rows, 1024, seed=rows), draw(rows, 1024, seed=rows + 7, scale=1.0)
    module = torch.nn.functional.silu(gate) * up
    exact = bf16(silu64(gate.double())) * up.double()
    got = bf16_passes.silu_times(gate, up)
    assert got is gate
    assert within_a_step(got, exact, steps=1.5)
    assert within_a_step(module, exact, steps=1.5)


def test_silu_is_float32_exact_over_the_range_a_model_reaches_and_keeps_nan():
    x = torch.cat([torch.linspace(-100, 100, 200_001), torch.tensor([-1e30, -88.5, 88.5, 1e30, 0.0])])
    got = torch.empty_like(x)
    run = bf16_passes.silu_values
    run(x.numpy(), got.numpy())
    exact = silu64(x.double())
    assert torch.allclose(got.double(), exact, rtol=5e-7, atol=1e-36)  # under -87: x e^-88, not a subnormal
    nan = torch.tensor([math.nan], dtype=torch.float32)
    run(nan.numpy(), nan.numpy())
    assert math.isnan(nan.item())


def test_a_nan_stays_a_nan_through_every_pass():
    x = draw(4, 64, seed=3)
    x[1, 5] = math.nan
    weight = torch.ones(64)
    assert torch.isnan(bf16_passes.rms_norm(x, weight, 1e-6)[1]).all()
    assert torch.isnan(bf16_passes.gated_norm(x, draw(4, 64, seed=4), weight, 1e-6)[1]).all()
    assert torch.isnan(bf16_passes.silu_times(x.clone(), draw(4, 64, seed=5))[1, 5])


@pytest.mark.parametrize(("batch", "tokens", "skip"), [(1, 9, 4), (3, 40, 4), (16, 300, 4), (2, 5, 0)])
def test_the_convolutions_silu_equals_the_bf16_convolution_then_torchs_silu(batch, tokens, skip):
    inputs = draw(batch, tokens, 96, seed=tokens, scale=1.0)
    weight = draw(96, 4, seed=tokens + 1, scale=0.5)
    bias = draw(96, seed=tokens + 2, scale=0.1)
    got = causal_conv1d_silu(inputs, weight, bias, skip)
    convolved = causal_conv1d(inputs.transpose(1, 2), weight, bias).transpose(1, 2)[:, skip:]
    want = torch.nn.functional.silu(convolved).float()  # torch's bf16 SiLU, then float32
    assert got.dtype == torch.float32 and got.shape == (batch, tokens - skip, 96)
    assert within_a_step(got, silu64(convolved.double()), steps=1)
    assert (got != want).float().mean() < 1e-3


def test_a_bf16_packed_forward_of_adapter_and_base_rows_follows_transformers_and_peft_in_bf16(
    checkpoint, tmp_path
):
    """The passes sit downstream of each projection's module, so adapter rows keep their LoRA:
    a bf16 engine (the production loader) against transformers' and PEFT's own bf16 forwards."""
    from peft import PeftModel
    from transformers import Qwen3_5ForCausalLM

    from semif_serve.domain.requests import BASE
    from semif_serve.engine.adapters import AdapterBank
    from semif_serve.engine.forwards import head_logits
    from semif_serve.engine.packed import Segment, packed_forward
    from semif_serve.service.startup import load_engine
    from tests.engine.test_adapters import write_adapter
    from tests.support import make_settings

    targets = ["q_proj", "in_proj_qkv", "up_proj", "out_proj"]
    lora = write_adapter(checkpoint, tmp_path / "lora", 7, r=4, lora_alpha=8, target_modules=targets)
    engine = load_engine(make_settings(checkpoint, dtype="bfloat16"))
    ids = [int(i) for i in torch.randint(1000, 20000, (300,), generator=torch.Generator().manual_seed(3))]
    bank = AdapterBank(engine.model)
    try:
        adapter = bank.add("lora", lora)
        segments = [Segment(tuple(ids), adapter=a, read=True) for a in (adapter, BASE)]
        packed = packed_forward(engine.model, segments, bank)
        with torch.inference_mode(), bank.rows([adapter, BASE]):
            got = head_logits(engine.model, torch.stack([packed.hidden[0], packed.hidden[1]])).float()
    finally:
        bank.close()

    def last_logits(model) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float()

    def fresh() -> Qwen3_5ForCausalLM:
        return Qwen3_5ForCausalLM.from_pretrained(str(checkpoint), dtype=torch.bfloat16).eval()

    base, with_lora = last_logits(fresh()), last_logits(PeftModel.from_pretrained(fresh(), str(lora)).eval())
    assert (with_lora - base).abs().max() > 0.3  # the adapter moves the answer far past the tolerance
    # The batched LoRA rounds its bf16 sum apart from PEFT's: 0.07 here with torch's passes too.
    assert torch.allclose(got[0], with_lora, atol=0.1)
    assert torch.allclose(got[1], base, atol=0.02)  # bf16 rounding through 8 layers (0.004 seen)
