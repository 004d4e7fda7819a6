"""The models the service serves by name: the base, and the releases and adapters that
`SEMIF_MODELS` (a TOML file) declares over the same base weights, with the operator's aliases.

```toml
[models.lev-4b]
release = "/models/lev"          # a lev release directory (lev's method)
prompt_style = "plain"           # optional, as lev's server flags (max_label_options too)
[models.triage]
adapter = "/models/triage-lora"  # a PEFT LoRA adapter, read with SemIf's method
scale = 0.5                      # optional serving multiplier on the adapter
[models.lev-base]
method = "lev"                   # lev's prompt and readout over the frozen base (no adapter)
[aliases]
local = "lev-4b"
```

`load_models(path, base_name)` reads and validates it once at startup: every error names the
file and the key. Relative paths are read from the file's directory. `jev-latest` and
`jev-preview` stay aliases of the base unless `[aliases]` points them elsewhere; no model may
take their name or the base's.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from semif_serve.domain.lev.types import MANIFEST_FILE
from semif_serve.domain.peft_files import ADAPTER_FILES
from semif_serve.domain.types import ConfigurationError

Method = Literal["semif", "lev"]
SEMIF: Method = "semif"  # SemIf's prompt and readout (the base, and any PEFT adapter)
LEV: Method = "lev"  # lev's prompt and readout (a lev release)
JEV_ALIASES = ("jev-latest", "jev-preview")
# lev's server flags a release entry may set, and the values lev accepts.
LEV_OPTIONS: dict[str, tuple[str, ...]] = {
    "noul_readout": ("binary", "rating"),
    "prompt_style": ("plain", "chat"),
    "score_order_average": ("off", "reversed", "cyclic"),
}
COMMON_KEYS = ("scale", "base_model")
LABEL_CAP = "max_label_options"  # lev's label cap: a question with more candidates reads its head
RELEASE_KEYS = ("release", *LEV_OPTIONS, LABEL_CAP, *COMMON_KEYS)
ADAPTER_KEYS = ("adapter", *COMMON_KEYS)
# The base read with lev's method (lev's `serve --model` without a checkpoint): lev's flags only.
LEV_BASE_KEYS = ("method", *LEV_OPTIONS, LABEL_CAP)
# What lev's server reads the frozen base with: a binary noul in two orders (a release reads a rating).
LEV_BASE_OPTIONS = {"noul_readout": "binary"}
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


@dataclass(frozen=True)
class ModelEntry:
    """One served model over the base weights: its name, its method and what it loads.

    `method` is the seam for the readout: "semif" (SemIf's prompt; `adapter` a PEFT LoRA
    directory, or None for the base itself) or "lev" (`release` a lev release directory,
    read with lev's prompt, labels and calibration; `lev_options` its server flags; `release`
    None: the frozen base read with lev's method, `lev_base`).
    `scale` is the serving multiplier on the adapter (None: 1.0, or the release's own
    `adapter_scale`); `base_model` is a base name the operator vouches for, accepted where
    the adapter's `base_model_name_or_path` names the base otherwise."""

    name: str
    method: Method
    adapter: Path | None = None
    release: Path | None = None
    scale: float | None = None
    base_model: str | None = None
    lev_options: Mapping[str, str] = field(default_factory=dict)
    max_label_options: int | None = None  # lev's label cap (None: Mode A while the codes last)

    @property
    def is_base(self) -> bool:
        """The base itself (no adapter, SemIf's method)."""
        return self.method == SEMIF and self.adapter is None

    @property
    def lev_base(self) -> bool:
        """The base itself read with lev's method (no release, no adapter)."""
        return self.method == LEV and self.release is None

    @property
    def path(self) -> Path | None:
        """The adapter or release directory (None for the base)."""
        return self.adapter if self.method == SEMIF else self.release


@dataclass(frozen=True)
class ModelSet:
    """Every served model by name (the base first, then the file's, in its order) and the aliases."""

    base: str
    models: Mapping[str, ModelEntry]
    aliases: Mapping[str, str]
    source: Path | None = None  # the SEMIF_MODELS file, where one was given
    declared: frozenset[str] = frozenset()  # the aliases the file declares

    def resolve(self, name: str, *, jev_aliases: bool = True) -> ModelEntry | None:
        """The model a request naming `name` reads (a model's name or an alias); None when
        unknown. `jev_aliases=False` (SEMIF_SYSTEMONE_ALLOW_ALIASES off) leaves the Jev names
        unknown unless `[aliases]` declares them."""
        entry = self.models.get(name)
        if entry is not None:
            return entry
        target = self.aliases.get(name)
        if target is None:
            return None
        if name in JEV_ALIASES and not jev_aliases and name not in self.declared:
            return None
        return self.models[target]

    def aliases_of(self, name: str) -> list[str]:
        """Every alias that resolves to the model `name`, in the file's order."""
        return [alias for alias, target in self.aliases.items() if target == name]

    @property
    def adapters(self) -> list[ModelEntry]:
        """The models that load something over the base (adapters and releases), in order."""
        return [entry for entry in self.models.values() if not entry.is_base]


def base_only(base: str) -> ModelSet:
    """The set without a SEMIF_MODELS file: the base and the Jev aliases."""
    return ModelSet(base, {base: ModelEntry(base, SEMIF)}, dict.fromkeys(JEV_ALIASES, base))


def load_models(path: Path | None, base: str) -> ModelSet:
    """Read and validate the SEMIF_MODELS file; `base` is the base model's served name
    (`<source>@<revision>`). Raises ConfigurationError naming the file and the key."""
    if path is None:
        return base_only(base)
    where = f"SEMIF_MODELS: {path}"
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigurationError(f"{where}: cannot read ({type(exc).__name__})") from None
    except UnicodeDecodeError:
        raise ConfigurationError(f"{where}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"{where}: not valid TOML: {exc}") from None
    unknown = sorted(set(data) - {"models", "aliases"})
    if unknown:
        raise ConfigurationError(
            f"{where}: {unknown[0]}: unknown table (expected [models.<name>] and [aliases])"
        )
    tables = _table(data.get("models", {}), where, "models")
    root = Path(path).parent
    models: dict[str, ModelEntry] = {base: ModelEntry(base, SEMIF)}
    for name, table in tables.items():
        key = f"models.{name}"
        if not NAME.match(name):
            raise ConfigurationError(
                f"{where}: {key}: a model name is 1-128 letters, digits or ._:/@+- (a letter or digit first)"
            )
        if name == base or name in JEV_ALIASES:
            raise ConfigurationError(
                f"{where}: {key}: {name!r} is the base model's name or a Jev alias (use [aliases] for those)"
            )
        models[name] = _entry(name, _table(table, where, key), where, key, root)
    aliases = dict.fromkeys(JEV_ALIASES, base)
    for alias, target in _table(data.get("aliases", {}), where, "aliases").items():
        key = f"aliases.{alias}"
        if not NAME.match(alias):
            raise ConfigurationError(f"{where}: {key}: not a valid model name")
        if alias in models:
            raise ConfigurationError(
                f"{where}: {key}: shadows the model {alias!r} (an alias needs a name of its own)"
            )
        if not isinstance(target, str):
            raise ConfigurationError(f"{where}: {key}: must be a model name (a string)")
        if target not in models:
            known = ", ".join(repr(n) for n in models)
            raise ConfigurationError(f"{where}: {key}: {target!r} is not a model (models: {known})")
        aliases[alias] = target
    declared = frozenset(aliases) - (frozenset(JEV_ALIASES) - frozenset(data.get("aliases", {})))
    return ModelSet(base, models, aliases, Path(path), declared)


def _table(value: Any, where: str, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigurationError(f"{where}: {key}: must be a table")
    return value


def _entry(name: str, table: dict[str, Any], where: str, key: str, root: Path) -> ModelEntry:
    if "method" in table and not {"release", "adapter"} & set(table):
        return _lev_base(name, table, where, key)
    kinds = [k for k in ("release", "adapter") if k in table]
    if len(kinds) != 1:
        what = "both release and adapter" if kinds else "neither release nor adapter"
        raise ConfigurationError(f"{where}: {key}: sets {what} (exactly one)")
    kind = kinds[0]
    allowed = RELEASE_KEYS if kind == "release" else ADAPTER_KEYS
    for k in table:
        if k not in allowed:
            raise ConfigurationError(
                f"{where}: {key}.{k}: unknown key for a {kind} (keys: {', '.join(allowed)})"
            )
    directory = _directory(table[kind], where, f"{key}.{kind}", root)
    if kind == "release" and not (directory / MANIFEST_FILE).is_file():
        raise ConfigurationError(f"{where}: {key}.release: {directory} has no {MANIFEST_FILE}")
    if kind == "adapter":
        for file in ADAPTER_FILES:
            if not (directory / file).is_file():
                raise ConfigurationError(f"{where}: {key}.adapter: {directory} has no {file}")
    scale = table.get("scale")
    if scale is not None and (
        isinstance(scale, bool)
        or not isinstance(scale, int | float)
        or not (math.isfinite(scale) and scale > 0)
    ):
        raise ConfigurationError(f"{where}: {key}.scale: must be a positive number, not {scale!r}")
    base_model = table.get("base_model")
    if base_model is not None and (not isinstance(base_model, str) or not base_model):
        raise ConfigurationError(f"{where}: {key}.base_model: must be a non-empty string")
    options = _lev_options(table, where, key)
    scale_value = float(scale) if scale is not None else None
    if kind == "release":
        return ModelEntry(
            name,
            LEV,
            release=directory,
            scale=scale_value,
            base_model=base_model,
            lev_options=options,
            max_label_options=_label_cap(table, where, key),
        )
    return ModelEntry(name, SEMIF, adapter=directory, scale=scale_value, base_model=base_model)


def _lev_base(name: str, table: dict[str, Any], where: str, key: str) -> ModelEntry:
    """`method = "lev"` without a release: the frozen base read with lev's method."""
    if table["method"] != LEV:
        raise ConfigurationError(
            f"{where}: {key}.method: {table['method']!r} needs a release or adapter "
            '(only "lev" reads the base alone)'
        )
    for k in table:
        if k not in LEV_BASE_KEYS:
            raise ConfigurationError(
                f"{where}: {key}.{k}: unknown key for the base read with lev's method "
                f"(keys: {', '.join(LEV_BASE_KEYS)})"
            )
    options = {**LEV_BASE_OPTIONS, **_lev_options(table, where, key)}
    return ModelEntry(name, LEV, lev_options=options, max_label_options=_label_cap(table, where, key))


def _lev_options(table: dict[str, Any], where: str, key: str) -> dict[str, str]:
    options: dict[str, str] = {}
    for option, values in LEV_OPTIONS.items():
        if option in table:
            value = table[option]
            if value not in values:
                raise ConfigurationError(
                    f"{where}: {key}.{option}: {value!r} is not one of {', '.join(repr(v) for v in values)}"
                )
            options[option] = value
    return options


def _label_cap(table: dict[str, Any], where: str, key: str) -> int | None:
    cap = table.get(LABEL_CAP)
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ConfigurationError(f"{where}: {key}.{LABEL_CAP}: must be an integer >= 1, not {cap!r}")
    return cap


def _directory(value: Any, where: str, key: str, root: Path) -> Path:
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"{where}: {key}: must be a directory path (a string)")
    directory = Path(value).expanduser()
    if not directory.is_absolute():
        directory = root / directory
    if not directory.is_dir():
        raise ConfigurationError(f"{where}: {key}: {directory} is not a directory")
    return directory
