"""The vision tower in engine steps, on the demo's vision checkpoint: an image whose tower costs
more than one prefill chunk goes through it a piece at a time (`engine.tower_steps.stepped_tower`),
each step at most about one chunk's FLOPs, with other requests' steps between. Its features
equal the tower's own forward bit for bit, its answers equal the independent full forward
(tests/support/vision_reference.py), the cost model equals torch's own FLOP count, and a tiny request
that arrives while an image is in the tower is served before the tower's next step (counted
through the engine's own calls, and over a live uvicorn)."""

from __future__ import annotations

import asyncio
import io
import threading
import time

import httpx
import pytest
import torch
from PIL import Image

from harness.server import LoopbackServer
from semif_serve.app import create_app
from semif_serve.domain.requests import RowsRequest
from semif_serve.domain.types import PromptRow
from semif_serve.engine.batching import UNFINISHED, Group
from semif_serve.engine.memory import ReleasePolicy
from semif_serve.engine.runner import TorchEngine, _whole
from semif_serve.engine.state_cache import StateCache
from semif_serve.engine.tower_steps import ATTENTION_ROWS, TowerPrices, TowerRun, query_slices
from semif_serve.engine.vision import ImageSet
from semif_serve.engine.worker import EngineWorker
from semif_serve.service.startup import Service
from tests.engine.test_images_engine import PHOTO, RED, SHAPE, STATE, assert_row, asset, expected
from tests.support import TOKEN, make_settings, scoring
from tests.support.vision_reference import noise_png

CHUNK = 16  # a prefill chunk of 16 tokens: a step's budget far below a 128 x 128 image's tower


def gradient_png(side: int) -> bytes:
    """A side x side PNG that compresses well (what it shows does not change the tower's cost)."""
    image = Image.linear_gradient("L").resize((side, side)).convert("RGB")
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def pixels_of(reference, data: bytes):
    """transformers' own processor output for one image: (pixel values, grid)."""
    from semif_serve.engine import vision

    processor = vision.image_processor(reference[0].config)
    out = processor(images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


@pytest.mark.parametrize("side", [128, 208])  # 1024 patches: one attention slice; 2704: three
def test_the_tower_in_pieces_equals_its_own_forward_bit_for_bit(vision_engine, vision_reference, side):
    pixels, grid = pixels_of(vision_reference, noise_png(side, size=(side, side)))
    with torch.inference_mode():
        want = vision_reference[0].model.get_image_features(pixels, grid).pooler_output[0]
    run = TowerRun(vision_engine.vision.model.model.visual, pixels, grid, ATTENTION_ROWS)
    while not run.advance(1):  # a budget of one FLOP: one piece per step
        pass
    patches = int(grid.prod())
    depth = vision_reference[0].config.vision_config.depth
    assert run.steps == 1 + depth * (2 + len(query_slices(patches, ATTENTION_ROWS))) + 1
    assert torch.equal(run.features, want)


def test_query_slices_cover_every_query_once_and_none_is_shorter_than_the_least():
    for n in (1, 767, 768, 1024, 1536, 2303, 2304, 2704, 65536):
        cuts = query_slices(n, ATTENTION_ROWS)
        assert [a for a, _ in cuts] == [0, *(b for _, b in cuts[:-1])] and cuts[-1][1] == n
        assert all(b - a >= ATTENTION_ROWS for a, b in cuts) or len(cuts) == 1


@pytest.mark.parametrize("side", [64, 128])
def test_the_cost_model_is_torchs_own_flop_count_of_the_tower(vision_checkpoint, vision_reference, side):
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen3_5ForConditionalGeneration

    # Eager attention: its matrix products are counted (torch counts no CPU fused attention).
    eager = {"attn_implementation": "eager"}
    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(vision_checkpoint), **eager)
    pixels, grid = pixels_of(vision_reference, noise_png(side, size=(side, side)))
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model.eval().model.get_image_features(pixels, grid)
    prices = TowerPrices.of(model.config.vision_config, int(grid.prod()))
    assert prices.total == counter.get_total_flops()


