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

import pytest

from semif_serve.domain.images import read_image
from semif_serve.domain.requests import RowsRequest
from semif_serve.domain.types import PromptRow
from semif_serve.engine.memory import ReleasePolicy
from semif_serve.engine.state_cache import StateCache
from semif_serve.engine.worker import EngineWorker
from tests.support import scoring
from tests.support.vision_reference import expected_row, noise_png

TOL = 1e-5
MAX_TOKENS = 4096
PHOTO = "<image:photo>"
STATE = {"photo": PHOTO, "caption": "a product photo"}
RED = ("Is the object in the photo red?", ("Yes, it is red.", "No, it is not."))
SHAPE = ("Which shape is shown?", ("A square.", "A circle.", "A triangle."))


def asset(data: bytes, placeholder: str = PHOTO):
    return read_image(placeholder, data, claimed=None, max_pixels=10**7)


def expected(reference, engine, state, question, options, images):
    return expected_row(reference, engine.codec.render_prompt(state, question, options), len(options), images)


def assert_row(row, expected):
    logits, probabilities, tokens = expected
    assert max(abs(a - b) for a, b in zip(row.option_logits, logits, strict=True)) < TOL
    assert max(abs(a - b) for a, b in zip(row.probabilities, probabilities, strict=True)) < TOL
    assert row.input_tokens == tokens


def score(engine, rows, images, state=STATE, shared=False):
    return engine.read(
        RowsRequest.of(
            state,
            [PromptRow(q, o) for q, o in rows],
            shared=shared,
            max_input_tokens=MAX_TOKENS,
            images=[asset(data, name) for name, data in images.items()],
        )
    )


def test_the_loader_gives_a_vision_checkpoint_its_vision_tower(vision_engine, engine):
    assert vision_engine.reads_images
    assert not engine.reads_images


def test_a_lone_question_over_an_image_equals_the_full_forward_of_its_prompt(vision_engine, vision_reference):
    data = noise_png(1)
    readout = score(
        vision_engine.with_options(cache=StateCache(0), prefill_chunk_tokens=None), [RED], {PHOTO: data}
    )
    assert_row(readout.rows[0], expected(vision_reference, vision_engine, STATE, *RED, {PHOTO: data}))


@pytest.mark.parametrize("chunk", [None, 7])
def test_shared_questions_over_one_image_equal_the_full_forward_of_each_prompt(
    vision_engine, vision_reference, chunk
):
    data = noise_png(2)
    engine = vision_engine.with_options(
        cache=StateCache(1 << 30), prefill_chunk_tokens=chunk
    )  # chunks of 7 split the image
    readout = score(engine, [RED, SHAPE], {PHOTO: data})
    assert readout.shared and readout.timing.prefix_tokens > 60  # the image is in the prefix
    for row, (q, o) in zip(readout.rows, [RED, SHAPE], strict=True):
        assert_row(row, expected(vision_reference, vision_engine, STATE, q, o, {PHOTO: data}))


def test_orderings_of_one_question_over_an_image_each_equal_their_full_forward(
    vision_engine, vision_reference
):
    data = noise_png(3)
    question, options = SHAPE
    orders = [options, options[::-1], (options[1], options[2], options[0])]
    readout = score(vision_engine, [(question, o) for o in orders], {PHOTO: data}, shared=True)
    for row, order in zip(readout.rows, orders, strict=True):
        assert_row(row, expected(vision_reference, vision_engine, STATE, question, order, {PHOTO: data}))


def test_a_second_request_over_the_same_image_is_served_from_the_cache_and_reads_the_same(
    vision_engine, vision_reference
):
    data = noise_png(4)
    engine = vision_engine.with_options(cache=StateCache(1 << 30), prefill_chunk_tokens=None)
    first = score(engine, [RED], {PHOTO: data})
    second = score(engine, [SHAPE], {PHOTO: data})
    assert first.timing.prefill == "fresh" and second.timing.prefill == "cached"
    assert_row(second.rows[0], expected(vision_reference, vision_engine, STATE, *SHAPE, {PHOTO: data}))


def test_a_cached_image_state_is_never_served_for_another_image(vision_engine, vision_reference):
    engine = vision_engine.with_options(cache=StateCache(1 << 30), prefill_chunk_tokens=None)
    red, blue = noise_png(5), noise_png(6)
    a = score(engine, [RED], {PHOTO: red})
    b = score(engine, [RED], {PHOTO: blue})
    assert b.timing.prefill == "fresh"
    assert_row(b.rows[0], expected(vision_reference, vision_engine, STATE, *RED, {PHOTO: blue}))
    assert (
        max(abs(x - y) for x, y in zip(a.rows[0].option_logits, b.rows[0].option_logits, strict=True)) > 1e-4
    )
    assert a.rows[0].prompt_sha256 != b.rows[0].prompt_sha256


