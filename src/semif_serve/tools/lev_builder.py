"""A tiny random-weight lev release over a checkpoint, written in lev's own on-disk format.

PEFT saves the LoRA adapter (`save_pretrained`); the candidate head is a torch state dict with
lev's parameter names (`torch.save`); `calibration.json` and `lev_release.json` are written as
lev's `CalibrationProfile.save` and `build_release` write them; the base's tokenizer files are
copied in, as a training step directory holds them. The demo, the tests and the benchmarks
serve it; nothing here is read back by the service except through the release reader.
"""

from __future__ import annotations

import json
import shutil
import warnings
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from semif_serve.domain.lev.types import CALIBRATION_FILE, HEAD_FILE, MANIFEST_FILE
from semif_serve.domain.peft_files import ADAPTER_CONFIG_FILE

# Attention and MLP projections of both of Qwen3.5's layer kinds.
DEFAULT_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "in_proj_qkv",
    "in_proj_z",
    "out_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
# One temperature per kind of bucket, so every lookup path (banded, unbanded, default) is used.
DEFAULT_TEMPERATURES = {
    "choice:A": 2.5,
    "choice:A:small": 0.7,
    "choice:A:mid": 1.6,
    "choice:B": 0.5,
    "score:A": 1.3,
    "noul:A": 0.9,
    "noul_binary:A": 1.8,
}
DEFAULT_BASE_NAME = "Qwen/Qwen3.5-4B"


def _text_model(checkpoint: Path) -> Any:
    import torch
    from transformers import AutoConfig, Qwen3_5ForCausalLM

    config = AutoConfig.from_pretrained(str(checkpoint), local_files_only=True).get_text_config()
    return Qwen3_5ForCausalLM.from_pretrained(
        str(checkpoint), config=config, dtype=torch.float32, local_files_only=True
    ).eval()


def random_head_state(hidden_size: int, proj_dim: int, seed: int) -> dict[str, Any]:
    """A random candidate head's state dict under lev's parameter names (8-head set attention)."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    return {
        "question_proj.weight": rand(proj_dim, hidden_size, scale=hidden_size**-0.5),
        "candidate_proj.weight": rand(proj_dim, hidden_size, scale=hidden_size**-0.5),
        "set_attention.in_proj_weight": rand(3 * proj_dim, proj_dim, scale=proj_dim**-0.5),
        "set_attention.in_proj_bias": rand(3 * proj_dim, scale=0.1),
        "set_attention.out_proj.weight": rand(proj_dim, proj_dim, scale=proj_dim**-0.5),
        "set_attention.out_proj.bias": rand(proj_dim, scale=0.1),
        "norm.weight": 1.0 + rand(proj_dim, scale=0.1),
        "norm.bias": rand(proj_dim, scale=0.1),
        "score.weight": rand(1, proj_dim, scale=1.0),
    }


def write_lev_release(
    directory: Path | str,
    base_checkpoint: Path | str,
    *,
    prompt_style: str = "plain",
    rank: int = 4,
    alpha: int = 8,
    target_modules: tuple[str, ...] = DEFAULT_TARGETS,
    adapter_scale: float | None = 0.25,
    temperatures: dict[str, float] | None = None,
    head: bool = True,
    head_proj_dim: int = 32,
    base_name: str = DEFAULT_BASE_NAME,
    name: str = "lev-tiny-random",
    seed: int = 0,
) -> Path:
    """Write a random lev release for `base_checkpoint` to `directory` and return it.

    `temperatures` None writes `DEFAULT_TEMPERATURES`; an empty dict writes no calibration (an
    uncalibrated release). `adapter_scale` None leaves the key out of the manifest.
    """
    import torch
    from peft import LoraConfig, get_peft_model

    directory = Path(directory)
    base_checkpoint = Path(base_checkpoint)
    directory.mkdir(parents=True, exist_ok=True)
    model = _text_model(base_checkpoint)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(target_modules),
        lora_dropout=0.0,
        init_lora_weights=False,  # random A and B: a zero B would make the adapter a no-op
    )
    peft_model = get_peft_model(model, config)
    peft_model.peft_config["default"].base_model_name_or_path = base_name
    with warnings.catch_warnings():  # PEFT looks the (absent) base name up for its embedding check
        warnings.simplefilter("ignore", UserWarning)
        peft_model.save_pretrained(str(directory))
    (directory / "README.md").unlink(missing_ok=True)  # lev replaces PEFT's card with its own
    if head:
        state = random_head_state(int(model.config.hidden_size), head_proj_dim, seed + 1)
        torch.save(state, directory / HEAD_FILE)
    for source in sorted(base_checkpoint.iterdir()):
        if source.name.startswith("tokenizer") or source.name == "chat_template.jinja":
            shutil.copyfile(source, directory / source.name)
    copied = sorted(p.name for p in directory.iterdir() if p.is_file())
    table = DEFAULT_TEMPERATURES if temperatures is None else temperatures
    if table:
        profile = {"temperatures": table, "fitted_on": "calibration", "n_samples": {k: 100 for k in table}}
        (directory / CALIBRATION_FILE).write_text(json.dumps(profile, indent=2))
        copied.append(CALIBRATION_FILE)
    adapter_config = json.loads((directory / ADAPTER_CONFIG_FILE).read_text())
    manifest: dict[str, Any] = {
        "name": name,
        "preset": "tiny-random",
        "step": None,
        "base_model": adapter_config["base_model_name_or_path"],
        "lora_rank": adapter_config.get("r"),
        "mode_b_head": HEAD_FILE in copied,
        "calibrated": bool(table),
        "noul_readout": "rating",
        "prompt_style": prompt_style,
        "files": copied,
        "metrics": {},
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    if adapter_scale is not None:
        manifest["adapter_scale"] = adapter_scale
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    (directory / "README.md").write_text(
        f"# {name}\n\nA random-weight lev-format release for tests and the demo.\n"
    )
    return directory
