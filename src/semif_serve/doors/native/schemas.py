"""The native door's wire shapes: request bodies of `/decide` and `/decide/shared` (validated
here), and the response and error bodies the published OpenAPI schema declares."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from semif_serve.domain.echo import NAME_CHARS, quoted
from semif_serve.domain.orderings import MAX_ALL_OPTIONS
from semif_serve.domain.prompt import LETTERS, NATIVE_ALPHABET_SIZE
from semif_serve.domain.types import Combined
from semif_serve.doors.base import TimingBody, fields_of
from semif_serve.http.errors import ServiceError, invalid
from semif_serve.http.json_body import INVALID_JSON, BodyError, decode_json_object, require_finite

MAX_OPTIONS = NATIVE_ALPHABET_SIZE
SYSTEM_ONE_PATH = "/v1/systemone"
SYSTEM_ONE_MAX_OPTIONS = 255


Body = TypeVar("Body", bound=BaseModel)
NativeOrdering = Literal["rotations", "all"]  # the native door's orderings (System One adds more)


def _has_text(value: str, what: str) -> str:
    if not value.strip():
        raise ValueError(f"{what} must be a non-empty string")
    return value


def _check_state(state: Any) -> Any:
    """A state is a non-empty string, object or array whose JSON is finite (no NaN/Infinity)."""
    if isinstance(state, float) and not math.isfinite(state):
        raise ValueError(f"state is {quoted(str(state))}; the state must serialise as finite JSON")
    if isinstance(state, str):
        _has_text(state, "state")
    elif isinstance(state, (dict, list)):
        if not state:
            raise ValueError("state must not be empty")
    else:
        raise ValueError("state must be a string, object or array")
    return require_finite(state, "state", "the state")


class OptionBody(BaseModel):
    """One answer option: its caller-side id and the description the model reads."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: str
    description: str

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        return _has_text(value, "option id")


