"""The image path's building blocks (engine/vision.py) on a tiny random-weight Qwen3.5
vision-language checkpoint (the demo writer's, with a vision tower), against an independent
computation: transformers' own image processor and a full forward of the vision-language
model on the whole prompt (the model places the image features and computes its own 3-D
positions). `Qwen3VLProcessor` itself cannot be built here: its video processor needs
torchvision, which the project does not install; the pads are expanded by hand from the grid.
"""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from acceptance import image_reference
from semif_serve.domain.images import read_image
from semif_serve.domain.prompt import PromptCodec
from semif_serve.engine import vision
from semif_serve.engine.state_cache import fork_cache
from semif_serve.tools.demo import write_checkpoint
from tests.support.vision_reference import noise_png, vision_tower_elements

TOL = 1e-5
STATE = {"photo": "<image:photo>", "caption": "a product photo"}
QUESTIONS = [
    ("Is the object in the photo red?", ["Yes, it is red.", "No, it is not."]),
    ("Which shape is shown?", ["A square.", "A circle.", "A triangle."]),
]


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

    directory = write_checkpoint(tmp_path_factory.mktemp("vl-model"), multimodal=True)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(directory), dtype=torch.float32).eval()
    model.directory = directory
    return model, tokenizer


def prompt_text(tokenizer, question: str, options: list[str]) -> str:
    text = PromptCodec(tokenizer).render_prompt(STATE, question, options)
    return text.replace("<image:photo>", vision.VISION_BLOCK)