def test_an_answer_over_an_image_stepped_through_the_tower_equals_the_full_forward(
    vision_engine, vision_reference
):
    stepping = vision_engine.with_options(cache=StateCache(1 << 30), prefill_chunk_tokens=CHUNK)
    data = noise_png(31, size=(128, 128))
    rows = [PromptRow(*RED), PromptRow(*SHAPE)]
    prepared = stepping.prepare(
        RowsRequest.of(STATE, rows, shared=True, max_input_tokens=4096, images=[asset(data)])
    )
    job = prepared.job(0)
    group = Group(job.prefix_key, job.prefix_tokens, (_whole(job),))
    [image] = prepared.images.images.values()
    steps_in_tower = 0
    while (scored := stepping.run_group(group)) is UNFINISHED:
        steps_in_tower += image.key in prepared.images._runs
    assert steps_in_tower >= 4 and prepared.images.tower_runs == 1  # stem, projections, attention, output
    readout = stepping.readout(prepared, scored[0])
    for row, (question, options) in zip(readout.rows, (RED, SHAPE), strict=True):
        assert_row(row, expected(vision_reference, vision_engine, STATE, question, options, {PHOTO: data}))


@pytest.fixture
def events(monkeypatch) -> list[str]:
    """What the engine does, in order (through its own calls): "ready" when a text-only request
    is prepared (it goes to the batcher next), "tiny" for each group of one it starts, "tower"
    for each step of the tower."""
    seen: list[str] = []
    real_step = ImageSet.tower_step
    real_run = TorchEngine.run_groups
    real_prepare = TorchEngine.prepare

    def prepare(self, *args, **kwargs):
        prepared = real_prepare(self, *args, **kwargs)
        if prepared.images is None:
            seen.append("ready")
        return prepared

    def tower_step(self, keys, budget):
        stepped = real_step(self, keys, budget)
        if stepped:
            seen.append("tower")
        return stepped

    def run_groups(self, groups):
        seen.extend("tiny" for group in groups if group.parts[0].job.payload.images is None)
        return real_run(self, groups)

    monkeypatch.setattr(ImageSet, "tower_step", tower_step)
    monkeypatch.setattr(TorchEngine, "run_groups", run_groups)
    monkeypatch.setattr(TorchEngine, "prepare", prepare)
    return seen


def assert_served_within_one_tower_step(events: list[str]) -> None:
    """The tiny request's group started after at most one tower step from when it was ready
    (the step running then), and the tower had steps left after it."""
    start = events.index("tiny")
    ready = max(i for i in range(start) if events[i] == "ready")
    assert events[ready:start].count("tower") <= 1
    assert "tower" in events[start + 1 :]


def test_a_tower_step_that_fails_ends_its_run_and_a_retry_reads_the_image_afresh(
    vision_engine, vision_reference, monkeypatch
):
    from semif_serve.engine import tower_steps

    real = tower_steps.stepped_tower
    failures = [RuntimeError("out of memory in the third piece")]

    def stepped(*args):
        pieces = real(*args)
        if failures:  # the first run: its stem and projections run, then the attention fails
            for _ in range(3):
                yield next(pieces)
            raise failures.pop()
        return (yield from pieces)

    monkeypatch.setattr(tower_steps, "stepped_tower", stepped)
    stepping = vision_engine.with_options(cache=StateCache(1 << 30), prefill_chunk_tokens=CHUNK)
    data = noise_png(34, size=(128, 128))
    prepared = stepping.prepare(
        RowsRequest.of(STATE, [PromptRow(*RED)], shared=True, max_input_tokens=4096, images=[asset(data)])
    )
    job = prepared.job(0)
    group = Group(job.prefix_key, job.prefix_tokens, (_whole(job),))
    with pytest.raises(RuntimeError, match="third piece"):
        while stepping.run_group(group) is UNFINISHED:
            pass
    assert not prepared.images._runs
    while (scored := stepping.run_group(group)) is UNFINISHED:
        pass
    readout = stepping.readout(prepared, scored[0])
    assert_row(readout.rows[0], expected(vision_reference, vision_engine, STATE, *RED, {PHOTO: data}))


