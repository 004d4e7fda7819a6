"""Reference forwards over images, built from the model's own pieces one step at a time (expand
the pads, run the tower per image, place the features, the model's own 3-D positions, a
chunked prefill over embeddings, suffix rows after the images): what tests/test_vision.py and
the GPU run's `images` phase hold the engine's image path to. No serving code calls them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from semif_serve.engine.forwards import padded_suffixes
from semif_serve.engine.vision import PixelInputs


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
