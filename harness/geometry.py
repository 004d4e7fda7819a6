"""Model geometries written out where transformers' defaults are another model's: for `gpu_run`'s
images phase and `bench/vision_tower_memory.py`."""

from __future__ import annotations

from typing import Any

# Qwen3.5-4B's `vision_config` (config.json of Qwen/Qwen3.5-4B and of its fine-tunes with the same
# text geometry, e.g. the "chandra" Qwen3_5ForConditionalGeneration config: text 2560 x 32 layers,
# image_token_id 248056; transformers 5.17's Qwen3_5VisionConfig defaults are the larger towers').
# 24 blocks of 1024 give 333.5 M weights, 0.62 GiB in BF16, as the published f16 "mmproj" vision
# file of Qwen3.5-4B (~644 MB) says.
QWEN35_4B_VISION: dict[str, Any] = {
    "depth": 24,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 2304,
    "hidden_act": "gelu_pytorch_tanh",
}