class QuestionBody(BaseModel):
    """A question over a state: id, question, options, and optional orderings and workload."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: str
    question: str
    options: Annotated[list[OptionBody], Field(min_length=2, json_schema_extra={"maxItems": MAX_OPTIONS})]
    orderings: NativeOrdering | None = None
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
    def _options(cls, options: list[OptionBody]) -> list[OptionBody]:
        if len(options) > MAX_OPTIONS:
            raise ValueError(
                f"a decision has at most {MAX_OPTIONS} options, one per answer letter "
                f"{LETTERS[0]}..{LETTERS[-1]} (this one has {len(options)}); for up to "
                f"{SYSTEM_ONE_MAX_OPTIONS} options use System One at {SYSTEM_ONE_PATH}"
            )
        _require_unique([o.id for o in options], "option ids")
        return options

    @field_validator("orderings")
    @classmethod
    def _orderings(cls, value: NativeOrdering | None, info: ValidationInfo) -> NativeOrdering | None:
        options = info.data.get("options") or []
        if value == "all" and len(options) > MAX_ALL_OPTIONS:
            raise ValueError(
                f'orderings "all" is allowed for at most {MAX_ALL_OPTIONS} options '
                f'(this decision has {len(options)}); use "rotations"'
            )
        return value


class DecisionBody(QuestionBody):
    """`POST /decide`: one decision in SemIf's row shape (extra fields are ignored); `model`
    names the served model that reads it (a SEMIF_MODELS name or alias; absent: the model its
    workload names, else the base)."""

    state: Any
    model: str | None = None

    @field_validator("state", mode="before")
    @classmethod
    def _state(cls, value: Any) -> Any:
        return _check_state(value)


class SharedDecisionsBody(BaseModel):
    """`POST /decide/shared`: many questions over one exact state, read by one `model` (as
    `/decide`'s)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    state: Any
    model: str | None = None
    decisions: Annotated[list[QuestionBody], Field(min_length=1)]

    @field_validator("state", mode="before")
    @classmethod
    def _state(cls, value: Any) -> Any:
        return _check_state(value)

    @field_validator("decisions")
    @classmethod
    def _unique_ids(cls, decisions: list[QuestionBody]) -> list[QuestionBody]:
        _require_unique([d.id for d in decisions], "decision ids")
        return decisions


# Far past any model's logits, and small enough that z / T stays finite at the search's least T.
MAX_CALIBRATE_LOGIT = 1e6


class CalibrateRow(BaseModel):
    """One labelled read: the option logits of a question's single read and the index of the right option."""

    model_config = ConfigDict(extra="ignore", strict=True)
    logits: Annotated[list[float], Field(min_length=2)]
    label: int
    group: str | int

    @field_validator("logits")
    @classmethod
    def _finite(cls, logits: list[float]) -> list[float]:
        if not all(math.isfinite(z) and abs(z) <= MAX_CALIBRATE_LOGIT for z in logits):
            raise ValueError(f"logits must be finite numbers within +-{MAX_CALIBRATE_LOGIT:g}")
        return logits

    @field_validator("label")
    @classmethod
    def _label(cls, label: int, info: ValidationInfo) -> int:
        options = len(info.data.get("logits") or [])
        if options and not 0 <= label < options:
            raise ValueError(f"label must index logits (0..{options - 1}), got {label}")
        return label


class CalibrateBody(BaseModel):
    """`POST /calibrate`: labelled reads of one workload, fitted as `semif-serve calibrate` fits them."""

    model_config = ConfigDict(extra="ignore", strict=True)
    workload: Annotated[str, Field(max_length=NAME_CHARS)]
    rows: Annotated[list[CalibrateRow], Field(min_length=1)]

    @field_validator("workload")
    @classmethod
    def _workload(cls, value: str) -> str:
        return _has_text(value, "workload")


def _require_unique(ids: list[str], what: str) -> None:
    seen: set[str] = set()
    for item in ids:
        if item in seen:
            raise ValueError(f"{what} must be unique; {quoted(item)} appears more than once")
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


def parse_body(model: type[Body], body: bytes) -> Body:
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


# -- responses (the routes build their replies as these models) ----------------------------------


class ModelInfo(BaseModel):
    """The model a result was read from."""

    model_config = ConfigDict(extra="allow")
    source: str
    revision: str
    dtype: str
    device: str
    torch_version: str
    transformers_version: str
    demo: str | None = None
    serving_config: str | None = None


class NativeResult(BaseModel):
    """SemIf's result dict for one ordering, keys in upstream's order."""

    id: str
    option_ids: list[str]
    probabilities: list[float]
    option_logits: list[float]
    input_tokens: int
    forward_seconds: float
    total_seconds: float
    prompt_sha256: str
    prompt_version: str
    model: ModelInfo
    readout: str
    probability_status: str


class CalibratedBody(BaseModel):
    """Probabilities at a workload's temperature: a list (single read) or by option id (combined)."""

    workload: str
    temperature: float
    temperature_mode: str
    probabilities: list[float] | dict[str, float]


class CombinedBody(BaseModel):
    """The answer combined over orderings; read `top` and `probabilities` for anything real."""

    # The method, then every field of the domain's Combined (declared there once), each required.
    __annotations__ = {"method": "str", **fields_of(Combined)}
    calibrated: CalibratedBody | None = None


class DecisionResult(NativeResult):
    """One decision's reply: the caller's order, plus orderings/combined/calibrated/timing when asked."""

    orderings: list[NativeResult] | None = None
    combined: CombinedBody | None = None
    calibrated: CalibratedBody | None = None
    timing: TimingBody | None = None


class SharedResponse(BaseModel):
    """`POST /decide/shared`: one result per decision in request order, and the batch's timing."""

    results: list[DecisionResult]
    timing: TimingBody


class BinBody(BaseModel):
    """One reliability bin: [lower, upper), its rows, their mean confidence and accuracy."""

    lower: float
    upper: float
    count: int
    confidence: float
    accuracy: float


class FoldBody(BaseModel):
    """One held-out fold: its rows and the T fitted without them."""

    fold: int
    n: int
    temperature: float


class CalibrationReport(BaseModel):
    """`POST /calibrate`: the fit `semif-serve calibrate --json` reports, the bins before and after,
    and the calibration.json entry."""

    workload: str
    n: int
    groups: int
    accuracy: float
    nll_before: float
    brier_before: float
    ece_before: float
    nll_after: float
    brier_after: float
    ece_after: float
    ece_out_of_fold: float | None
    temperature: float
    folds: list[FoldBody]
    warnings: list[str]
    bins_before: list[BinBody]
    bins_after: list[BinBody]
    entry: dict[str, float]
