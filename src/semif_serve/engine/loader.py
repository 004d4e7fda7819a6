"""Loading a checkpoint: the files, the architecture check, the device, the identity results report.

`load_model(spec)` reads a local Qwen3.5 directory into a `LoadedModel` (weights on the
device, the tokenizer's answer codes, the identity); the runner (`runner.TorchEngine`)
reads rows with it and never touches files.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from semif_serve.domain.prompt import PromptCodec
from semif_serve.domain.types import ConfigurationError
from semif_serve.engine import linear_attention_cpu
from semif_serve.engine.memory import CudaMemory, DeviceMemory, HostMemory
from semif_serve.engine.threads import set_interop_threads
from semif_serve.engine.vision import VisionTower, has_vision_tower

log = logging.getLogger("semif_serve.engine")

QWEN35_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
DEMO_NOTE = "random weights: the answers carry no meaning"


class CheckpointError(Exception):
    """The checkpoint cannot be served as it is; the message says why."""


@dataclass(frozen=True)
class CheckpointSpec:
    """What to load and where: the engine's own view of the configuration (built by startup)."""

    directory: Path
    revision: str
    source: str
    dtype: Literal["bfloat16", "float32"]
    device: Literal["cuda", "cpu"]
    demo: bool = False
    allow_any_architecture: bool = False
    vram_cap_gib: float = 12.0
    cpu_kernels: bool = True  # on the CPU: engine.linear_attention_cpu instead of the reference code


@dataclass(frozen=True)
class ModelIdentity:
    """What results and /health report about the loaded model; `demo` is the one truth for demo."""

    source: str
    revision: str
    dtype: str
    device: str
    demo: bool

    def as_dict(self) -> dict[str, str]:
        """The `model` block of every result, keys in upstream's order."""
        info = {
            "source": self.source,
            "revision": self.revision,
            "dtype": self.dtype,
            "device": self.device,
            "torch_version": _torch_version(),
            "transformers_version": _transformers_version(),
        }
        if self.demo:
            info["demo"] = DEMO_NOTE
        return info


@dataclass(frozen=True)
class LoadedModel:
    """A checkpoint on its device: the model, its prompt codec, identity and memory view."""

    model: Any  # the text model (for a vision-language checkpoint: a view of its text side)
    codec: PromptCodec
    identity: ModelIdentity
    memory: DeviceMemory
    skipped_tensors: int
    vision: VisionTower | None = None  # the checkpoint's vision tower, where it has one


def checkpoint_tensor_names(directory: Path) -> list[str]:
    """Every tensor name stored in the directory's safetensors files."""
    from safetensors import safe_open

    names: list[str] = []
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as fh:
            names.extend(fh.keys())
    return names


def load_model(spec: CheckpointSpec, memory: DeviceMemory | None = None) -> LoadedModel:
    """Load a local Qwen3.5 checkpoint; refuse anything that cannot be served faithfully.

    Never downloads. Checks the architecture and the device; refuses missing or mismatched
    weights and loader errors. A checkpoint with a vision tower loads as the vision-language
    class (`Qwen3_5ForConditionalGeneration`), its text side serving every text row exactly as
    the text class would; one without loads the text class. Unused (MTP) weights are skipped
    (logged once). A checkpoint with DEMO.json is a demo model whatever the spec
    says. The tokenizer's answer codes are computed here; the first 16 are always A..P, so
    native prompts never change.
    """
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        Qwen3_5ForCausalLM,
        Qwen3_5ForConditionalGeneration,
    )

    directory = spec.directory
    if memory is None:
        memory = device_memory(spec, torch)
    if isinstance(memory, CudaMemory):
        memory.apply_cap()
    try:
        config = AutoConfig.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    except Exception as exc:
        raise CheckpointError(f"cannot read {directory}/config.json: {exc}") from None
    model_cls: Any
    multimodal = config.model_type in QWEN35_MODEL_TYPES and has_vision_tower(config)
    if multimodal:
        model_cls, model_config = Qwen3_5ForConditionalGeneration, config
    elif config.model_type in QWEN35_MODEL_TYPES:
        model_cls, model_config = Qwen3_5ForCausalLM, config.get_text_config()
    elif spec.allow_any_architecture:
        model_cls, model_config = AutoModelForCausalLM, config
    else:
        raise CheckpointError(
            f"model_type {config.model_type!r} is not a Qwen3.5 text model; set "
            "SEMIF_ALLOW_ANY_ARCHITECTURE=true to serve it anyway"
        )
    try:
        model, info = model_cls.from_pretrained(
            str(directory),
            config=model_config,
            dtype=getattr(torch, spec.dtype),
            local_files_only=True,
            trust_remote_code=False,
            output_loading_info=True,
            # Report wrong-shaped tensors in `mismatched_keys` (refused below, by name) instead
            # of transformers' bare "ignore_mismatched_sizes is False" error.
            ignore_mismatched_sizes=True,
        )
    except Exception as exc:
        raise CheckpointError(f"the checkpoint failed to load: {exc}") from None
    problems = {k: list(info.get(k) or []) for k in ("missing_keys", "mismatched_keys", "error_msgs")}
    if any(problems.values()):
        detail = "; ".join(f"{k}: {v[:5]}" for k, v in problems.items() if v)
        raise CheckpointError(f"the checkpoint is incomplete or mismatched ({detail})")
    used = sum(1 for _ in model.named_parameters())
    skipped = max(0, len(checkpoint_tensor_names(directory)) - used)
    if skipped:
        log.info("skipped %d checkpoint tensors the model does not use", skipped)
    model.to(spec.device)
    model.eval()
    if spec.device == "cpu":
        set_interop_threads(torch)  # the intra-op threads are set per forward (engine.threads)
    if spec.device == "cpu" and spec.cpu_kernels:
        linear_attention_cpu.accelerate(model)
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    vision = None
    if multimodal:
        vision = VisionTower(model, tokenizer)
        model = text_side(model, Qwen3_5ForCausalLM)
    identity = ModelIdentity(
        source=spec.source,
        revision=spec.revision,
        dtype=spec.dtype,
        device=spec.device,
        demo=spec.demo or (directory / "DEMO.json").exists(),
    )
    return LoadedModel(model, PromptCodec(tokenizer), identity, memory, skipped, vision)


def text_side(model: Any, text_class: Any) -> Any:
    """The text class over a vision-language model's own language model and head (no copy):
    text rows run through exactly the modules the full model would use."""
    import torch

    with torch.device("meta"):
        text = text_class(model.config.get_text_config())
    text.model = model.model.language_model
    text.lm_head = model.lm_head
    return text.eval()


def device_memory(spec: CheckpointSpec, torch: Any) -> DeviceMemory:
    """The memory view of the spec's device: the host, or the one visible GPU under its cap."""
    if spec.device == "cpu":
        return HostMemory()
    if not torch.cuda.is_available():
        raise ConfigurationError("SEMIF_DEVICE=cuda but no CUDA device is visible")
    if torch.cuda.device_count() != 1:
        raise ConfigurationError(
            f"SEMIF_DEVICE=cuda needs exactly one visible GPU, found {torch.cuda.device_count()} "
            "(set CUDA_VISIBLE_DEVICES)"
        )
    return CudaMemory(spec.vram_cap_gib)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _torch_version() -> str:
    import torch

    return str(torch.__version__)
