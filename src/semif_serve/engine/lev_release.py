"""A lev release directory read exactly as lev reads it, checked against the base it will run on.

A release is an entry of the engine's adapter bank (its PEFT LoRA adapter, read once and checked
by the bank's rules: `AdapterBank.read`) plus what lev adds: `lev_release.json` (checked against
the adapter: its base, its rank), the candidate head (`mode_b_head.pt`, `engine.lev_head`),
`calibration.json` and the release's tokenizer. `load_lev_release` refuses (`LevReleaseError`,
naming the file and the key) anything it cannot serve exactly: another base, a shape the base
does not have, a missing file, a LoRA feature beyond plain LoRA. `base_release` is lev's method
over the frozen base (no adapter).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from semif_serve.domain.lev.calibration import UNCALIBRATED, LevCalibration, parse_calibration
from semif_serve.domain.lev.release import LevManifest, LevOptions, parse_manifest, serving_options
from semif_serve.domain.lev.routing import CODE_COUNT, LevCodes, all_codes
from semif_serve.domain.lev.types import (
    CALIBRATION_FILE,
    HEAD_FILE,
    MANIFEST_FILE,
    TOKENIZER_FILE,
    LevReleaseError,
)
from semif_serve.domain.peft_files import ADAPTER_CONFIG_FILE
from semif_serve.domain.requests import BASE
from semif_serve.engine.adapters import AdapterBank, AdapterError, LoraWeights
from semif_serve.engine.lev_head import load_head


@dataclass(frozen=True)
class LevRelease:
    """A release ready to serve over a base: what the engine needs, each part checked."""

    directory: Path
    manifest: LevManifest
    options: LevOptions
    adapter: int  # its adapter's index in the engine's bank (BASE: lev's method over the frozen base)
    adapter_scale: float  # the serving-time multiplier: the operator's, else the manifest's, else 1.0
    head: Any | None  # LevHead in float32 on the base's device, or None (Mode A only)
    calibration: LevCalibration
    tokenizer: Any  # the release's own tokenizer when it ships tokenizer.json, else the base's
    codes: LevCodes  # the codes that are one token after the style's label prefix

    @property
    def name(self) -> str:
        """The release's name from its manifest (its directory's name when absent)."""
        return self.manifest.name or self.directory.name

    @property
    def frozen_base(self) -> bool:
        """lev's method over the base alone (`base_release`): no adapter, no head, no calibration."""
        return self.adapter == BASE


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LevReleaseError(str(path), None, "missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LevReleaseError(str(path), None, f"is not readable JSON ({exc})") from None


def _check_adapter(
    weights: LoraWeights, manifest: LevManifest, directory: Path, base_name: str | None
) -> None:
    """What lev's manifest says of its adapter, held to the adapter the bank read."""
    config, manifest_file = str(directory / ADAPTER_CONFIG_FILE), str(directory / MANIFEST_FILE)
    if weights.base_model != manifest.base_model:
        raise LevReleaseError(
            config,
            "base_model_name_or_path",
            f"{weights.base_model!r} differs from {MANIFEST_FILE} base_model {manifest.base_model!r}",
        )
    if base_name is not None and manifest.base_model != base_name:
        raise LevReleaseError(
            manifest_file,
            "base_model",
            f"the release is for {manifest.base_model!r}; this service's base is {base_name!r}",
        )
    if manifest.lora_rank is not None and manifest.lora_rank != weights.rank:
        raise LevReleaseError(
            manifest_file,
            "lora_rank",
            f"{manifest.lora_rank} differs from {ADAPTER_CONFIG_FILE} r {weights.rank}",
        )


def label_codes_for(tokenizer: Any, prefix: str) -> LevCodes:
    """For every code of lev's scheme, its one token after `prefix`, or None where it splits."""
    texts = [prefix + code for code in all_codes()]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    ids = tuple(row[0] if len(row) == 1 else None for row in encoded)
    assert len(ids) == CODE_COUNT
    return LevCodes(prefix, ids)


def _same_files(directory: Path, base_dir: Path | None) -> bool:
    """Whether the release's tokenizer files are byte for byte the base's (then it is the base's)."""
    if base_dir is None:
        return False
    names = {p.name for p in directory.glob("tokenizer*")} | {p.name for p in base_dir.glob("tokenizer*")}
    return all(
        (directory / n).is_file()
        and (base_dir / n).is_file()
        and (directory / n).read_bytes() == (base_dir / n).read_bytes()
        for n in names
    )


def _load_tokenizer(directory: Path, base_tokenizer: Any, base_dir: Path | None, vocab_rows: int) -> Any:
    if not (directory / TOKENIZER_FILE).is_file() or _same_files(directory, base_dir):
        return base_tokenizer  # as lev: the base's tokenizer when the release ships none
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(directory), local_files_only=True, trust_remote_code=False
        )
    except Exception as exc:
        raise LevReleaseError(str(directory / TOKENIZER_FILE), None, f"does not load ({exc})") from None
    if len(tokenizer) > vocab_rows:
        raise LevReleaseError(
            str(directory / TOKENIZER_FILE),
            None,
            f"has {len(tokenizer)} tokens; the base embeds {vocab_rows}",
        )
    return tokenizer


