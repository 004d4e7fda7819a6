"""The vision tower in engine steps (docs/images.md, "The tower in steps"): an image's tower cut
into pieces (the stem; per block its projections, its attention a slice of query rows at a time,
its output and MLP; the merger), each priced in FLOPs (`TowerPrices`), and a step runs pieces up
to one prefill chunk's price (`text_chunk_flops`), so a newcomer waits for about one chunk behind
an image (`TowerRun`, over the generator `stepped_tower`)."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

# The tower in steps (docs/images.md, "The tower in steps"): an image's tower is cut into pieces
# (the stem; per block its projections, its attention a slice of query rows at a time, its
# output and MLP; the merger), each priced in FLOPs, and a step runs pieces up to one
# prefill chunk's price, so a newcomer waits for about one chunk behind an image.
ATTENTION_ROWS = 768  # query rows per attention slice at the least: whole tiles of the CPU kernel (256)
ROW_TILE = 256  # slices grow in whole tiles, so each slice runs the kernel's own tiling


def text_chunk_flops(model: Any, chunk_tokens: int) -> int:
    """What one prefill chunk of `chunk_tokens` costs the text model: two FLOPs per weight of its
    decoder (the embeddings aside) per token; the tower's price for one step."""
    decoder = model.get_decoder()  # the text model, whether `model` holds a tower or not
    embed = decoder.get_input_embeddings().weight.numel()
    weights = sum(p.numel() for p in decoder.parameters()) - embed
    return 2 * chunk_tokens * weights


@dataclass(frozen=True)
class TowerPrices:
    """The FLOPs of each piece of the tower for an image of `patches` patches (its geometry from
    the vision config): the cost model of a step."""

    patches: int
    hidden: int
    intermediate: int
    depth: int
    patch_inputs: int  # channels * temporal * patch * patch: one patch's pixel values
    merged_hidden: int  # hidden * merge^2: one merged token's input to the merger
    out_hidden: int

    @classmethod
    def of(cls, config: Any, patches: int) -> TowerPrices:
        """The prices for one image of `patches` patches through the tower `config` describes."""
        unit = config.spatial_merge_size**2
        inputs = config.in_channels * config.temporal_patch_size * config.patch_size**2
        return cls(
            patches=patches,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            depth=config.depth,
            patch_inputs=inputs,
            merged_hidden=config.hidden_size * unit,
            out_hidden=config.out_hidden_size,
        )

    @property
    def stem(self) -> int:
        return 2 * self.patches * self.patch_inputs * self.hidden

    @property
    def projections(self) -> int:
        """One block's norm, query/key/value projection and rotary embedding."""
        return 2 * self.patches * 3 * self.hidden**2

    def attention(self, rows: int) -> int:
        """`rows` queries against every key of the image: scores and their weighted sum."""
        return 4 * rows * self.patches * self.hidden

    @property
    def output(self) -> int:
        """One block's attention output projection and MLP."""
        return 2 * self.patches * (self.hidden**2 + 2 * self.hidden * self.intermediate)

    @property
    def merger(self) -> int:
        tokens = self.patches * self.hidden // self.merged_hidden
        return 2 * tokens * self.merged_hidden * (self.merged_hidden + self.out_hidden)

    @property
    def total(self) -> int:
        """The whole tower on this image."""
        block = self.projections + self.attention(self.patches) + self.output
        return self.stem + self.depth * block + self.merger

    def rows_per_slice(self, budget: int) -> int:
        """Query rows per attention slice: what `budget` buys, in whole tiles of ROW_TILE rows and
        at least ATTENTION_ROWS (the last slice takes the remainder)."""
        rows = budget // max(1, 4 * self.patches * self.hidden) // ROW_TILE * ROW_TILE
        return max(ATTENTION_ROWS, rows)


