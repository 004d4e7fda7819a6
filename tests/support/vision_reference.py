"""The independent side of every image test: transformers' own image processor and tokenizer
and one full forward of `Qwen3_5ForConditionalGeneration` on the whole prompt (the model places
the image features and computes its own 3-D positions), with the softmax written out."""

from __future__ import annotations

import io
import math
import random
from pathlib import Path

import torch
from PIL import Image

from semif_serve.engine import vision

VISION_PREFIX = "model.visual."  # where a Qwen3.5 checkpoint stores its vision tower's tensors


def vision_tower_elements(directory: Path) -> int:
    """How many weights the checkpoint's vision tower holds, read from the safetensors headers
    (no tensor is loaded): what the loaded tower's parameters must add up to."""
    from safetensors import safe_open

    total = 0
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as fh:
            for name in fh.keys():
                if name.startswith(VISION_PREFIX):
                    total += math.prod(fh.get_slice(name).get_shape())
    return total


def noise_png(seed: int, size=(40, 24)) -> bytes:
    """A PNG of random pixels (two seeds: two images that read differently)."""
    rng = random.Random(seed)
    raw = bytes(rng.getrandbits(8) for _ in range(size[0] * size[1] * 3))
    out = io.BytesIO()
    Image.frombytes("RGB", size, raw).save(out, format="PNG")
    return out.getvalue()


def load_reference(directory):
    """transformers' classes loaded on their own, in float32."""
    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(directory), dtype=torch.float32).eval()
    return model, tokenizer


def expected_row(reference, text: str, n_options: int, images: dict[str, bytes]):
    """Slot logits, their softmax and the token count of one full forward of the rendered prompt
    `text`, each placeholder of `images` replaced where it stands by its image."""
    model, tokenizer = reference
    merge = model.config.vision_config.spatial_merge_size
    processor = vision.image_processor(model.config)
    shown = []
    pieces = []
    at = 0
    while True:
        found = [(text.find(p, at), p) for p in images if text.find(p, at) >= 0]
        if not found:
            break
        cut, placeholder = min(found)
        pixels = processor(
            images=[Image.open(io.BytesIO(images[placeholder])).convert("RGB")], return_tensors="pt"
        )
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
        logits = (
            model(input_ids=ids, mm_token_type_ids=(ids == pad).int(), logits_to_keep=1, **extra)
            .logits[0, -1]
            .float()
        )
    slots = [tokenizer.convert_tokens_to_ids(chr(ord("A") + i)) for i in range(n_options)]
    chosen = [float(logits[s]) for s in slots]
    top = max(chosen)
    exps = [math.exp(v - top) for v in chosen]
    return chosen, [e / sum(exps) for e in exps], ids.shape[1]