def load_lev_release(
    directory: Path | str,
    bank: AdapterBank,
    base_tokenizer: Any,
    *,
    name: str | None = None,
    base_name: str | None = None,
    prompt_style: str | None = None,
    noul_readout: str | None = None,
    score_order_average: str = "none",
    max_label_options: int | None = None,
    settings_source: str = "settings",
    base_directory: Path | None = None,
    adapter_scale: float | None = None,
) -> LevRelease:
    """Read a lev release for the bank's base and serve its adapter in `bank` as `name` (None: the
    directory); refuse what cannot be read exactly (LevReleaseError naming the file and key).

    `base_name` is the service's base model name (compared with the manifest's `base_model`);
    the keyword settings are lev's server flags (`settings_source` names where they came from in
    errors). `base_directory` (the base checkpoint) lets a release whose tokenizer files are the
    base's own reuse `base_tokenizer` instead of loading them again. `adapter_scale` is the
    operator's serving multiplier; it replaces the manifest's `adapter_scale` (None: the
    manifest's, 1.0 where it has none). The head is placed on the base's device.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise LevReleaseError(str(directory), None, "is not a directory")
    manifest_path = directory / MANIFEST_FILE
    manifest = parse_manifest(_read_json(manifest_path), str(manifest_path))
    for i, listed in enumerate(manifest.files or ()):
        if not (directory / listed).is_file():
            raise LevReleaseError(
                str(manifest_path), f"files[{i}]", f"lists {listed!r}, which the release lacks"
            )
    for key, flag, file in (
        ("mode_b_head", manifest.mode_b_head, HEAD_FILE),
        ("calibrated", manifest.calibrated, CALIBRATION_FILE),
    ):
        if flag and not (directory / file).is_file():
            raise LevReleaseError(str(manifest_path), key, f"is true, and the release has no {file}")
    options = serving_options(
        manifest,
        prompt_style=prompt_style,
        noul_readout=noul_readout,
        score_order_average=score_order_average,
        max_label_options=max_label_options,
        source=settings_source,
    )
    if adapter_scale is not None and not (math.isfinite(adapter_scale) and adapter_scale > 0):
        raise LevReleaseError(settings_source, "scale", f"must be a finite number > 0, not {adapter_scale!r}")
    scale = adapter_scale if adapter_scale is not None else (manifest.adapter_scale or 1.0)
    try:
        weights = bank.read(directory)
    except AdapterError as exc:
        file, _, problem = str(exc).partition(": ")
        raise LevReleaseError(file, None, problem) from None
    _check_adapter(weights, manifest, directory, base_name)
    model = bank.model
    hidden_size = int(model.config.hidden_size)
    head_path = directory / HEAD_FILE
    device = next(model.parameters()).device
    head = load_head(head_path, hidden_size, device) if head_path.is_file() else None  # lev: when present
    calibration_path = directory / CALIBRATION_FILE
    calibration = (
        parse_calibration(_read_json(calibration_path), str(calibration_path))
        if calibration_path.is_file()
        else UNCALIBRATED
    )
    vocab_rows = int(model.get_input_embeddings().weight.shape[0])
    tokenizer = _load_tokenizer(directory, base_tokenizer, base_directory, vocab_rows)
    codes = label_codes_for(tokenizer, options.label_prefix)
    return LevRelease(
        directory=directory,
        manifest=manifest,
        options=options,
        adapter=bank.serve(name or str(directory), weights, multiplier=scale),
        adapter_scale=scale,
        head=head,
        calibration=calibration,
        tokenizer=tokenizer,
        codes=codes,
    )


def base_release(
    directory: Path, base_tokenizer: Any, *, base_name: str, settings_source: str = "settings", **flags: Any
) -> LevRelease:
    """The frozen base read with lev's method, as lev's server reads it without a checkpoint
    (`lev serve --model`): lev's prompt, label codes and orders over the base's own weights and
    tokenizer, no adapter, no candidate head, every temperature 1.0. `directory` is the base
    checkpoint; `flags` are lev's server flags, as `load_lev_release` takes them (`prompt_style`,
    `noul_readout`, `score_order_average`, `max_label_options`)."""
    manifest = LevManifest(
        base_model=base_name,
        name=None,
        prompt_style=None,
        noul_readout=None,
        lora_rank=None,
        mode_b_head=False,
        calibrated=False,
        files=None,
        adapter_scale=None,
    )
    options = serving_options(manifest, source=settings_source, **flags)
    return LevRelease(
        directory=Path(directory),
        manifest=manifest,
        options=options,
        adapter=BASE,
        adapter_scale=1.0,
        head=None,
        calibration=UNCALIBRATED,
        tokenizer=base_tokenizer,
        codes=label_codes_for(base_tokenizer, options.label_prefix),
    )
