"""lev's per-bucket temperatures (`calibration.json`, lev's `calibrate.py`): the buckets a
question falls in and the temperature each reads."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import get_args

from semif_serve.domain.lev.types import CALIBRATION_FILE, LevReleaseError, Mode, is_int, is_number

CHOICE_BANDS = ((8, "small"), (26, "mid"))  # above 26: "large"
BANDS = ("small", "mid", "large")
BUCKET_TYPES = ("choice", "score", "noul", "noul_binary")
MODES: tuple[str, ...] = get_args(Mode)


def option_band(n_options: int) -> str:
    """lev's choice band by option count: small <= 8, mid <= 26, large above."""
    for upper, name in CHOICE_BANDS:
        if n_options <= upper:
            return name
    return "large"


def bucket_key(bucket_type: str, mode: str, n_options: int | None = None) -> str:
    """`{type}:{mode}[:{band}]`; only choice is banded."""
    band = option_band(n_options) if bucket_type == "choice" and n_options is not None else None
    return f"{bucket_type}:{mode}" + (f":{band}" if band else "")


@dataclass(frozen=True)
class LevCalibration:
    """`calibration.json`: one temperature per bucket; an absent bucket falls back."""

    temperatures: Mapping[str, float]
    fitted_on: str = ""
    n_samples: Mapping[str, int] | None = None

    def temperature(self, bucket_type: str, mode: str, n_options: int) -> tuple[str, float]:
        """The bucket used and its T: banded, else unbanded, else 1.0 (lev's lookup)."""
        banded = bucket_key(bucket_type, mode, n_options)
        plain = bucket_key(bucket_type, mode)
        if banded in self.temperatures:
            return banded, self.temperatures[banded]
        if plain in self.temperatures:
            return plain, self.temperatures[plain]
        return "default", 1.0


UNCALIBRATED = LevCalibration(temperatures={})


def _valid_bucket(key: str) -> bool:
    parts = key.split(":")
    if len(parts) not in (2, 3) or parts[0] not in BUCKET_TYPES or parts[1] not in MODES:
        return False
    return len(parts) == 2 or parts[2] in BANDS


def parse_calibration(data: object, file: str = CALIBRATION_FILE) -> LevCalibration:
    """Validate a parsed `calibration.json` (`temperatures`, `fitted_on`, `n_samples`)."""
    if not isinstance(data, dict):
        raise LevReleaseError(file, None, "must be a JSON object")
    temperatures = data.get("temperatures")
    if not isinstance(temperatures, dict):
        raise LevReleaseError(file, "temperatures", "required: an object of bucket -> temperature")
    table: dict[str, float] = {}
    for key, value in temperatures.items():
        if not _valid_bucket(key):
            raise LevReleaseError(
                file,
                f"temperatures.{key}",
                "is not a bucket {type}:{mode}[:{band}] (types "
                f"{list(BUCKET_TYPES)}, modes {list(MODES)}, bands {list(BANDS)})",
            )
        if not (is_number(value) and math.isfinite(value) and value > 0):
            raise LevReleaseError(file, f"temperatures.{key}", f"must be a finite number > 0, not {value!r}")
        table[key] = float(value)
    fitted_on = data.get("fitted_on", "")
    if not isinstance(fitted_on, str):
        raise LevReleaseError(file, "fitted_on", f"must be a string, not {fitted_on!r}")
    n_samples = data.get("n_samples", {})
    if not isinstance(n_samples, dict) or not all(is_int(v) for v in n_samples.values()):
        raise LevReleaseError(file, "n_samples", "must be an object of bucket -> count")
    return LevCalibration(temperatures=table, fitted_on=fitted_on, n_samples=dict(n_samples))