def test_the_prompt_digest_covers_the_text_then_each_images_digest(vision_engine):
    data = noise_png(7)
    readout = score(vision_engine, [RED], {PHOTO: data})
    text = vision_engine.codec.render_prompt(STATE, *RED)
    expected = hashlib.sha256(text.encode() + hashlib.sha256(data).hexdigest().encode()).hexdigest()
    assert readout.rows[0].prompt_sha256 == expected


def test_images_in_a_question_and_in_an_option_are_read_where_they_stand(vision_engine, vision_reference):
    state = {"caption": "two photos"}
    pictures = {"<image:q>": noise_png(8), "<image:o>": noise_png(9, size=(24, 32))}
    question = ("Does <image:q> show the product?", ("Yes, like <image:o>.", "No."))
    engine = vision_engine.with_options(cache=StateCache(1 << 30), prefill_chunk_tokens=None)
    readout = score(engine, [question, RED], pictures, state=state)
    assert_row(readout.rows[0], expected(vision_reference, vision_engine, state, *question, pictures))
    assert_row(readout.rows[1], expected(vision_reference, vision_engine, state, *RED, pictures))


def test_requests_merged_in_one_forward_each_read_their_own_image(vision_engine, vision_reference):
    engine = vision_engine.with_options(cache=StateCache(1 << 30), prefill_chunk_tokens=None)
    worker = EngineWorker(engine, ReleasePolicy(engine.memory, 0))
    calls = [(noise_png(10), RED), (noise_png(10), SHAPE), (noise_png(11), RED)]

    async def go():
        return await asyncio.gather(
            *(
                scoring.score(
                    worker,
                    RowsRequest.of(
                        STATE,
                        [PromptRow(*row)],
                        shared=False,
                        max_input_tokens=MAX_TOKENS,
                        images=[asset(data)],
                    ),
                )
                for data, row in calls
            )
        )

    try:
        readouts = asyncio.run(go())
    finally:
        worker.shutdown()
    for readout, (data, (q, o)) in zip(readouts, calls, strict=True):
        assert_row(readout.rows[0], expected(vision_reference, vision_engine, STATE, q, o, {PHOTO: data}))


def test_image_tokens_count_toward_the_request_token_budget(vision_engine):
    from semif_serve.domain.types import TooManyTokens

    text_only = vision_engine.read(
        RowsRequest.of(
            {"photo": "x", "caption": "a product photo"},
            [PromptRow(*RED)],
            shared=True,
            max_input_tokens=MAX_TOKENS,
        )
    )
    budget = text_only.timing.prefix_tokens + text_only.timing.true_suffix_tokens + 10
    with pytest.raises(TooManyTokens):
        vision_engine.read(
            RowsRequest.of(
                STATE,
                [PromptRow(*RED)],
                shared=True,
                max_input_tokens=MAX_TOKENS,
                max_request_tokens=budget,
                images=[asset(noise_png(16))],
            )
        )


def test_image_tokens_count_toward_the_per_row_token_limit(vision_engine):
    from semif_serve.domain.types import TooManyTokens

    text_only = score(vision_engine, [RED], {}, state={"photo": "x", "caption": "a product photo"})
    with pytest.raises(TooManyTokens):
        vision_engine.read(
            RowsRequest.of(
                STATE,
                [PromptRow(*RED)],
                shared=False,
                max_input_tokens=text_only.rows[0].input_tokens + 10,
                images=[asset(noise_png(12))],
            )
        )


def test_the_vision_tower_and_the_decoder_run_once_per_image_of_a_request_and_not_for_a_cached_state(
    vision_engine, monkeypatch
):
    inner = vision_engine.vision.model.model
    calls: list[int] = []
    real = inner.get_image_features

    def counted(pixel_values, grid, *args, **kwargs):
        calls.append(int(pixel_values.shape[0]))
        return real(pixel_values, grid, *args, **kwargs)

    monkeypatch.setattr(inner, "get_image_features", counted)
    decoded: list[str] = []
    real_pixels = vision_engine.vision.pixels

    def decode(image):
        decoded.append(image.asset.sha256)
        return real_pixels(image)

    monkeypatch.setattr(vision_engine.vision, "pixels", decode)
    engine = vision_engine.with_options(
        cache=StateCache(1 << 30), prefill_chunk_tokens=7
    )  # many prefill steps over the image
    question, options = SHAPE
    rows = [RED, (question, options), (question, options[::-1])]
    score(engine, rows, {PHOTO: noise_png(13)}, shared=True)
    assert len(calls) == 1
    score(engine, [SHAPE], {PHOTO: noise_png(13)})  # the state over that image is cached
    assert len(calls) == 1 and len(decoded) == 1  # neither the tower nor the decoder ran again
    two = {PHOTO: noise_png(14), "<image:other>": noise_png(15)}
    score(engine, [RED], two, state={"a": PHOTO, "b": "<image:other>"})
    assert len(calls) == 3


