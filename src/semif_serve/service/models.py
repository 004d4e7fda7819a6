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

`load_models(path, base_name, methods)` reads and validates it once at startup: every error
names the file and the key. An entry's method is its `method` key, else the method that claims
one of its keys (lev's `release`), else SemIf's; the method reads the entry's own keys
(`service.methods`). Relative paths are read from the file's directory. `jev-latest` and
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
from typing import Any, Protocol

from semif_serve.domain.types import ConfigurationError

JEV_ALIASES = ("jev-latest", "jev-preview")
COMMON_KEYS = ("scale", "base_model")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


@dataclass(frozen=True)
class ModelEntry:
    """One served model over the base weights: its name, the name of the method that reads it
    and what that method loads.

    `directory` is what is loaded over the base (a PEFT LoRA adapter for SemIf's method, a
    release for lev's; None: the base weights alone); `scale` is the serving multiplier on its
    adapter (None: 1.0, or the release's own); `base_model` a base name the operator vouches for,
    accepted where the adapter names the base otherwise; `options` the method's own keys as
    read (lev's server flags and label cap)."""

    name: str
    method: str
    directory: Path | None = None
    scale: float | None = None
    base_model: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)


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

    def is_base(self, entry: ModelEntry) -> bool:
        """Whether `entry` is the base itself."""
        return entry.name == self.base

    @property
    def over_base(self) -> list[ModelEntry]:
        """The models besides the base (adapters, releases, the base read another way), in order."""
        return [entry for entry in self.models.values() if entry.name != self.base]


class EntryReader(Protocol):
    """A method as the file reads an entry of it (`service.methods.DecisionMethod`)."""

    name: str
    claims: tuple[str, ...]

    def read_entry(self, name: str, table: Mapping[str, Any], place: EntryPlace) -> ModelEntry:
        """The entry `name` from its table."""
        ...


class EntryReaders(Protocol):
    """The methods an entry may name (`service.methods.MethodRegistry`)."""

    @property
    def default(self) -> EntryReader:
        """The base's method, and an entry's that names none."""
        ...

    @property
    def methods(self) -> Mapping[str, EntryReader]:
        """Every method by name."""
        ...

    def named(self, name: str) -> EntryReader | None:
        """The method called `name`."""
        ...

    def claiming(self, key: str) -> EntryReader | None:
        """The method that claims `key`."""
        ...


def base_only(base: str, method: str = "semif") -> ModelSet:
    """The set without a SEMIF_MODELS file: the base (read with `method`) and the Jev aliases."""
    return ModelSet(base, {base: ModelEntry(base, method)}, dict.fromkeys(JEV_ALIASES, base))


def load_models(path: Path | None, base: str, methods: EntryReaders) -> ModelSet:
    """Read and validate the SEMIF_MODELS file; `base` is the base model's served name
    (`<source>@<revision>`), `methods` the methods an entry may name (`MethodRegistry`).
    Raises ConfigurationError naming the file and the key."""
    default = methods.default.name
    if path is None:
        return base_only(base, default)
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
    models: dict[str, ModelEntry] = {base: ModelEntry(base, default)}
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
        models[name] = _entry(name, _table(table, where, key), EntryPlace(where, key, root), methods)
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


@dataclass(frozen=True)
class EntryPlace:
    """Where an entry is written, for its errors: the file (`where`), its key, and the directory
    its relative paths are read from."""

    where: str
    key: str
    root: Path

    def error(self, key: str | None, problem: str) -> ConfigurationError:
        """A refusal naming the file and the entry's `key` (None: the entry itself)."""
        return ConfigurationError(f"{self.where}: {self.key}{'.' + key if key else ''}: {problem}")

    def allow(self, table: Mapping[str, Any], keys: tuple[str, ...], what: str) -> None:
        """Refuse a key of `table` that is not in `keys`, naming it and `what` the entry is."""
        for k in table:
            if k not in keys:
                raise self.error(k, f"unknown key for {what} (keys: {', '.join(keys)})")

    def directory(self, table: Mapping[str, Any], key: str, *needs: str) -> Path:
        """`table[key]` as a directory (relative paths from the file's) holding each of `needs`."""
        value = table[key]
        if not isinstance(value, str) or not value:
            raise self.error(key, "must be a directory path (a string)")
        directory = Path(value).expanduser()
        if not directory.is_absolute():
            directory = self.root / directory
        if not directory.is_dir():
            raise self.error(key, f"{directory} is not a directory")
        for file in needs:
            if not (directory / file).is_file():
                raise self.error(key, f"{directory} has no {file}")
        return directory

    def scale(self, table: Mapping[str, Any]) -> float | None:
        """The entry's `scale`: a positive number, or None."""
        scale = table.get("scale")
        if scale is not None and (
            isinstance(scale, bool)
            or not isinstance(scale, int | float)
            or not (math.isfinite(scale) and scale > 0)
        ):
            raise self.error("scale", f"must be a positive number, not {scale!r}")
        return float(scale) if scale is not None else None

    def base_model(self, table: Mapping[str, Any]) -> str | None:
        """The entry's `base_model`: a non-empty string, or None."""
        base_model = table.get("base_model")
        if base_model is not None and (not isinstance(base_model, str) or not base_model):
            raise self.error("base_model", "must be a non-empty string")
        return base_model

    def choices(self, table: Mapping[str, Any], allowed: Mapping[str, tuple[str, ...]]) -> dict[str, str]:
        """The keys of `allowed` that `table` sets, each one of its values."""
        chosen: dict[str, str] = {}
        for option, values in allowed.items():
            if option in table:
                value = table[option]
                if value not in values:
                    listed = ", ".join(repr(v) for v in values)
                    raise self.error(option, f"{value!r} is not one of {listed}")
                chosen[option] = value
        return chosen


def _table(value: Any, where: str, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigurationError(f"{where}: {key}: must be a table")
    return value


def _entry(name: str, table: dict[str, Any], place: EntryPlace, methods: EntryReaders) -> ModelEntry:
    """The entry of the method it names, or of the one that claims one of its keys, or the default's."""
    if "method" in table:
        method = methods.named(table["method"]) if isinstance(table["method"], str) else None
        if method is None:
            known = ", ".join(repr(n) for n in methods.methods)
            raise place.error("method", f"{table['method']!r} is not a method (methods: {known})")
    else:
        claimed = [m for k in table if (m := methods.claiming(k)) is not None]
        method = claimed[0] if claimed else methods.default
    return method.read_entry(name, table, place)