def query_slices(n: int, rows: int) -> list[tuple[int, int]]:
    """(start, stop) of each attention slice over `n` queries, `rows` at a time; a remainder
    shorter than ATTENTION_ROWS joins the slice before it."""
    cuts = [*range(0, n, rows), n]
    if len(cuts) > 2 and cuts[-1] - cuts[-2] < ATTENTION_ROWS:
        del cuts[-2]
    return list(zip(cuts, cuts[1:], strict=False))


STEPPED_ATTENTION = ("sdpa", "eager")  # attention interfaces called per slice; any other runs whole


def stepped_tower(visual: Any, pixels: Any, grid_thw: Any, rows: int) -> Generator[int, None, Any]:
    """The vision tower on one image, piece by piece: yields each next piece's price (FLOPs)
    before running it and returns the merged features. The pieces are the tower's own modules
    and helpers in its forward's order (transformers' `Qwen3_5VisionModel.forward`), with the
    attention's queries taken `rows` at a time against all keys, so the features equal its
    forward's (tests/engine/test_tower_steps.py)."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen
    from transformers.vision_utils import (
        get_vision_interpolation_indices_and_weights,
        get_vision_position_ids,
    )

    config = visual.config
    prices = TowerPrices.of(config, int(grid_thw.prod()))
    yield prices.stem
    with torch.inference_mode():
        indices, weights = get_vision_interpolation_indices_and_weights(
            grid_thw,
            num_grid_per_side=visual.num_grid_per_side,
            mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners,
            spatial_merge_size=config.spatial_merge_size,
            kwargs={},
        )
        positions = get_vision_position_ids(grid_thw, visual.spatial_merge_size, kwargs={})
        hidden = visual.patch_embed(pixels.type(visual.dtype))
        hidden = hidden + (visual.pos_embed(indices) * weights[:, :, None]).sum(1).to(hidden.dtype)
        rotary = visual.rotary_pos_emb(hidden, positions)
        n = hidden.shape[0]
        hidden = hidden.reshape(n, -1)
        del pixels, indices, weights, positions  # only the residual stream and rotary tables stay
    for block in visual.blocks:
        attn = block.attn
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(
            config._attn_implementation, qwen.eager_attention_forward
        )
        yield prices.projections
        with torch.inference_mode():
            qkv = attn.qkv(block.norm1(hidden)).reshape(n, 3, attn.num_heads, -1).permute(1, 0, 2, 3)
            query, key, value = qkv.unbind(0)
            query, key = qwen.apply_rotary_pos_emb_vision(query, key, *rotary)
            query, key, value = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        slices = []
        for start, stop in query_slices(n, rows):
            yield prices.attention(stop - start)
            with torch.inference_mode():
                out, _ = attend(
                    attn,
                    query[:, :, start:stop],
                    key,
                    value,
                    attention_mask=None,
                    scaling=attn.scaling,
                    dropout=0.0,
                    is_causal=False,
                )
            slices.append(out)
        del qkv, query, key, value
        yield prices.output
        with torch.inference_mode():
            out = torch.cat(slices, dim=1).reshape(n, -1).contiguous()
            del slices
            hidden = hidden + attn.proj(out)
            hidden = hidden + block.mlp(block.norm2(hidden))
    yield prices.merger
    with torch.inference_mode():
        return visual.merger(hidden)


class TowerRun:
    """One image's tower in progress, paused between engine steps: the generator keeps its
    hidden states (counted in docs/memory.md) until the last step returns the features."""

    def __init__(self, visual: Any, pixels: Any, grid_thw: Any, rows: int) -> None:
        self._pieces = stepped_tower(visual, pixels, grid_thw, rows)
        self._next = next(self._pieces)  # the first piece's price; nothing has run yet
        self.features: Any = None
        self.steps = 0

    def advance(self, budget: int | None) -> bool:
        """Run pieces while they fit in `budget` FLOPs (at least one; None: all); True once the
        features are there."""
        spent = 0
        self.steps += 1
        while budget is None or not spent or spent + self._next <= budget:
            spent += self._next
            try:
                self._next = next(self._pieces)
            except StopIteration as done:
                self.features = done.value
                return True
        return False
