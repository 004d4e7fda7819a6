"""Images through the production loader and engine, on the tiny random-weight vision checkpoint:
every readout with an image equals an independent computation, transformers' own image
processor and tokenizer and one full forward of `Qwen3_5ForConditionalGeneration` on the whole
prompt (the model places the image features and computes its own 3-D positions), with the
softmax written out. Alone, shared with other questions, with orderings, merged with another
request, from the state cache, chunked, with the image in the state, a question or an option.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import math
import random

import pytest
import torch
from conftest import make_settings
from PIL import Image

from semif_serve.domain.images import read_image
from semif_serve.domain.types import PromptRow
from semif_serve.engine import vision
from semif_serve.engine.memory import ReleasePolicy
from semif_serve.engine.state_cache import StateCache
from semif_serve.engine.worker import EngineWorker
from semif_serve.service.startup import load_engine
from semif_serve.tools.demo import write_checkpoint

TOL = 1e-5
MAX_TOKENS = 4096
PHOTO = "<image:photo>"
STATE = {"photo": PHOTO, "caption": "a product photo"}
RED = ("Is the object in the photo red?", ("Yes, it is red.", "No, it is not."))
SHAPE = ("Which shape is shown?", ("A square.", "A circle.", "A triangle."))


def noise_png(seed: int, size=(40, 24)) -> bytes:
    rng = random.Random(seed)
    raw = bytes(rng.getrandbits(8) for _ in range(size[0] * size[1] * 3))
    out = io.BytesIO()
    Image.frombytes("RGB", size, raw).save(out, format="PNG")
    return out.getvalue()


def asset(data: bytes, placeholder: str = PHOTO):
    return read_image(placeholder, data, claimed=None, max_pixels=10**7)


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("vl-engine"), multimodal=True)


@pytest.fixture(scope="module")
def reference(vl_checkpoint):
    """The independent side: transformers' classes loaded on their own, in float32."""
    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(str(vl_checkpoint))
    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(vl_checkpoint), dtype=torch.float32).eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def vl_engine(vl_checkpoint):
    return load_engine(make_settings(vl_checkpoint))


def expected_row(reference, engine, state, question, options, images: dict[str, bytes]):
    """Slot logits and softmax of the last position of one full forward of the whole prompt."""
    model, tokenizer = reference
    text = engine.codec.render_prompt(state, question, options)
    merge = model.config.vision_config.spatial_merge_size
    processor = vision.image_processor(model.config)
    order = sorted((text.index(p), p) for p in images if p in text)
    shown = []
    at = 0
    pieces = []
    for _, placeholder in order:  # each placeholder where it stands, once (these tests use it once)
        cut = text.index(placeholder, at)
        pixels = processor(images=[Image.open(io.BytesIO(images[placeholder])).convert("RGB")], return_tensors="pt")
        count = int(pixels["image_grid_thw"].prod()) // merge**2
        pieces.append(text[at:cut] + vision.VISION_START + vision.IMAGE_PAD * count + vision.VISION_END)
        shown.append(pixels)
        at = cut + len(placeholder)
    pieces.append(text[at:])
    ids = torch.tensor([tokenizer.encode("".join(pieces), add_special_tokens=False)])
    pad = tokenizer.convert_tokens_to_ids(vision.IMAGE_PAD)
    extra = {}
    if shown:
        extra = dict(
            pixel_values=torch.cat([p["pixel_values"] for p in shown]),
            image_grid_thw=torch.cat([p["image_grid_thw"] for p in shown]),
        )
    with torch.inference_mode():
        logits = model(input_ids=ids, mm_token_type_ids=(ids == pad).int(), **extra).logits[0, -1].float()
    slots = [tokenizer.convert_tokens_to_ids(chr(ord("A") + i)) for i in range(len(options))]
    chosen = [float(logits[s]) for s in slots]
    top = max(chosen)
    exps = [math.exp(v - top) for v in chosen]
    return chosen, [e / sum(exps) for e in exps], ids.shape[1]


def assert_row(row, expected):
    logits, probabilities, tokens = expected
    assert max(abs(a - b) for a, b in zip(row.option_logits, logits, strict=True)) < TOL
    assert max(abs(a - b) for a, b in zip(row.probabilities, probabilities, strict=True)) < TOL
    assert row.input_tokens == tokens


def score(engine, rows, images, state=STATE, shared=False):
    return engine.score(
        state,
        [PromptRow(q, o) for q, o in rows],
        shared=shared,
        max_input_tokens=MAX_TOKENS,
        images=[asset(data, name) for name, data in images.items()],
    )


def test_the_loader_gives_a_vision_checkpoint_its_vision_tower(vl_engine, engine):
    assert vl_engine.reads_images
    assert not engine.reads_images


def test_a_lone_question_over_an_image_equals_the_full_forward_of_its_prompt(vl_engine, reference):
    data = noise_png(1)
    readout = score(vl_engine.with_state_cache(StateCache(0), None), [RED], {PHOTO: data})
    assert_row(readout.rows[0], expected_row(reference, vl_engine, STATE, *RED, {PHOTO: data}))


