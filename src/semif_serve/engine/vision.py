"""Images through the model's own vision tower, into a state prefix with 3-D rotary positions.

`VisionTower` (the loaded vision-language model's tower, its image processor and its special
tokens) turns a request's images into an `ImageSet`: each image preprocessed once, its span of
ids for the prompt (`ImageSpan`), its features computed at most once, on the engine thread,
when a forward first needs them, and the embeddings and 3-D positions of any row of ids that
holds image tokens. An image's tokens carry negative ids that spell its SHA-256
(`image_token_ids`), so the prefix keys of the state cache and the batcher tell images apart.

The building blocks below it (see docs/images.md): transformers' own image processor with
its Pillow backend pinned (`Qwen2VLImageProcessorPil`; the torchvision backend differs by up
to 0.015 after a resize) at the checkpoint's patch geometry; the vision tower run once per
image, its features placed in the embeddings; the model's own `get_rope_index` for the 3-D
positions; a chunked prefill over embeddings and positions (a chunk may split an image); the
suffix rows at their text positions plus the offset the images leave (engine/forwards.py).
Exact against a full forward of the vision-language model on the whole prompt
(tests/engine/test_vision.py, over the reference forwards of acceptance/image_reference.py).
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from semif_serve.domain.images import ImageAsset, upright_rgb
from semif_serve.domain.prompt import ImageSpan
from semif_serve.engine.tower_steps import ATTENTION_ROWS, STEPPED_ATTENTION, TowerPrices, TowerRun

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
            decoded.append(upright_rgb(opened))
    out = processor(images=decoded, return_tensors="pt")
    grid = out["image_grid_thw"]
    tokens = tuple(int(t * h * w) // merge**2 for t, h, w in grid.tolist())
    return PixelInputs(out["pixel_values"], grid, tokens)


DIGEST_CHUNKS = 4  # 60 bits of the SHA-256 each: 240 bits spelled by an image's first tokens


def image_token_ids(sha256: str, tokens: int) -> tuple[int, ...]:
    """The ids of one image's `tokens` tokens in a prompt's ids: negative (never a vocabulary id),
    cycling through four 60-bit pieces of the image's SHA-256, so an image of at least four
    tokens carries 240 bits of its digest and equal prefix ids mean equal images."""
    pieces = [-1 - int(sha256[15 * k : 15 * k + 15], 16) for k in range(DIGEST_CHUNKS)]
    return tuple(pieces[j % DIGEST_CHUNKS] for j in range(tokens))


def has_image_tokens(ids: Sequence[int]) -> bool:
    """Whether a row of ids holds image tokens."""
    return any(t < 0 for t in ids)


@dataclass(frozen=True)
class PreparedImage:
    """One image as the prompt shows it: its token id, the processor's grid (from the image's
    size, as the processor resizes it) and its token count; its pixels come later, if needed."""

    asset: ImageAsset
    token_ids: tuple[int, ...]
    grid_thw: tuple[int, int, int]
    tokens: int

    @property
    def key(self) -> tuple[int, ...]:
        """The image's first ids: how rows name it (an image holds at least one token)."""
        return self.token_ids[:DIGEST_CHUNKS]

    @property
    def patches(self) -> int:
        """Patches the tower reads for this image."""
        t, h, w = self.grid_thw
        return t * h * w


