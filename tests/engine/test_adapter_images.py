"""Images under a served adapter: a question over an image, read by an adapter, equals one full
forward of transformers' own multimodal model with the adapter's LoRA merged into its language
model by hand (W + scale B A, PEFT's scale alpha / r), alone, shared, and from the state cache;
the base's state over the same image is never served to the adapter."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from semif_serve.domain.requests import RowsRequest
from semif_serve.domain.types import PromptRow
from semif_serve.engine.adapters import AdapterBank
from semif_serve.engine.state_cache import StateCache
from semif_serve.service.startup import load_engine
from tests.engine.test_adapters import write_adapter
from tests.engine.test_images_engine import (
    MAX_TOKENS,
    PHOTO,
    RED,
    SHAPE,
    STATE,
    assert_row,
    asset,
    expected,
    score,
)
from tests.support import make_settings
from tests.support.vision_reference import load_reference, noise_png

TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapter(vision_checkpoint, tmp_path_factory):
    return write_adapter(
        vision_checkpoint,
        tmp_path_factory.mktemp("vision-adapter"),
        7,
        r=4,
        lora_alpha=8,
        target_modules=TARGETS,
    )


@pytest.fixture(scope="module")
def engine(vision_checkpoint, adapter):
    base = load_engine(make_settings(vision_checkpoint))
    bank = AdapterBank(base.model)
    bank.add("triage", adapter)
    yield base.with_adapters(bank).with_options(cache=StateCache(1 << 30))
    bank.close()


@pytest.fixture(scope="module")
def merged(vision_checkpoint, adapter):
    """transformers' multimodal model with the adapter's LoRA added into its language model."""
    model, tokenizer = load_reference(vision_checkpoint)
    config = json.loads((adapter / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    modules = dict(model.named_modules())
    changed = 0
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            path = key.removeprefix("base_model.model.").split(".lora_A.")[0]
            target = modules[path.replace("model.layers.", "model.language_model.layers.", 1)]
            target.weight += scale * (b @ a)
            changed += 1
    assert changed > 0
    return model, tokenizer


def test_a_lone_question_over_an_image_read_by_an_adapter_equals_the_merged_models_forward(engine, merged):
    data = noise_png(3)
    readout = score_under(engine, [RED], data)
    assert_row(readout.rows[0], expected(merged, engine, STATE, *RED, {PHOTO: data}))


def test_shared_questions_over_an_image_under_an_adapter_never_read_the_bases_state(engine, merged):
    data = noise_png(4)
    base = score(engine, [RED, SHAPE], {PHOTO: data}, shared=True)  # the base keeps its own state
    assert base.timing.prefill == "fresh"
    first = score_under(engine, [RED, SHAPE], data, shared=True)
    again = score_under(engine, [RED, SHAPE], data, shared=True)
    assert (first.timing.prefill, again.timing.prefill) == ("fresh", "cached")
    for readout in (first, again):
        for row, (q, o) in zip(readout.rows, [RED, SHAPE], strict=True):
            assert_row(row, expected(merged, engine, STATE, q, o, {PHOTO: data}))


def score_under(engine, rows, data, shared=False):
    """`score` with the rows read by the adapter `triage`."""
    request = RowsRequest.of(
        STATE,
        [PromptRow(q, o) for q, o in rows],
        shared=shared,
        max_input_tokens=MAX_TOKENS,
        images=[asset(data, PHOTO)],
        adapter=engine.adapters.index("triage"),
    )
    return engine.read(request)
