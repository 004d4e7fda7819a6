"""The image path's building blocks (engine/vision.py), engine-side, ratios in one run, on the
tiny random-weight Qwen3.5 vision-language checkpoint (fp32, CPU). The service does not run
this path yet (docs/images.md); these are the costs the wiring will inherit.

    uv run python bench/vision.py [--runs 5] [--side 224]

- one question over a state with one image vs the same state without it (the image's cost:
  preprocessing, the vision tower, its tokens in the prefill);
- eight questions about one image in one batch vs one question (goal <= 1.5x);
- a second question about a kept image state (fork + suffix) vs the first (goal >= 5x).
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

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "src"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
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
    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

    from semif_serve.domain.images import read_image
    from semif_serve.domain.prompt import PromptCodec
    from semif_serve.engine import vision
    from semif_serve.engine.state_cache import fork_cache
    from semif_serve.tools.demo import write_checkpoint

    torch.set_num_threads(max(1, torch.get_num_threads()))
    directory = write_checkpoint(Path(tempfile.mkdtemp(prefix="bench-vl-")), multimodal=True)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(directory), dtype=torch.float32).eval()
    codec = PromptCodec(tokenizer)
    pad = tokenizer.convert_tokens_to_ids(vision.IMAGE_PAD)
    merge = model.config.vision_config.spatial_merge_size
    processor = vision.image_processor(model.config)
    asset = read_image("<image:photo>", photo(args.side), claimed="png", max_pixels=10**8)

    def rows(state_text: dict, with_image: bool, tokens=()):
        out = []
        for question, options in QUESTIONS:
            text = codec.render_prompt(state_text, question, options)
            if with_image:
                text = text.replace("<image:photo>", vision.VISION_BLOCK)
                out.append(vision.expand_image_pads(codec.encode(text), pad, tokens))
            else:
                out.append(codec.encode(text))
        n = 0
        while all(len(r) > n + 1 for r in out) and len({r[n] for r in out}) == 1:
            n += 1
        return out, n

    def image_state():
        pixels = vision.preprocess(processor, [asset], merge)
        features = vision.image_features(model, pixels)
        ids, n = rows(STATE, True, pixels.tokens)
        embeds = vision.prefix_embeddings(model, ids[0][:n], pad, features)
        positions, offset = vision.rope_positions(model, ids[0][:n], pad, pixels.grid_thw)
        return vision.prefill_embeddings(model, embeds, positions, 2048), offset, ids, n

    def ask(state, count: int):
        cache, offset, ids, n = state
        suffixes = [r[n:] for r in ids[:count]]
        return vision.suffix_logits_after_images(model, fork_cache(cache, count), n, offset, suffixes, 0)

    def text_only_question():
        ids, n = rows({"photo": "", "caption": STATE["caption"]}, False)
        positions = torch.arange(n)[None, None].expand(3, 1, -1)
        embeds = model.get_input_embeddings()(torch.tensor([ids[0][:n]]))
        cache = vision.prefill_embeddings(model, embeds, positions, 2048)
        return vision.suffix_logits_after_images(model, cache, n, 0, [ids[0][n:]], 0)

    with torch.inference_mode():
        image_tokens = vision.preprocess(processor, [asset], merge).tokens[0]
        kept = image_state()
        without = median_seconds(text_only_question, args.runs)
        first = median_seconds(lambda: ask(image_state(), 1), args.runs)
        eight = median_seconds(lambda: ask(image_state(), 8), args.runs)
        second = median_seconds(lambda: ask(kept, 1), args.runs)
    print(
        f"tiny VL checkpoint, fp32 CPU, {args.side}x{args.side} image = {image_tokens} image tokens, "
        f"prefix {kept[3]} tokens, medians of {args.runs}"
    )
    print("| measurement | baseline | measured | ratio | goal |")
    print("|---|---|---|---|---|")
    print(
        f"| one question, state with the image vs without | {without * 1e3:.1f} ms | {first * 1e3:.1f} ms "
        f"| {first / without:.2f}x | (the image's cost) |"
    )
    print(
        f"| eight questions about the image in one batch vs one "
        f"| {first * 1e3:.1f} ms | {eight * 1e3:.1f} ms "
        f"| {eight / first:.2f}x | <= 1.5x: {'met' if eight / first <= 1.5 else 'not met'} |"
    )
    print(
        f"| second question about a kept image state vs the first "
        f"| {first * 1e3:.1f} ms | {second * 1e3:.1f} ms "
        f"| {first / second:.1f}x | >= 5x: {'met' if first / second >= 5 else 'not met'} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
