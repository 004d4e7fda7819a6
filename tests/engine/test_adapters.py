"""PEFT LoRA adapters over the shared base: loaded through `engine.adapters`, every row of a
mixed batch compared with PEFT's own forward of its adapter alone (float32, 1e-5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5ForCausalLM

from semif_serve.domain.requests import BASE
from semif_serve.engine.adapters import AdapterBank, AdapterError
from semif_serve.engine.loader import CheckpointSpec, load_model
from tests.support.peft_oracle import fresh_base, peft_model

LEV_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LINEAR_ATTENTION = ["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"]
ATOL = 1e-5


def plain_base(checkpoint: Path) -> Qwen3_5ForCausalLM:
    """The base as transformers loads it, independent of the service's loader."""
    return Qwen3_5ForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


def write_adapter(checkpoint: Path, directory: Path, seed: int, **lora) -> Path:
    """A random PEFT LoRA adapter (nonzero B) saved by PEFT itself."""
    torch.manual_seed(seed)
    model = get_peft_model(plain_base(checkpoint), LoraConfig(**lora))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    made = {
        "lev": write_adapter(checkpoint, root / "lev", 1, r=8, lora_alpha=16, target_modules=LEV_TARGETS),
        "linear": write_adapter(
            checkpoint, root / "linear", 2, r=4, lora_alpha=4, target_modules=LINEAR_ATTENTION
        ),
        "rs": write_adapter(
            checkpoint,
            root / "rs",
            3,
            r=16,
            lora_alpha=8,
            use_rslora=True,
            target_modules=["up_proj", "q_proj"],
        ),
    }
    # The lev adapter at a quarter of its strength, written out: B scaled by 0.25 (PEFT reads it plainly).
    quarter = root / "lev-quarter"
    quarter.mkdir()
    (quarter / "adapter_config.json").write_text((made["lev"] / "adapter_config.json").read_text())
    tensors = load_file(str(made["lev"] / "adapter_model.safetensors"))
    save_file(
        {k: v * 0.25 if ".lora_B." in k else v for k, v in tensors.items()},
        str(quarter / "adapter_model.safetensors"),
    )
    made["lev-quarter"] = quarter
    return made


@pytest.fixture(scope="module")
def loaded(checkpoint):
    spec = CheckpointSpec(checkpoint, "test", "test/base", "float32", "cpu")
    return load_model(spec)


@pytest.fixture(scope="module")
def bank(loaded, adapters):
    bank = AdapterBank(loaded.model)
    bank.add("lev", adapters["lev"])
    bank.add("linear", adapters["linear"])
    bank.add("rs", adapters["rs"])
    bank.add("lev-quarter", adapters["lev"], multiplier=0.25)  # the same tensors, a serving scale
    yield bank
    bank.close()


def prompts(n: int, length: int, seed: int = 7) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, 5000, (n, length), generator=generator)


def peft_logits(checkpoint: Path, adapter: Path | None, ids: torch.Tensor) -> torch.Tensor:
    """Each row alone through PEFT's own LoRA forward of `adapter` (None: the plain base)."""
    model = fresh_base(checkpoint) if adapter is None else peft_model(checkpoint, adapter)
    with torch.no_grad():
        return torch.cat([model(input_ids=row[None]).logits for row in ids])


def test_targets_reach_every_layer_kind(bank, loaded):
    """lev's 'attention and MLP projections' on Qwen3.5: q/k/v/o of the full-attention layers and
    the MLP of every layer; the linear-attention projections only when named."""
    lev = bank.adapters[bank.index("lev")].weights.modules
    layers = loaded.model.config.layer_types
    full = [i for i, kind in enumerate(layers) if kind == "full_attention"]
    assert {m for m in lev if "self_attn" in m} == {
        f"model.layers.{i}.self_attn.{p}" for i in full for p in ("q_proj", "k_proj", "v_proj", "o_proj")
    }
    assert sum("mlp" in m for m in lev) == 3 * len(layers)
    linear = bank.adapters[bank.index("linear")].weights.modules
    assert all(".linear_attn." in m for m in linear) and len(linear) == 5 * (len(layers) - len(full))


