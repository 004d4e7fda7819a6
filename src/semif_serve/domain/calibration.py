"""Per-workload temperature scaling at run time: the calibration file and applying T.

Fitting T lives in fitting.py (the `calibrate` command and `POST /calibrate` call it)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from semif_serve.domain.numerics import softmax
from semif_serve.domain.orderings import MODES

T_MIN, T_MAX = 0.05, 20.0
MODEL_KEY = "model"  # a workload's served model, in the object form


class CalibrationFileError(Exception):
    """An unusable calibration file; the message names the file and the offending entry."""


@dataclass(frozen=True)
class Temperature:
    """The temperature applied to one read: `source` is the mode whose T was used."""

    value: float
    mode: str
    source: str


@dataclass(frozen=True)
class CalibrationTable:
    """Validated workload temperatures, read-only once loaded. `models` holds the workloads
    whose entry names the served model their decisions are read by (its name; startup turns
    an alias into the model's name and the base into None)."""

    entries: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    models: Mapping[str, str | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Freeze the nested mappings too, so no caller can edit a loaded table.
        frozen = {name: MappingProxyType(dict(t)) for name, t in self.entries.items()}
        object.__setattr__(self, "entries", MappingProxyType(frozen))
        object.__setattr__(self, "models", MappingProxyType(dict(self.models)))

    def with_models(self, models: Mapping[str, str | None]) -> CalibrationTable:
        """The same temperatures with the workloads' models given as served (resolved) names."""
        return CalibrationTable(self.entries, models)

    def workloads_of(self, model: str | None) -> list[str]:
        """The workloads whose entry names `model` (None: the base), sorted."""
        return sorted(w for w, m in self.models.items() if m == model)

    def __contains__(self, workload: object) -> bool:
        return workload in self.entries

    def names(self) -> list[str]:
        """The workload names, sorted."""
        return sorted(self.entries)

    def as_dict(self) -> dict[str, dict[str, float]]:
        """`{workload: {"single": T1, "rotations": T2, "all": T3}}` for /health.

        `single` is always present; `rotations` and `all` appear only when the file sets
        them (otherwise those modes fall back to `single`).
        """
        return {name: dict(self.entries[name]) for name in self.names()}

    def temperature(self, workload: str, mode: str) -> Temperature:
        """The temperature for `workload` in `mode`, falling back to the single-read T.

        Raises KeyError for an unknown workload and ValueError for an unknown mode.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        temps = self.entries[workload]
        source = mode if mode in temps else "single"
        return Temperature(value=temps[source], mode=mode, source=source)


def _check_temperature(where: str, value: Any) -> float:
    # bool is an int subclass and NaN/Infinity parse as floats: both are refused here.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CalibrationFileError(f"{where} must be a number, got {json.dumps(value)}")
    if not math.isfinite(value):
        raise CalibrationFileError(f"{where} must be a finite number, got {value}")
    if not T_MIN <= value <= T_MAX:
        raise CalibrationFileError(f"{where} must be in [{T_MIN}, {T_MAX:g}], got {value}")
    return float(value)


def load_calibration(path: Path | None) -> CalibrationTable:
    """Read and validate the calibration file (None -> empty table); raises CalibrationFileError.

    The file is a JSON object mapping workload name -> T (the single-read temperature) or
    -> {"single": T1, "rotations": T2, "all": T3} with `single` required; every T is a
    finite number in [0.05, 20]. The object form may name the served model its decisions are
    read by, `"model": "<name or alias>"` (checked against SEMIF_MODELS at startup).
    """
    if path is None:
        return CalibrationTable({})
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CalibrationFileError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CalibrationFileError(f"{path}: cannot read: {type(exc).__name__}") from None

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise CalibrationFileError(f'{path}: duplicate key "{key}"')
            seen[key] = value
        return seen

    try:
        data = json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as exc:
        raise CalibrationFileError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CalibrationFileError(f"{path}: must be a JSON object of workload temperatures")
    entries: dict[str, dict[str, float]] = {}
    models: dict[str, str | None] = {}
    for name, spec in data.items():
        where = f'{path}: workload "{name}"'
        if not name.strip():
            raise CalibrationFileError(f"{path}: a workload name is empty")
        if isinstance(spec, dict):
            unknown = sorted(set(spec) - {*MODES, MODEL_KEY})
            if unknown:
                raise CalibrationFileError(
                    f'{where}: unknown key "{unknown[0]}" (allowed: {", ".join((*MODES, MODEL_KEY))})'
                )
            if MODEL_KEY in spec:
                model = spec[MODEL_KEY]
                if not isinstance(model, str) or not model.strip():
                    raise CalibrationFileError(f'{where}: "model" must be a served model\'s name')
                models[name] = model
            if "single" not in spec:
                raise CalibrationFileError(f'{where}: the object form requires "single"')
            entries[name] = {
                mode: _check_temperature(f'{where}: temperature for "{mode}"', spec[mode])
                for mode in MODES
                if mode in spec
            }
        else:
            entries[name] = {"single": _check_temperature(f"{where}: temperature", spec)}
    return CalibrationTable(entries, models)


def calibrated_probabilities(logits: Sequence[float], temperature: float) -> list[float]:
    """softmax(logits / temperature), computed stably in float64; the argmax is unchanged."""
    if not logits:
        raise ValueError("logits are empty")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")
    return softmax(logits, temperature)
