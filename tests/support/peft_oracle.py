"""PEFT's own LoRA forward, the tests' reference for every adapter the service serves (SemIf's
adapter entries and lev's releases alike): a fresh copy of the base from disk with the adapter
loaded by `PeftModel.from_pretrained`, its serving scale applied by PEFT's `rescale_adapter_scale`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def fresh_base(checkpoint: Path) -> Any:
    """The base as transformers loads it from `checkpoint` (float32), apart from the engine's copy."""
    from transformers import Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


def peft_model(checkpoint: Path, adapter: Path) -> Any:
    """PEFT's own LoRA of the adapter directory `adapter` over a fresh base."""
    from peft import PeftModel

    return PeftModel.from_pretrained(fresh_base(checkpoint), str(adapter)).eval()


def peft_last(reference: Any, ids: Sequence[int], scale: float = 1.0) -> tuple[Any, Any]:
    """Logits and final hidden state at the last of `ids` through `reference`, its adapter at `scale`."""
    from peft.helpers import rescale_adapter_scale

    with torch.no_grad(), rescale_adapter_scale(reference, scale):
        out = reference(input_ids=torch.tensor([list(ids)]), output_hidden_states=True, logits_to_keep=1)
    return out.logits[0, -1], out.hidden_states[-1][0, -1]
