"""The vision tower's live activation bytes at Qwen3.5-4B's real vision geometry, on the CPU,
against the engine's estimate (`VisionTower.activation_bytes`, docs/memory.md "Images").

    uv run python bench/vision_tower_memory.py [--size 448x448] [--depth 24]

Random BF16 weights at `harness.geometry.QWEN35_4B_VISION`; the peak of live tensors is
counted by torch's `MemTracker` (a dispatch mode over every tensor the forward creates; a
private torch API), minus the weights and the input pixels. Indicative only: CUDA's kernels
and its allocator's rounding differ; the GPU run's `images` phase measures the real peak
(`torch.cuda.max_memory_allocated`). The per-patch peak does not depend on the depth (each
block's working set is freed before the next), so `--depth 2` gives the same bytes in seconds.
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

NO_TOKENS = SimpleNamespace(convert_tokens_to_ids=lambda token: 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="448x448", help="WIDTHxHEIGHT after the processor's resize")
    parser.add_argument("--depth", type=int, default=24, help="tower blocks (the real tower has 24)")
    args = parser.parse_args()

    import torch
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import Qwen3_5TextConfig, Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    from harness.geometry import QWEN35_4B_VISION
    from semif_serve.engine.memory import MemoryEstimate
    from semif_serve.engine.vision import VisionTower
    from semif_serve.tools.demo import QWEN35_4B_SHAPE

    width, height = (int(v) for v in args.size.split("x"))
    geometry = {**QWEN35_4B_VISION, "depth": args.depth}
    config = Qwen3_5VisionConfig(**geometry, out_hidden_size=2560)  # Qwen3.5-4B's text width
    torch.manual_seed(0)
    tower = Qwen3_5VisionModel._from_config(config, dtype=torch.bfloat16).eval()
    patch = geometry["patch_size"]
    h, w = height // patch, width // patch
    patches = h * w
    pixels = torch.randn(
        patches, geometry["in_channels"] * geometry["temporal_patch_size"] * patch**2
    ).bfloat16()
    tracker = MemTracker()
    tracker.track_external(tower, pixels)
    with torch.inference_mode(), tracker:
        tower(pixels, grid_thw=torch.tensor([[1, h, w]]))
    (peak,) = tracker.get_tracker_snapshot("peak").values()  # one device: the CPU
    live = sum(v for k, v in peak.items() if getattr(k, "name", None) == "ACT")

    # The engine's own estimate over this tower (the tokenizer's ids play no part in it).
    view = VisionTower(SimpleNamespace(config=SimpleNamespace(vision_config=config)), NO_TOKENS)
    text = Qwen3_5TextConfig(**QWEN35_4B_SHAPE.text_config(248_320))
    estimate = view.activation_bytes(patches, MemoryEstimate(text, element_bytes=2))
    print(
        f"{width}x{height}: {patches} patches, depth {args.depth}: live activations at the peak "
        f"{live / 2**20:.1f} MiB ({live / patches / 1024:.1f} KiB a patch), estimate "
        f"{estimate / 2**20:.1f} MiB; measured / estimated {live / estimate:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