class VisionTower:
    """The vision side of a loaded vision-language model: its processor, tower and tokens."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model = model  # Qwen3_5ForConditionalGeneration; its text side serves text rows
        self.processor = image_processor(model.config)
        vision = model.config.vision_config
        self.merge = vision.spatial_merge_size
        self.patch = vision.patch_size
        self.hidden = vision.hidden_size
        self.intermediate = vision.intermediate_size
        self.depth = vision.depth
        self.out_hidden = vision.out_hidden_size
        self.pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        self.start_id = tokenizer.convert_tokens_to_ids(VISION_START)
        self.end_id = tokenizer.convert_tokens_to_ids(VISION_END)

    def prepare(self, images: Sequence[ImageAsset]) -> ImageSet:
        """A request's images as their prompt spans, from each image's size alone (the grid the
        processor's resize gives); the pixels are preprocessed later (`ImageSet.preprocess`),
        only for images whose state is not cached."""
        prepared: dict[str, PreparedImage] = {}
        spans: list[ImageSpan] = []
        for image in images:
            grid = self.grid(image.height, image.width)
            tokens = grid[0] * grid[1] * grid[2] // self.merge**2
            token_ids = image_token_ids(image.sha256, tokens)
            prepared.setdefault(image.sha256, PreparedImage(image, token_ids, grid, tokens))
            spans.append(ImageSpan(image.placeholder, (self.start_id, *token_ids, self.end_id), image.sha256))
        return ImageSet(self, {p.key: p for p in prepared.values()}, tuple(spans))

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """The processor's patch grid (t, h, w) for an image of this size: its own resize rule."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = self.patch * self.merge
        size = self.processor.size
        h, w = smart_resize(
            height, width, factor, min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"]
        )
        return (1, h // self.patch, w // self.patch)

    def pixels(self, image: PreparedImage) -> Any:
        """One image decoded and preprocessed: `[patches, channels * temporal * patch * patch]`."""
        out = preprocess(self.processor, [image.asset], self.merge)
        if tuple(out.grid_thw[0].tolist()) != image.grid_thw:
            raise ValueError(f"the processor's grid {out.grid_thw[0].tolist()} differs from {image.grid_thw}")
        return out.pixel_values

    def activation_bytes(self, patches: int, estimate: Any) -> int:
        """Estimated bytes of running the tower on one image of `patches` patches (see
        docs/memory.md): a layer's working set per patch (residual, attention projections, MLP,
        and the float32 copies of queries and keys its rotary embedding makes) and the merged
        features, with the text estimate's element size and safety factor."""
        rotary = 4 * 2 * self.hidden  # transformers' apply_rotary_pos_emb_vision works in float32
        per_patch = estimate.element_bytes * (6 * self.hidden + 2 * self.intermediate) + rotary
        merged = estimate.element_bytes * self.out_hidden * patches // self.merge**2
        return int((per_patch * patches + merged) * estimate.SAFETY)

    def steps_through(self, image: PreparedImage, budget: int | None) -> bool:
        """Whether `image` goes through the tower in steps of `budget` FLOPs: its whole tower
        costs more than one step, it has more patches than the least attention slice (a smaller
        one costs no more than a step's least work), and the attention interface can be called a
        slice at a time. Otherwise the tower runs in the forward that first needs it."""
        config = self.model.config.vision_config
        if (
            budget is None
            or image.patches <= ATTENTION_ROWS
            or config._attn_implementation not in STEPPED_ATTENTION
        ):
            return False
        return TowerPrices.of(config, image.patches).total > budget

    def start(self, image: PreparedImage, pixels: Any, budget: int) -> TowerRun:
        """`image`'s tower, paused before its first piece, with attention slices `budget` buys."""
        import torch

        visual = self.model.model.visual
        weights = next(visual.parameters())
        rows = TowerPrices.of(self.model.config.vision_config, image.patches).rows_per_slice(budget)
        grid = torch.tensor([image.grid_thw], device=weights.device)
        return TowerRun(visual, pixels.to(weights.device, weights.dtype), grid, rows)

    def patches(self, images: Sequence[PreparedImage]) -> int:
        """The most patches one image of `images` feeds the tower (it runs once per image)."""
        return max((i.patches for i in images), default=0)


Key = tuple[int, ...]  # an image's first ids (`PreparedImage.key`)


class ImageSet:
    """The images a request's rows show, by key (a merged group's: the union); each image's
    pixels are decoded and its features computed at most once, when first needed."""

    def __init__(
        self, tower: VisionTower, images: dict[Key, PreparedImage], spans: tuple[ImageSpan, ...]
    ) -> None:
        self.tower = tower
        self.images = images
        self.spans = spans
        self._features: dict[Key, Any] = {}
        self._pixels: dict[Key, Any] = {}
        self._runs: dict[Key, TowerRun] = {}  # images part-way through the tower
        self._last_blocks: tuple[Sequence[int], list[tuple[int, int, Key]]] | None = None
        self.tower_runs = 0

    @staticmethod
    def union(sets: Sequence[ImageSet | None]) -> ImageSet | None:
        """One set over every image of `sets` (None when none has images). The sets come to
        share one store of pixels and features, so an image is decoded and run through the
        tower once for all of them, however many turns their group takes."""
        present = [s for s in sets if s is not None]
        if len(present) <= 1:
            return present[0] if present else None
        joined = ImageSet(present[0].tower, {}, ())
        for part in present:
            joined.images.update(part.images)
            joined._pixels.update(part._pixels)
            joined._features.update(part._features)
            joined._runs.update(part._runs)
        for part in present:
            part._pixels, part._features, part._runs = joined._pixels, joined._features, joined._runs
        return joined

    def shown_in(self, rows: Iterable[Sequence[int]]) -> set[Key]:
        """The images whose tokens appear in any of `rows`."""
        seen = {t for row in rows for t in row if t < 0}
        return {key for key, image in self.images.items() if seen.intersection(image.key)}

    def preprocess(self, keys: Iterable[Key] | None = None) -> None:
        """Decode and preprocess these images now (all: None), host work off the engine thread;
        any left out is preprocessed when a forward first needs it."""
        for key in self.images if keys is None else keys:
            if key not in self._pixels and key not in self._features:
                self._pixels[key] = self.tower.pixels(self.images[key])

    def tower_step(self, keys: Iterable[Key], budget: int | None) -> bool:
        """One engine step of the tower, for the first image of `keys` (in this set's order)
        whose features are missing and whose tower runs in steps (`VisionTower.steps_through`):
        pieces up to `budget` FLOPs, its hidden states kept for the next step. True when a step
        ran; False when none of these images needs one (cheap ones run in their forward)."""
        wanted = set(keys)
        for key, image in self.images.items():
            if key not in wanted or key in self._features:
                continue
            run = self._runs.get(key)
            if run is None and budget is not None and self.tower.steps_through(image, budget):
                self.preprocess([key])
                run = self._runs[key] = self.tower.start(image, self._pixels.pop(key), budget)
            if run is None:
                continue
            try:
                done = run.advance(budget)
            except BaseException:
                del self._runs[key]  # a failed piece ends the run; a retry starts the tower afresh
                raise
            if done:
                self._finish(key)
            return True
        return False

    def _finish(self, key: Key) -> None:
        """Keep a stepped run's features and let its hidden states go."""
        self._features[key] = self._runs.pop(key).features
        self.tower_runs += 1

    def features(self, key: Key) -> Any:
        """One image's features `[tokens, hidden]` (the tower runs on first use only; one that
        is part-way through its steps is finished now)."""
        if key in self._runs:
            self._runs[key].advance(None)
            self._finish(key)
        if key not in self._features:
            image = self.images[key]
            import torch

            grid = torch.tensor([image.grid_thw])
            model = self.tower.model
            weights = next(model.model.visual.parameters())
            self.preprocess([key])
            pixels = self._pixels.pop(key).to(weights.device, weights.dtype)
            with torch.inference_mode():
                out = model.model.get_image_features(pixels, grid.to(weights.device))
            self._features[key] = out.pooler_output[0]
            self.tower_runs += 1
        return self._features[key]

    def _image_of(self, run: Sequence[int], at_end: bool) -> PreparedImage:
        """The image whose ids a run of image tokens spells (the whole image; at the row's end,
        a prefill step's slice, its beginning)."""
        image = self.images.get(tuple(run[:DIGEST_CHUNKS]))
        if image is None and at_end:  # a slice shorter than the key: any image it begins
            image = next((i for i in self.images.values() if i.token_ids[: len(run)] == tuple(run)), None)
        whole = image is not None and tuple(run) == image.token_ids
        if image is None or not (whole or (at_end and image.token_ids[: len(run)] == tuple(run))):
            raise ValueError(f"a run of {len(run)} image tokens spells no image of this request")
        return image

    def _blocks(self, ids: Sequence[int]) -> list[tuple[int, int, Key]]:
        """(start, stop, image key) of each image's run of tokens in `ids`, in order (kept for
        the last row asked: a chunked prefill asks for the same row once per chunk). Images are
        delimited by the vision start and end tokens, so a run of negative ids is one image."""
        if self._last_blocks is not None and self._last_blocks[0] is ids:
            return self._last_blocks[1]
        blocks: list[tuple[int, int, Key]] = []
        at = 0
        n = len(ids)
        while at < n:
            if ids[at] < 0:
                stop = at
                while stop < n and ids[stop] < 0:
                    stop += 1
                image = self._image_of(ids[at:stop], stop == n)
                blocks.append((at, stop, image.key))
                at = stop
            else:
                at += 1
        self._last_blocks = (ids, blocks)
        return blocks

    def positions(self, ids: Sequence[int]) -> Any:
        """The model's own 3-D rotary positions `[3, len(ids)]` of a row from position 0 (a row
        that ends inside an image, a prefill step's slice, is placed as if the image were whole)."""
        import torch

        blocks = self._blocks(ids)
        if blocks and blocks[-1][1] - blocks[-1][0] < self.images[blocks[-1][2]].tokens:
            first, last, key = blocks[-1]
            whole = [*ids, *self.images[key].token_ids[last - first :]]
            return self.positions(whole)[:, : len(ids)]
        tensor = torch.tensor([[t if t >= 0 else self.tower.pad_id for t in ids]])
        kinds = torch.zeros_like(tensor, dtype=torch.int)
        for start, stop, _ in blocks:
            kinds[0, start:stop] = 1
        grid = torch.tensor([self.images[k].grid_thw for *_, k in blocks]) if blocks else None
        positions, _ = self.tower.model.model.get_rope_index(
            tensor, mm_token_type_ids=kinds, image_grid_thw=grid
        )
        return positions[:, 0]

    def embeddings(self, embed: Any, ids: Sequence[int], start: int, stop: int) -> Any:
        """The input embeddings `[stop - start, hidden]` of `ids[start:stop]`: the token
        embeddings, with each image token's row its image's feature row."""
        import torch

        device = embed.weight.device
        chunk = torch.tensor([t if t >= 0 else self.tower.pad_id for t in ids[start:stop]], device=device)
        with torch.inference_mode():
            rows = embed(chunk)
            for first, last, key in self._blocks(ids):
                lo, hi = max(first, start), min(last, stop)
                if lo < hi:
                    feature = self.features(key)[lo - first : hi - first]
                    rows[lo - start : hi - start] = feature.to(device, rows.dtype)
        return rows
