"""The `SEMIF_*` environment template, generated from `Settings.model_fields`.

`render_env_template()` is what `semif-serve env-template` prints and what
`conf/semif.env.example` holds (a test keeps the two equal). Every settings field becomes one
commented block: its description, type, constraints and default, then the assignment. The
assignment is live only for the values a container deployment sets (DEPLOYMENT_VALUES); every
other one is commented out at its default. Secrets never get a value.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic import SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from semif_serve.service.settings import Settings, env_name

REGENERATE = (
    'uv run python -c "from semif_serve.tools.env_template import render_env_template; '
    "print(render_env_template(), end='')\" > conf/semif.env.example"
)

# The values a container deployment sets (the image, the compose stacks under stacks/).
# Never a secret: the token travels as a file (a compose secret), never as a value here.
DEPLOYMENT_VALUES: dict[str, str] = {
    "model_path": "/models/qwen3.5-4b/snapshots/851bf6e806efd8d0a36b00ddf55e13ccb7b8cd0a",
    "model_revision": "851bf6e806efd8d0a36b00ddf55e13ccb7b8cd0a",
    "host": "0.0.0.0",
    "api_token_file": "/run/secrets/semif_api_token",
    "calibration": "/etc/semif/calibration.json",
}

HEADER = """\
# semif-serve configuration: every SEMIF_* environment variable.
#
# Generated from semif_serve.service.settings.Settings; do not edit by hand. Regenerate with
#   semif-serve env-template > conf/semif.env.example
# Usable as a compose `env_file:`, `docker run --env-file` or a systemd EnvironmentFile.
# Write values unquoted (docker --env-file keeps quotes as part of the value).
#
# Live lines are what a container deployment sets; a commented line shows the default.
# Secrets never get a value here: give the token as a file (SEMIF_API_TOKEN_FILE).
"""


def _is_secret(annotation: Any) -> bool:
    """Whether a field's type is (or contains) a SecretStr."""
    if annotation is SecretStr:
        return True
    return any(_is_secret(arg) for arg in typing.get_args(annotation))


def _describe_type(annotation: Any) -> str:
    """A short human name for a field's type, without the Optional."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return " or ".join(_describe_type(arg) for arg in args)
    if origin is dict:
        return "string"  # a map written as `key=value,...`, parsed once by the settings
    if origin is Literal:
        return "one of " + ", ".join(str(arg) for arg in typing.get_args(annotation))
    names = {bool: "true or false", int: "integer", float: "number", str: "string"}
    if annotation in names:
        return names[annotation]
    if isinstance(annotation, type) and issubclass(annotation, Path):
        return "path"
    if annotation is SecretStr:
        return "secret string"
    return getattr(annotation, "__name__", str(annotation))


def _constraints(info: FieldInfo) -> list[str]:
    """The numeric bounds declared on a field, e.g. ['>= 1']."""
    symbols = [
        (annotated_types.Ge, "ge", ">="),
        (annotated_types.Gt, "gt", ">"),
        (annotated_types.Le, "le", "<="),
        (annotated_types.Lt, "lt", "<"),
    ]
    found = []
    for meta in info.metadata:
        for kind, attr, symbol in symbols:
            if isinstance(meta, kind):
                found.append(f"{symbol} {getattr(meta, attr)}")
    return found


def _format_value(value: Any) -> str:
    """A default as it is written in an env file ('' for unset)."""
    if value is None or value is PydanticUndefined:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, SecretStr):
        return ""
    return str(value)


def _block(name: str, info: FieldInfo) -> list[str]:
    var = env_name(name)
    secret = _is_secret(info.annotation)
    default = "" if info.is_required() else _format_value(info.default)
    lines = [f"# {info.description or name.replace('_', ' ')}"]
    details = [f"Type: {_describe_type(info.annotation)}"]
    bounds = _constraints(info)
    if bounds:
        details.append("Must be " + " and ".join(bounds))
    if info.is_required():
        details.append("Required")
    else:
        details.append(f"Default: {default}" if default else "Default: unset")
    lines.append("# " + ". ".join(details) + ".")
    if secret:
        lines.append("# Secret: never written here; set it in the environment, or use a file.")
        lines.append(f"# {var}=")
    elif name in DEPLOYMENT_VALUES:
        lines.append(f"{var}={DEPLOYMENT_VALUES[name]}")
    else:
        lines.append(f"# {var}={default}")
    return lines


def render_env_template() -> str:
    """The commented `SEMIF_*` env file for the current Settings (ends with a newline)."""
    unknown = sorted(set(DEPLOYMENT_VALUES) - set(Settings.model_fields))
    if unknown:
        raise RuntimeError(f"DEPLOYMENT_VALUES names unknown settings: {', '.join(unknown)}")
    blocks = [HEADER.rstrip("\n")]
    for name, info in Settings.model_fields.items():
        blocks.append("\n".join(_block(name, info)))
    return "\n\n".join(blocks) + "\n"