@pytest.mark.parametrize("size", [(1, 1), (3, 590), (600, 4)])
def test_tiny_and_extreme_images_are_read_as_the_processor_resizes_them(
    vision_engine, vision_reference, size
):
    data = noise_png(17, size=size)
    readout = score(vision_engine, [RED], {PHOTO: data})
    assert_row(readout.rows[0], expected(vision_reference, vision_engine, STATE, *RED, {PHOTO: data}))


def test_requests_merged_over_one_image_run_the_tower_once_across_prefill_steps(vision_engine, monkeypatch):
    from semif_serve.engine.batching import UNFINISHED, Group, Part

    inner = vision_engine.vision.model.model
    calls: list[int] = []
    real = inner.get_image_features
    monkeypatch.setattr(inner, "get_image_features", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    engine = vision_engine.with_options(
        cache=StateCache(1 << 30), prefill_chunk_tokens=7
    )  # the image state takes many steps
    data = noise_png(18)
    jobs = [
        engine.prepare(
            RowsRequest.of(
                STATE,
                [PromptRow(*RED), PromptRow(*SHAPE)],
                shared=True,
                max_input_tokens=MAX_TOKENS,
                images=[asset(data)],
            )
        ).job(i)
        for i in range(3)
    ]
    group = Group(
        jobs[0].prefix_key, jobs[0].prefix_tokens, tuple(Part(j, 0, len(j.row_tokens)) for j in jobs)
    )
    steps = 0
    while (scored := engine.run_group(group)) is UNFINISHED:
        steps += 1
    assert steps > 3 and len(calls) == 1  # one tower run for the three requests, over every step
    for a, b in zip(scored[0], scored[2], strict=True):
        assert max(abs(x - y) for x, y in zip(a.option_logits, b.option_logits, strict=True)) < TOL


def test_a_sixteen_bit_grey_png_reads_as_its_eight_bit_twin_not_as_white(vision_engine):
    import io

    import numpy as np
    from PIL import Image

    ramp = np.tile(np.linspace(0, 65535, 40, dtype=np.uint16), (24, 1))

    def saved(array) -> bytes:
        out = io.BytesIO()
        Image.fromarray(array).save(out, format="PNG")  # uint16: a 16-bit grey PNG
        return out.getvalue()

    deep, reversed_deep = saved(ramp), saved(ramp[:, ::-1].copy())
    twin = saved((ramp >> 8).astype(np.uint8))
    assert Image.open(io.BytesIO(deep)).mode.startswith("I")
    a, b, c = (
        score(vision_engine, [RED], {PHOTO: d}).rows[0].option_logits for d in (deep, twin, reversed_deep)
    )
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < TOL
    assert max(abs(x - y) for x, y in zip(a, c, strict=True)) > 1e-6  # the gradient is seen, not clipped


def test_a_jpeg_turned_by_its_exif_orientation_is_read_upright(vision_engine):
    import io

    from PIL import Image

    stored = Image.open(io.BytesIO(noise_png(19, size=(40, 16)))).convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 6  # turn 90 degrees clockwise to view
    turned = io.BytesIO()
    stored.save(turned, format="JPEG", exif=exif, quality=95)
    viewed = Image.open(io.BytesIO(turned.getvalue())).convert("RGB").transpose(Image.Transpose.ROTATE_270)
    upright = io.BytesIO()
    viewed.save(upright, format="PNG")
    image = asset(turned.getvalue())
    assert (image.width, image.height) == (16, 40)
    a = score(vision_engine, [RED], {PHOTO: turned.getvalue()}).rows[0]
    b = score(vision_engine, [RED], {PHOTO: upright.getvalue()}).rows[0]
    assert a.input_tokens == b.input_tokens
    assert max(abs(x - y) for x, y in zip(a.option_logits, b.option_logits, strict=True)) < TOL


def test_two_images_whose_digests_share_their_first_60_bits_never_share_a_state(
    vision_engine, vision_reference
):
    import dataclasses

    from semif_serve.engine.vision import image_token_ids

    red, blue = noise_png(20), noise_png(21)
    # Digests chosen to agree in their first 60 bits (15 hex digits), as a colliding pair would.
    a = dataclasses.replace(asset(red), sha256="0" * 15 + "a" * 49)
    b = dataclasses.replace(asset(blue), sha256="0" * 15 + "b" * 49)
    assert image_token_ids(a.sha256, 8)[0] == image_token_ids(b.sha256, 8)[0]
    assert image_token_ids(a.sha256, 8) != image_token_ids(b.sha256, 8)
    engine = vision_engine.with_options(cache=StateCache(1 << 30), prefill_chunk_tokens=None)
    rows = [PromptRow(*RED)]
    engine.read(RowsRequest.of(STATE, rows, shared=False, max_input_tokens=MAX_TOKENS, images=[a]))
    second = engine.read(RowsRequest.of(STATE, rows, shared=False, max_input_tokens=MAX_TOKENS, images=[b]))
    assert second.timing.prefill == "fresh"
    assert_row(second.rows[0], expected(vision_reference, vision_engine, STATE, *RED, {PHOTO: blue}))
