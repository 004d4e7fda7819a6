"""Request bodies of `/decide` and `/decide/shared`, and how a body becomes one (or a 4xx)."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from .errors import ServiceError, invalid
from .json_body import INVALID_JSON, BodyError, decode_json_object
from .prompt import MAX_OPTIONS

Ordering = Literal["rotations", "all"]
MAX_ALL_OPTIONS = 4  # every permutation of 5 options would be 120 rows


def _has_text(value: str, what: str) -> str:
    if not value.strip():
        raise ValueError(f"{what} must be a non-empty string")
    return value


def _check_state(state: Any) -> Any:
    """A state is a non-empty string, object or array whose JSON is finite (no NaN/Infinity)."""
    if isinstance(state, float) and not math.isfinite(state):
        raise ValueError(f"state is {state!r}; the state must serialise as finite JSON")
    if isinstance(state, str):
        _has_text(state, "state")
    elif isinstance(state, (dict, list)):
        if not state:
            raise ValueError("state must not be empty")
    else:
        raise ValueError("state must be a string, object or array")
    _check_finite(state, "state")
    return state


def _check_finite(value: Any, path: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{path} holds {value!r}; the state must serialise as finite JSON")
    if isinstance(value, dict):
        for key, item in value.items():
            _check_finite(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_finite(item, f"{path}[{i}]")


class Option(BaseModel):
    """One answer option: its caller-side id and the description the model reads."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: str
    description: str

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        return _has_text(value, "option id")


class Question(BaseModel):
    """A question over a state: id, question, options, and optional orderings and workload."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: str
    question: str
    options: Annotated[list[Option], Field(min_length=2, max_length=MAX_OPTIONS)]
    orderings: Ordering | None = None
    workload: str | None = None

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        return _has_text(value, "id")

    @field_validator("question")
    @classmethod
    def _question(cls, value: str) -> str:
        return _has_text(value, "question")

    @field_validator("options")
    @classmethod
    def _unique_options(cls, options: list[Option]) -> list[Option]:
        _require_unique([o.id for o in options], "option ids")
        return options

    @field_validator("orderings")
    @classmethod
    def _orderings(cls, value: Ordering | None, info: ValidationInfo) -> Ordering | None:
        options = info.data.get("options") or []
        if value == "all" and len(options) > MAX_ALL_OPTIONS:
            raise ValueError(
                f'orderings "all" is allowed for at most {MAX_ALL_OPTIONS} options '
                f'(this decision has {len(options)}); use "rotations"'
            )
        return value


class Decision(Question):
    """`POST /decide`: one decision in SemIf's row shape (extra fields are ignored)."""

    state: Any

    @field_validator("state", mode="before")
    @classmethod
    def _state(cls, value: Any) -> Any:
        return _check_state(value)


class SharedDecisions(BaseModel):
    """`POST /decide/shared`: many questions over one exact state."""

    model_config = ConfigDict(extra="ignore", strict=True)
    state: Any
    decisions: Annotated[list[Question], Field(min_length=1)]

    @field_validator("state", mode="before")
    @classmethod
    def _state(cls, value: Any) -> Any:
        return _check_state(value)

    @field_validator("decisions")
    @classmethod
    def _unique_ids(cls, decisions: list[Question]) -> list[Question]:
        _require_unique([d.id for d in decisions], "decision ids")
        return decisions


def _require_unique(ids: list[str], what: str) -> None:
    seen: set[str] = set()
    for item in ids:
        if item in seen:
            raise ValueError(f"{what} must be unique; {item!r} appears more than once")
        seen.add(item)


def field_path(loc: tuple[Any, ...]) -> str | None:
    """`("decisions", 2, "options", 0, "id")` -> `decisions[2].options[0].id`."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part:
            path += f".{part}" if path else str(part)
    return path or None


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    """Decode a JSON body into `model`, or raise the 400/422 that names the field and the rule."""
    try:
        data = decode_json_object(body)
    except BodyError as exc:
        if exc.code == INVALID_JSON:
            raise ServiceError(400, "invalid_json", exc.message, exc.field) from None
        raise invalid(exc.field, exc.message) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_input=False, include_url=False, include_context=False)
        first = errors[0]
        message = first["msg"].removeprefix("Value error, ")
        raise invalid(field_path(first["loc"]), message) from None