def test_a_small_image_still_runs_its_tower_in_the_forward_not_in_steps(vision_engine, events):
    stepping = vision_engine.with_options(cache=StateCache(1 << 30), prefill_chunk_tokens=CHUNK)
    data = noise_png(32)
    prepared = stepping.prepare(
        RowsRequest.of(STATE, [PromptRow(*RED)], shared=True, max_input_tokens=4096, images=[asset(data)])
    )
    [image] = prepared.images.images.values()
    assert image.patches <= ATTENTION_ROWS
    stepping.read(
        RowsRequest.of(STATE, [PromptRow(*RED)], shared=True, max_input_tokens=4096, images=[asset(data)])
    )
    assert "tower" not in events


def test_a_request_arriving_during_the_tower_is_served_before_the_towers_next_step(vision_engine, events):
    stepping = vision_engine.with_options(cache=StateCache(1 << 30), prefill_chunk_tokens=CHUNK)
    worker = EngineWorker(stepping, ReleasePolicy(stepping.memory, 1 << 30))
    finished: list[str] = []

    async def ask(name: str, state, images) -> None:
        rows = [PromptRow(*RED)]
        await scoring.score(
            worker, RowsRequest.of(state, rows, shared=True, max_input_tokens=4096, images=images)
        )
        finished.append(name)

    async def main():
        heavy = asyncio.create_task(ask("heavy", STATE, [asset(noise_png(33, size=(208, 208)))]))
        while "tower" not in events:
            await asyncio.sleep(0.001)
        await ask("tiny", "Short state.", [])
        await heavy

    try:
        asyncio.run(asyncio.wait_for(main(), 300))
    finally:
        worker.shutdown()
    assert finished == ["tiny", "heavy"]
    assert_served_within_one_tower_step(events)


def test_the_step_budget_is_one_prefill_chunk_of_the_text_model(vision_engine):
    stepping = vision_engine.with_options(cache=StateCache(1 << 30), prefill_chunk_tokens=2048)
    decoder = vision_engine.vision.model.model.language_model
    weights = sum(p.numel() for n, p in decoder.named_parameters() if not n.startswith("embed_tokens"))
    assert stepping.tower_step_flops == 2 * 2048 * weights
    assert (
        vision_engine.with_options(cache=StateCache(1 << 30), prefill_chunk_tokens=None).tower_step_flops
        is None
    )


# -- over a live uvicorn -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(vision_engine, vision_checkpoint):
    service = Service.start(make_settings(vision_checkpoint), engine=vision_engine)
    with LoopbackServer(create_app(service)) as running:
        yield running


def systemone(state, images: dict[str, bytes]) -> dict:
    import base64

    body: dict = {
        "model": "jev-latest",
        "state": state,
        "questions": {"q": {"type": "noul", "instructions": "Is it red?"}},
    }
    if images:
        body["assets"] = {
            name: {"type": "image", "format": "png", "data_base64": base64.b64encode(data).decode()}
            for name, data in images.items()
        }
    return body


def test_a_tiny_request_beside_a_large_image_is_answered_while_the_image_is_in_the_tower(live, events):
    photo = "<image:0123456789abcdef0123456789abcdef>"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    heavy_reply: list[httpx.Response] = []
    heavy = threading.Thread(
        target=lambda: heavy_reply.append(
            httpx.post(
                f"{live.url}/v1/systemone",
                json=systemone({"photo": photo}, {photo: gradient_png(768)}),
                headers=headers,
                timeout=300,
            )
        )
    )
    heavy.start()
    deadline = time.monotonic() + 120
    while "tower" not in events and time.monotonic() < deadline:
        time.sleep(0.005)
    assert "tower" in events
    health = []
    for _ in range(3):  # the median of three: one probe can lose its core on a shared machine
        t0 = time.monotonic()
        health.append((httpx.get(f"{live.url}/health", timeout=30).status_code, time.monotonic() - t0))
    t0 = time.monotonic()
    tiny = httpx.post(
        f"{live.url}/v1/systemone", json=systemone("A short state.", {}), headers=headers, timeout=300
    )
    tiny_seconds = time.monotonic() - t0
    heavy.join(300)
    assert all(status == 200 for status, _ in health) and sorted(s for _, s in health)[1] < 1.0
    assert tiny.status_code == 200 and tiny_seconds < 10.0
    assert heavy_reply and heavy_reply[0].status_code == 200
    assert_served_within_one_tower_step(events)
