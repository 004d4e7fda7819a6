"""Images through the service's engine (the production loader and `TorchEngine.read`: the
image processor, the vision tower, the prefill over embeddings with 3-D positions, the state
cache), ratios in one run, on the demo's tiny random-weight Qwen3.5 with a vision tower
(fp32, CPU).

    uv run python bench/vision.py [--runs 5] [--side 224]

- one question over a state with one image vs the same state without it (the image's cost:
  preprocessing, the vision tower, its tokens in the prefill);
- eight questions about one image in one request vs one question (goal <= 1.5x);
- a second question about the same image state (from the cache) vs the first (goal >= 5x).
"""

from __future__ import annotations

import argparse
import io
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STATE = {"photo": "<image:photo>", "caption": "a product photo from the catalogue"}
QUESTIONS = [
    (f"Question {i}: does the photo show property {i}?", ["Yes.", "No.", "Unclear."]) for i in range(8)
]


def photo(side: int) -> bytes:
    from PIL import Image

    rng = random.Random(side)
    raw = bytes(rng.getrandbits(8) for _ in range(side * side * 3))
    out = io.BytesIO()
    Image.frombytes("RGB", (side, side), raw).save(out, format="PNG")
    return out.getvalue()


def median_seconds(job, runs: int) -> float:
    job()  # warm-up: first-call allocations and lazy imports are not the path's cost
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        job()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--side", type=int, default=224, help="the image is side x side pixels")
    args = parser.parse_args()

    import torch

    from semif_serve.domain.images import read_image
    from semif_serve.domain.requests import RowsRequest
    from semif_serve.domain.types import PromptRow
    from semif_serve.engine.state_cache import StateCache
    from semif_serve.service.settings import Settings
    from semif_serve.service.startup import load_engine
    from semif_serve.tools.demo import DEMO_REVISION, write_checkpoint

    torch.set_num_threads(max(1, torch.get_num_threads()))
    directory = write_checkpoint(Path(tempfile.mkdtemp(prefix="bench-vl-")), multimodal=True)
    settings = Settings(model_path=directory, model_revision=DEMO_REVISION, device="cpu", api_token="x" * 20)
    engine = load_engine(settings).with_options(cache=StateCache(1 << 30), prefill_chunk_tokens=2048)
    asset = read_image("<image:photo>", photo(args.side), claimed="png", max_pixels=10**8)
    rows = [PromptRow(q, tuple(o)) for q, o in QUESTIONS]
    text_state = {"photo": "", "caption": STATE["caption"]}

    def ask(state, count: int, images, cold: bool = True):
        if cold:
            engine.cache.clear()
        return engine.read(
            RowsRequest.of(state, rows[:count], shared=True, max_input_tokens=32768, images=images)
        )

    image_tokens = engine.vision.prepare([asset]).images.popitem()[1].tokens
    prefix_tokens = ask(STATE, 1, [asset]).timing.prefix_tokens
    without = median_seconds(lambda: ask(text_state, 1, []), args.runs)
    first = median_seconds(lambda: ask(STATE, 1, [asset]), args.runs)
    eight = median_seconds(lambda: ask(STATE, 8, [asset]), args.runs)
    ask(STATE, 1, [asset])
    second = median_seconds(lambda: ask(STATE, 1, [asset], cold=False), args.runs)
    print(
        f"tiny VL checkpoint, fp32 CPU, {args.side}x{args.side} image = {image_tokens} image tokens, "
        f"prefix {prefix_tokens} tokens, medians of {args.runs}"
    )
    print("| measurement | baseline | measured | ratio | goal |")
    print("|---|---|---|---|---|")
    print(
        f"| one question, state with the image vs without | {without * 1e3:.1f} ms | {first * 1e3:.1f} ms "
        f"| {first / without:.2f}x | (the image's cost) |"
    )
    print(
        f"| eight questions about the image in one request vs one "
        f"| {first * 1e3:.1f} ms | {eight * 1e3:.1f} ms "
        f"| {eight / first:.2f}x | <= 1.5x: {'met' if eight / first <= 1.5 else 'not met'} |"
    )
    print(
        f"| second question about the same image state (cached) vs the first "
        f"| {first * 1e3:.1f} ms | {second * 1e3:.1f} ms "
        f"| {first / second:.1f}x | >= 5x: {'met' if first / second >= 5 else 'not met'} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