def test_mixed_batch_rows_equal_each_model_alone(bank, loaded, adapters, checkpoint):
    names = ["lev", "lev", None, "linear", "rs", "rs", None, "lev-quarter", "linear"]
    rows = [BASE if n is None else bank.index(n) for n in names]
    ids = prompts(len(rows), 12)
    with torch.no_grad(), bank.rows(rows):
        mixed = loaded.model(input_ids=ids).logits
    for name in {*names}:
        at = [i for i, n in enumerate(names) if n == name]
        reference = peft_logits(checkpoint, adapters[name] if name else None, ids[at])
        torch.testing.assert_close(mixed[at], reference, atol=ATOL, rtol=0)
        if name is not None:  # the adapter moves the logits: the comparison can fail
            assert (mixed[at] - peft_logits(checkpoint, None, ids[at])).abs().max() > 1e-3


def test_one_adapter_for_every_row_and_the_base_untouched(bank, loaded, adapters, checkpoint):
    ids = prompts(3, 9, seed=11)
    with torch.no_grad(), bank.rows(bank.index("rs")):
        every = loaded.model(input_ids=ids).logits
    torch.testing.assert_close(every, peft_logits(checkpoint, adapters["rs"], ids), atol=ATOL, rtol=0)
    with torch.no_grad():
        outside = loaded.model(input_ids=ids).logits  # no selection: the plain base
        with bank.rows([BASE] * 3):
            base_rows = loaded.model(input_ids=ids).logits
    reference = peft_logits(checkpoint, None, ids)
    torch.testing.assert_close(outside, reference, atol=ATOL, rtol=0)
    assert torch.equal(base_rows, outside)


def test_bytes_are_counted_once_per_directory(bank, adapters):
    expected = 0
    for name in ("lev", "linear", "rs"):
        tensors = load_file(str(adapters[name] / "adapter_model.safetensors"))
        expected += sum(t.numel() * 4 for t in tensors.values())
    assert bank.nbytes == expected
    assert bank.adapters[bank.index("lev-quarter")].weights is bank.adapters[bank.index("lev")].weights


def test_selection_is_checked(bank, loaded):
    with pytest.raises(RuntimeError, match="3 rows under a selection of 2"):
        with torch.no_grad(), bank.rows([0, BASE]):
            loaded.model(input_ids=prompts(3, 4))
    with pytest.raises(IndexError):
        with bank.rows([0, 99]):
            pass


# -- refusals ---------------------------------------------------------------------------------


def copy_adapter(source: Path, target: Path, config: dict | None = None, tensors: dict | None = None) -> Path:
    target.mkdir()
    cfg = json.loads((source / "adapter_config.json").read_text())
    cfg.update(config or {})
    (target / "adapter_config.json").write_text(json.dumps(cfg))
    weights = load_file(str(source / "adapter_model.safetensors"))
    if tensors is not None:
        weights = tensors(weights)
    save_file(weights, str(target / "adapter_model.safetensors"))
    return target


