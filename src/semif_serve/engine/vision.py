"""Images through the model's own vision tower, into a state prefix with 3-D rotary positions.

The building blocks of the image path of the shared prefix (not yet wired into the runner;
see docs/images.md): transformers' own image processor with its Pillow backend pinned
(`Qwen2VLImageProcessorPil`; the torchvision backend differs by up to 0.015 after a resize)
at the checkpoint's patch geometry; each image's `<|image_pad|>` expanded to its token count;
the vision tower run once per image and its features placed in the prefix's embeddings; the
model's own `get_rope_index` for the prefix's 3-D positions; a chunked prefill over those
embeddings and positions (a chunk may split an image); and the suffix rows at their text
positions plus the offset the images leave. Exact against a full forward of the
vision-language model on the whole prompt (tests/test_vision.py).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from semif_serve.domain.images import ImageAsset
from semif_serve.engine.state_cache import padded_suffixes

VISION_START = "<|vision_start|>"
IMAGE_PAD = "<|image_pad|>"
VISION_END = "<|vision_end|>"
#: What a placeholder becomes in the rendered prompt before its pads are expanded.
VISION_BLOCK = VISION_START + IMAGE_PAD + VISION_END
#: Pixel bounds of the processor (Qwen's own defaults: 56 x 56 to 16,384 patches of 28 x 28).
MIN_PIXELS = 56 * 56
MAX_PIXELS = 16_384 * 28 * 28


def has_vision_tower(config: Any) -> bool:
    """Whether a checkpoint's config carries a vision tower (a vision-language checkpoint)."""
    return getattr(config, "vision_config", None) is not None


VISION_PREFIX = "model.visual."  # where a Qwen3.5 checkpoint stores its vision tower's tensors


def vision_tower_elements(directory: Path) -> int:
    """How many weights the checkpoint's vision tower holds, read from the safetensors headers
    (no tensor is loaded); times the serving dtype's size, the bytes its weights take."""
    from math import prod

    from safetensors import safe_open

    total = 0
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as fh:
            for name in fh.keys():
                if name.startswith(VISION_PREFIX):
                    total += prod(fh.get_slice(name).get_shape())
    return total


def image_processor(config: Any) -> Any:
    """transformers' Qwen2-VL image processor, Pillow backend, at the checkpoint's geometry."""
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    vision = config.vision_config
    return Qwen2VLImageProcessorPil(
        patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size,
        merge_size=vision.spatial_merge_size,
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    )


@dataclass(frozen=True)
class PixelInputs:
    """The processor's output for a request's images, in order: patches and each image's grid."""

    pixel_values: Any  # [patches, channels * temporal * patch * patch]
    grid_thw: Any  # [images, 3]
    tokens: tuple[int, ...]  # image tokens of each image in the prompt (t * h * w / merge^2)


def preprocess(processor: Any, images: Sequence[ImageAsset], merge: int) -> PixelInputs:
    """Decode (RGB) and preprocess every image once."""
    from PIL import Image

    decoded = []
    for image in images:
        with Image.open(io.BytesIO(image.data)) as opened:
            decoded.append(opened.convert("RGB"))
    out = processor(images=decoded, return_tensors="pt")
    grid = out["image_grid_thw"]
    tokens = tuple(int(t * h * w) // merge**2 for t, h, w in grid.tolist())
    return PixelInputs(out["pixel_values"], grid, tokens)


def expand_image_pads(ids: Sequence[int], pad_id: int, tokens: Sequence[int]) -> list[int]:
    """`ids` with the k-th `<|image_pad|>` repeated tokens[k] times (one per image, in order)."""
    pads = [i for i, t in enumerate(ids) if t == pad_id]
    if len(pads) != len(tokens):
        raise ValueError(f"{len(pads)} image pads in the prompt for {len(tokens)} images")
    out: list[int] = []
    images = iter(tokens)
    for token in ids:
        out.extend([token] * next(images) if token == pad_id else [token])
    return out


def image_features(model: Any, pixels: PixelInputs) -> list[Any]:
    """Each image's features, the vision tower run once per image."""
    import torch

    features = []
    start = 0
    with torch.inference_mode():
        for k in range(len(pixels.tokens)):
            grid = pixels.grid_thw[k : k + 1]
            patches = int(grid.prod())
            out = model.model.get_image_features(pixels.pixel_values[start : start + patches], grid)
            features.append(out.pooler_output[0])
            start += patches
    return features


def prefix_embeddings(model: Any, ids: Sequence[int], pad_id: int, features: Sequence[Any]) -> Any:
    """The token embeddings of `ids` with the image pads' rows replaced by the images' features."""
    import torch

    embed = model.get_input_embeddings()
    device = embed.weight.device
    with torch.inference_mode():
        tensor = torch.tensor([list(ids)], device=device)
        embeds = embed(tensor)
        mask = tensor[0] == pad_id
        if features:
            joined = torch.cat(list(features), dim=0).to(device, embeds.dtype)
            if int(mask.sum()) != joined.shape[0]:
                raise ValueError("image pads and image features differ in number")
            embeds[0, mask] = joined
    return embeds


def rope_positions(model: Any, ids: Sequence[int], pad_id: int, grid_thw: Any) -> tuple[Any, int]:
    """The model's own 3-D rotary positions `[3, 1, len(ids)]` over `ids`, and the offset the
    images leave (a text token after them sits at its index plus the offset)."""
    import torch

    tensor = torch.tensor([list(ids)])
    kinds = (tensor == pad_id).int()
    positions, deltas = model.model.get_rope_index(
        tensor, mm_token_type_ids=kinds, image_grid_thw=grid_thw if len(grid_thw) else None
    )
    return positions, int(deltas.reshape(-1)[0])


def prefill_embeddings(model: Any, embeds: Any, positions: Any, chunk_tokens: int | None = None) -> Any:
    """The one-row cache after the prefix `embeds` at `positions`, fed in chunks of at most
    `chunk_tokens` (a chunk may split an image: its rows carry their own positions)."""
    import torch
    from transformers import DynamicCache

    decoder = model.model.language_model
    device = embeds.device
    cache = DynamicCache(config=decoder.config)
    n = embeds.shape[1]
    step = chunk_tokens or n
    with torch.inference_mode():
        for start in range(0, n, step):
            stop = min(n, start + step)
            decoder(
                inputs_embeds=embeds[:, start:stop],
                position_ids=positions[:, :, start:stop].to(device),
                past_key_values=cache,
                use_cache=True,
            )
    return cache


def suffix_logits_after_images(
    model: Any, cache: Any, n_prefix: int, offset: int, suffixes: Sequence[Sequence[int]], pad_id: int
) -> Any:
    """Float32 logits `[rows, vocab]` at each row's last real position: every suffix right-padded
    in one forward over `cache` (forked over the rows), at text positions plus `offset` on all
    three rotary axes."""
    import torch

    decoder = model.model.language_model
    device = next(decoder.parameters()).device
    lengths = [len(s) for s in suffixes]
    width = max(lengths)
    input_ids, mask = padded_suffixes(suffixes, n_prefix, pad_id)
    text = (torch.arange(width) + n_prefix).expand(len(suffixes), width)
    positions = (text + offset)[None].expand(3, len(suffixes), width)
    with torch.inference_mode():
        hidden = decoder(
            input_ids=input_ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state
        read = hidden[torch.arange(len(suffixes), device=device), torch.tensor(lengths, device=device) - 1]
        return model.get_output_embeddings()(read).float()