@pytest.mark.parametrize("chunk", [None, 7])
def test_shared_questions_over_one_image_equal_the_full_forward_of_each_prompt(vl_engine, reference, chunk):
    data = noise_png(2)
    engine = vl_engine.with_state_cache(StateCache(1 << 30), chunk)  # chunks of 7 split the image
    readout = score(engine, [RED, SHAPE], {PHOTO: data})
    assert readout.shared and readout.timing.prefix_tokens > 60  # the image is in the prefix
    for row, (q, o) in zip(readout.rows, [RED, SHAPE], strict=True):
        assert_row(row, expected_row(reference, vl_engine, STATE, q, o, {PHOTO: data}))


def test_orderings_of_one_question_over_an_image_each_equal_their_full_forward(vl_engine, reference):
    data = noise_png(3)
    question, options = SHAPE
    orders = [options, options[::-1], (options[1], options[2], options[0])]
    readout = score(vl_engine, [(question, o) for o in orders], {PHOTO: data}, shared=True)
    for row, order in zip(readout.rows, orders, strict=True):
        assert_row(row, expected_row(reference, vl_engine, STATE, question, order, {PHOTO: data}))


def test_a_second_request_over_the_same_image_is_served_from_the_cache_and_reads_the_same(
    vl_engine, reference
):
    data = noise_png(4)
    engine = vl_engine.with_state_cache(StateCache(1 << 30), None)
    first = score(engine, [RED], {PHOTO: data})
    second = score(engine, [SHAPE], {PHOTO: data})
    assert first.lone_timing.prefill == "fresh" and second.lone_timing.prefill == "cached"
    assert_row(second.rows[0], expected_row(reference, vl_engine, STATE, *SHAPE, {PHOTO: data}))


def test_a_cached_image_state_is_never_served_for_another_image(vl_engine, reference):
    engine = vl_engine.with_state_cache(StateCache(1 << 30), None)
    red, blue = noise_png(5), noise_png(6)
    a = score(engine, [RED], {PHOTO: red})
    b = score(engine, [RED], {PHOTO: blue})
    assert b.lone_timing.prefill == "fresh"
    assert_row(b.rows[0], expected_row(reference, vl_engine, STATE, *RED, {PHOTO: blue}))
    assert max(abs(x - y) for x, y in zip(a.rows[0].option_logits, b.rows[0].option_logits, strict=True)) > 1e-4
    assert a.rows[0].prompt_sha256 != b.rows[0].prompt_sha256


def test_the_prompt_digest_covers_the_text_then_each_images_digest(vl_engine):
    data = noise_png(7)
    readout = score(vl_engine, [RED], {PHOTO: data})
    text = vl_engine.codec.render_prompt(STATE, *RED)
    expected = hashlib.sha256(text.encode() + hashlib.sha256(data).hexdigest().encode()).hexdigest()
    assert readout.rows[0].prompt_sha256 == expected


def test_images_in_a_question_and_in_an_option_are_read_where_they_stand(vl_engine, reference):
    state = {"caption": "two photos"}
    pictures = {"<image:q>": noise_png(8), "<image:o>": noise_png(9, size=(24, 32))}
    question = ("Does <image:q> show the product?", ("Yes, like <image:o>.", "No."))
    engine = vl_engine.with_state_cache(StateCache(1 << 30), None)
    readout = score(engine, [question, RED], pictures, state=state)
    assert_row(readout.rows[0], expected_row(reference, vl_engine, state, *question, pictures))
    assert_row(readout.rows[1], expected_row(reference, vl_engine, state, *RED, pictures))


def test_requests_merged_in_one_forward_each_read_their_own_image(vl_engine, reference):
    engine = vl_engine.with_state_cache(StateCache(1 << 30), None)
    worker = EngineWorker(ReleasePolicy(engine.memory, 0))
    calls = [(noise_png(10), RED), (noise_png(10), SHAPE), (noise_png(11), RED)]

    async def go():
        return await asyncio.gather(
            *(
                worker.score(
                    engine,
                    STATE,
                    [PromptRow(*row)],
                    shared=False,
                    max_input_tokens=MAX_TOKENS,
                    images=[asset(data)],
                )
                for data, row in calls
            )
        )

    try:
        readouts = asyncio.run(go())
    finally:
        worker.shutdown()
    for readout, (data, (q, o)) in zip(readouts, calls, strict=True):
        assert_row(readout.rows[0], expected_row(reference, vl_engine, STATE, q, o, {PHOTO: data}))


def test_image_tokens_count_toward_the_per_row_token_limit(vl_engine):
    from semif_serve.domain.types import TooManyTokens

    text_only = score(vl_engine, [RED], {}, state={"photo": "x", "caption": "a product photo"})
    with pytest.raises(TooManyTokens):
        vl_engine.score(
            STATE,
            [PromptRow(*RED)],
            shared=False,
            max_input_tokens=text_only.rows[0].input_tokens + 10,
            images=[asset(noise_png(12))],
        )