KEY = "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize(
    ("config", "tensors", "message"),
    [
        ({"peft_type": "IA3"}, None, "adapter_config.json: peft_type is 'IA3'"),
        ({"use_dora": True}, None, "adapter_config.json: use_dora is set"),
        ({"bias": "all"}, None, "adapter_config.json: bias is 'all'"),
        ({"modules_to_save": ["lm_head"]}, None, "adapter_config.json: modules_to_save is set"),
        ({"rank_pattern": {"q_proj": 4}}, None, "adapter_config.json: rank_pattern is set"),
        (
            {"r": 4},
            None,
            "down_proj.lora_A.weight: shape (8, 128), the base's model.layers.0.mlp.down_proj",
        ),
        ({"r": 0}, None, "adapter_config.json: r must be a positive integer"),
        (
            {"target_modules": ["q_proj", "qkv_proj"]},
            None,
            "'qkv_proj' is not a Linear layer",
        ),
        ({"base_model_name_or_path": "Qwen/Qwen2.5-7B"}, None, "base_model_name_or_path 'Qwen/Qwen2.5-7B'"),
        (None, lambda w: {**w, KEY: w[KEY][:, :32].contiguous()}, f"{KEY}: shape (8, 32)"),
        (None, lambda w: {k: v for k, v in w.items() if k != KEY}, f"{KEY}: missing"),
        (
            None,
            lambda w: {**w, "base_model.model.model.layers.0.mlp.nope.lora_A.weight": w[KEY].clone()},
            "the base has no Linear layer 'model.layers.0.mlp.nope'",
        ),
        (
            None,
            lambda w: {
                **w,
                KEY.replace("lora_A.weight", "lora_magnitude_vector"): w[KEY][0].clone(),
            },
            "lora_magnitude_vector: not a LoRA A/B weight",
        ),
    ],
)
def test_bad_adapters_are_refused_naming_file_and_key(
    loaded, adapters, checkpoint, tmp_path, config, tensors, message
):
    bad = copy_adapter(adapters["lev"], tmp_path / "bad", config, tensors)
    with pytest.raises(AdapterError) as refused:
        AdapterBank(loaded.model).add("bad", bad, base_names=("test/base", str(checkpoint)))
    assert message in str(refused.value)
    assert str(bad) in str(refused.value)


def test_missing_files_and_the_named_base(loaded, adapters, tmp_path, checkpoint):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(AdapterError, match="adapter_config.json: missing"):
        AdapterBank(loaded.model).add("x", empty)
    # PEFT wrote the base's directory as base_model_name_or_path: accepted under that name.
    bank = AdapterBank(loaded.model)
    bank.add("lev", adapters["lev"], base_names=("test/base", str(checkpoint)))
    bank.close()
    with pytest.raises(AdapterError, match="is not the served base"):
        AdapterBank(loaded.model).add("lev", adapters["lev"], base_names=("test/base",))


def test_rows_over_each_models_own_state_in_one_forward(bank, loaded, adapters, checkpoint):
    """A state prefilled under each model, forked together into one suffix forward: every row
    equals PEFT's plain forward of the whole prompt under its model; a state prefilled under
    another model gives another answer (why the state cache's key holds the model)."""
    from semif_serve.engine.adapters import stacked_fork
    from semif_serve.engine.forwards import logits_over, prefill
    from semif_serve.engine.state_cache import StoredState

    state = prompts(1, 20, seed=3)[0].tolist()
    suffixes = [row.tolist() for row in prompts(4, 5, seed=4)]
    suffixes[3] = suffixes[3][:3]  # right-padded rows
    names = ["lev", "lev", "rs", None]
    stored = {}
    for name in ("lev", "rs", None):
        with bank.rows(BASE if name is None else bank.index(name)):
            stored[name] = StoredState(state, prefill(loaded.model, state, chunk_tokens=8))
    rows = [BASE if n is None else bank.index(n) for n in names]
    cache = stacked_fork([(stored["lev"], 2), (stored["rs"], 1), (stored[None], 1)])
    with bank.rows(rows):
        logits = logits_over(loaded.model, cache, len(state), suffixes, 0)
    for i, name in enumerate(names):
        full = torch.tensor([state + suffixes[i]])
        reference = peft_logits(checkpoint, adapters[name] if name else None, full)[0, -1]
        torch.testing.assert_close(logits[i], reference, atol=ATOL, rtol=0)
    with bank.rows(bank.index("lev")):
        crossed = logits_over(loaded.model, stored[None].fork(1), len(state), suffixes[:1], 0)
    assert (crossed[0] - logits[0]).abs().max() > 1e-3
