"""`lev_release.json` and lev's server flags: the manifest checked key by key, and the serving
options the manifest and the operator's flags make together (lev's `release.py`, `model.py`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from semif_serve.domain.lev.types import (
    MANIFEST_FILE,
    NOUL_READOUTS,
    PROMPT_STYLES,
    SCORE_ORDER_ALIASES,
    SCORE_ORDER_AVERAGES,
    LevReleaseError,
    NoulReadout,
    PromptStyle,
    ScoreOrderAverage,
    is_int,
    is_number,
)


@dataclass(frozen=True)
class LevManifest:
    """`lev_release.json`: what the server reads (base model, prompt style, scale) and what it checks."""

    base_model: str
    name: str | None
    prompt_style: PromptStyle | None
    noul_readout: NoulReadout | None
    lora_rank: int | None
    mode_b_head: bool | None
    calibrated: bool | None
    files: tuple[str, ...] | None
    adapter_scale: float | None


def parse_manifest(data: object, file: str = MANIFEST_FILE) -> LevManifest:
    """Validate a parsed `lev_release.json`; every error names `file` and the key."""
    if not isinstance(data, dict):
        raise LevReleaseError(file, None, "must be a JSON object")

    def typed(key: str, check, what: str) -> Any:
        value = data.get(key)
        if value is not None and not check(value):
            raise LevReleaseError(file, key, f"must be {what}, not {value!r}")
        return value

    base = data.get("base_model")
    if not isinstance(base, str) or not base:
        raise LevReleaseError(file, "base_model", "required: the base model's name (a non-empty string)")
    rank = typed("lora_rank", lambda v: is_int(v) and v >= 1, "a positive integer")
    scale = typed(
        "adapter_scale", lambda v: is_number(v) and math.isfinite(v) and v > 0, "a finite number > 0"
    )
    files = typed(
        "files",
        lambda v: isinstance(v, list) and all(isinstance(f, str) and f for f in v),
        "a list of file names",
    )
    if files is not None:
        for i, name in enumerate(files):
            if "/" in name or "\\" in name or name in (".", ".."):
                raise LevReleaseError(
                    file, f"files[{i}]", f"must be a file name in the release, not {name!r}"
                )
    return LevManifest(
        base_model=base,
        name=typed("name", lambda v: isinstance(v, str), "a string"),
        prompt_style=typed("prompt_style", lambda v: v in PROMPT_STYLES, f"one of {list(PROMPT_STYLES)}"),
        noul_readout=typed("noul_readout", lambda v: v in NOUL_READOUTS, f"one of {list(NOUL_READOUTS)}"),
        lora_rank=rank,
        mode_b_head=typed("mode_b_head", lambda v: isinstance(v, bool), "true or false"),
        calibrated=typed("calibrated", lambda v: isinstance(v, bool), "true or false"),
        files=None if files is None else tuple(files),
        adapter_scale=None if scale is None else float(scale),
    )


@dataclass(frozen=True)
class LevOptions:
    """How lev's server reads a release: its flags, resolved against the manifest."""

    prompt_style: PromptStyle = "plain"
    noul_readout: NoulReadout = "rating"
    score_order_average: ScoreOrderAverage = "none"
    max_label_options: int | None = None
    order_average: bool = True
    skip_multi_token_codes: bool = True

    @property
    def label_prefix(self) -> str:
        """A space before the code after plain `Answer:`; none at the start of a chat answer."""
        return " " if self.prompt_style == "plain" else ""


def serving_options(
    manifest: LevManifest,
    *,
    prompt_style: str | None = None,
    noul_readout: str | None = None,
    score_order_average: str = "none",
    max_label_options: int | None = None,
    source: str = "settings",
) -> LevOptions:
    """lev's serving policy for a release: the manifest's prompt style, rating nouls unless told
    binary (the manifest's `noul_readout` is not read, as in lev), the operator's score orders and
    label cap. A prompt style that contradicts the manifest is refused (lev would drop it silently)."""
    if prompt_style is not None and prompt_style not in PROMPT_STYLES:
        raise LevReleaseError(
            source, "prompt_style", f"must be one of {list(PROMPT_STYLES)}, not {prompt_style!r}"
        )
    if (
        manifest.prompt_style is not None
        and prompt_style is not None
        and prompt_style != manifest.prompt_style
    ):
        raise LevReleaseError(
            source,
            "prompt_style",
            f"{prompt_style!r} contradicts {MANIFEST_FILE} prompt_style {manifest.prompt_style!r}",
        )
    if noul_readout is not None and noul_readout not in NOUL_READOUTS:
        raise LevReleaseError(
            source, "noul_readout", f"must be one of {list(NOUL_READOUTS)}, not {noul_readout!r}"
        )
    score_order_average = SCORE_ORDER_ALIASES.get(score_order_average, score_order_average)  # lev's names
    if score_order_average not in SCORE_ORDER_AVERAGES:
        raise LevReleaseError(
            source,
            "score_order_average",
            f"must be one of {list(SCORE_ORDER_AVERAGES)}, not {score_order_average!r}",
        )
    if max_label_options is not None and not (is_int(max_label_options) and max_label_options >= 1):
        raise LevReleaseError(
            source, "max_label_options", f"must be an integer >= 1, not {max_label_options!r}"
        )
    style = manifest.prompt_style or prompt_style or "plain"
    return LevOptions(
        prompt_style=style,  # type: ignore[arg-type]
        noul_readout=noul_readout or "rating",  # type: ignore[arg-type]
        score_order_average=score_order_average,  # type: ignore[arg-type]
        max_label_options=max_label_options,
    )