def full_forward(model, tokenizer, text: str, data: bytes):
    """transformers' processor for the pixels, the pads expanded from its grid, one forward of
    the whole vision-language model; the last position's logits."""
    processor = vision.image_processor(model.config)
    pixels = processor(images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt")
    merge = model.config.vision_config.spatial_merge_size
    count = int(pixels["image_grid_thw"].prod()) // merge**2
    ids = torch.tensor(
        [tokenizer.encode(text.replace(vision.IMAGE_PAD, vision.IMAGE_PAD * count), add_special_tokens=False)]
    )
    pad = tokenizer.convert_tokens_to_ids(vision.IMAGE_PAD)
    with torch.inference_mode():
        out = model(
            input_ids=ids,
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
            mm_token_type_ids=(ids == pad).int(),
            logits_to_keep=1,
        )
    return out.logits[0, -1].float(), ids[0].tolist()


class Prefix:
    """The image path: pixels, pads, features once, embeddings, positions and a prefill."""

    def __init__(self, model, tokenizer, data: bytes) -> None:
        self.model = model
        self.pad = tokenizer.convert_tokens_to_ids(vision.IMAGE_PAD)
        self.asset = read_image("<image:photo>", data, claimed="png", max_pixels=10**6)
        merge = model.config.vision_config.spatial_merge_size
        self.pixels = vision.preprocess(vision.image_processor(model.config), [self.asset], merge)
        self.features = image_reference.image_features(model, self.pixels)
        self.tokenizer = tokenizer

    def ids(self, text: str) -> list[int]:
        return image_reference.expand_image_pads(
            self.tokenizer.encode(text, add_special_tokens=False), self.pad, self.pixels.tokens
        )

    def state(self, prefix: list[int], chunk: int | None = None, flat: bool = False):
        embeds = image_reference.prefix_embeddings(self.model, prefix, self.pad, self.features)
        positions, offset = image_reference.rope_positions(self.model, prefix, self.pad, self.pixels.grid_thw)
        if flat:  # plain 1-D positions on all three axes, as a text-only path would give
            positions, offset = torch.arange(len(prefix))[None, None].expand(3, 1, -1), 0
        return image_reference.prefill_embeddings(self.model, embeds, positions, chunk), offset

    def rows(self, prefix: list[int], suffixes: list[list[int]], chunk: int | None = None, flat=False):
        cache, offset = self.state(prefix, chunk, flat)
        return image_reference.suffix_logits_after_images(
            self.model, fork_cache(cache, len(suffixes)), len(prefix), offset, suffixes, 0
        )


def common_prefix(rows: list[list[int]]) -> int:
    n = 0
    while all(len(r) > n + 1 for r in rows) and len({r[n] for r in rows}) == 1:
        n += 1
    return n


def test_the_pixels_and_the_token_ids_are_the_processors(vl):
    model, tokenizer = vl
    data = noise_png(0)
    text = prompt_text(tokenizer, *QUESTIONS[0])
    _, ids = full_forward(model, tokenizer, text, data)
    prefix = Prefix(model, tokenizer, data)
    assert prefix.ids(text) == ids
    assert prefix.pixels.tokens == (60,)  # 40 x 24 -> 20 x 12 patches of 4 -> 10 x 6 merged by 2


@pytest.mark.parametrize("chunk", [None, 7, 32])
def test_shared_questions_over_an_image_state_equal_the_full_forward_of_each_prompt(vl, chunk):
    model, tokenizer = vl
    data = noise_png(1)
    prefix = Prefix(model, tokenizer, data)
    texts = [prompt_text(tokenizer, q, o) for q, o in QUESTIONS]
    rows = [prefix.ids(t) for t in texts]
    n = common_prefix(rows)
    assert n > max(i for i, t in enumerate(rows[0]) if t == prefix.pad)  # the image is in the prefix
    got = prefix.rows(rows[0][:n], [r[n:] for r in rows], chunk)  # chunk 7 splits the image
    for row, text in zip(got, texts, strict=True):
        expected, _ = full_forward(model, tokenizer, text, data)
        assert torch.allclose(row, expected, atol=TOL), (row - expected).abs().max()


def test_rows_in_another_order_read_the_same(vl):
    model, tokenizer = vl
    prefix = Prefix(model, tokenizer, noise_png(2))
    rows = [prefix.ids(prompt_text(tokenizer, q, o)) for q, o in QUESTIONS]
    n = common_prefix(rows)
    forward = prefix.rows(rows[0][:n], [r[n:] for r in rows])
    backward = prefix.rows(rows[0][:n], [r[n:] for r in reversed(rows)])
    assert torch.allclose(forward, backward.flip(0), atol=TOL)


def test_plain_one_dimensional_positions_read_the_image_wrong(vl):
    model, tokenizer = vl
    data = noise_png(3)
    prefix = Prefix(model, tokenizer, data)
    text = prompt_text(tokenizer, *QUESTIONS[0])
    ids = prefix.ids(text)
    n = max(i for i, t in enumerate(ids) if t == prefix.pad) + 5
    expected, _ = full_forward(model, tokenizer, text, data)
    right = prefix.rows(ids[:n], [ids[n:]])[0]
    wrong = prefix.rows(ids[:n], [ids[n:]], flat=True)[0]
    assert torch.allclose(right, expected, atol=TOL)
    assert (wrong - expected).abs().max() > 1e-3


def test_two_images_share_their_token_ids_but_not_their_answers_or_digests(vl):
    model, tokenizer = vl
    text = prompt_text(tokenizer, *QUESTIONS[0])
    red, blue = Prefix(model, tokenizer, noise_png(4)), Prefix(model, tokenizer, noise_png(5))
    ids = red.ids(text)
    assert ids == blue.ids(text)  # a cache keyed by token ids alone would mix them up
    assert red.asset.sha256 != blue.asset.sha256
    n = max(i for i, t in enumerate(ids) if t == red.pad) + 5
    a, b = red.rows(ids[:n], [ids[n:]])[0], blue.rows(ids[:n], [ids[n:]])[0]
    assert (a - b).abs().max() > 1e-4


def test_pads_and_images_must_agree_in_number():
    with pytest.raises(ValueError, match="2 image pads in the prompt for 1 images"):
        image_reference.expand_image_pads([1, 9, 2, 9], 9, [3])
    assert image_reference.expand_image_pads([1, 9, 2, 9], 9, [2, 1]) == [1, 9, 9, 2, 9]


def test_a_vision_checkpoint_is_told_from_a_text_one(vl, checkpoint):
    from transformers import AutoConfig

    assert vision.has_vision_tower(vl[0].config)
    assert not vision.has_vision_tower(AutoConfig.from_pretrained(str(checkpoint)))


def test_the_vision_towers_weights_are_counted_from_the_checkpoint_headers(vl, checkpoint):
    model, _ = vl
    loaded = sum(p.numel() for p in model.model.visual.parameters())
    assert loaded > 0
    assert vision_tower_elements(model.directory) == loaded
    assert vision_tower_elements(checkpoint) == 0
