"""System One's wire shapes: the `POST /v1/systemone` request (validated here, into FastAPI's 422
`detail[]` shape), the operator's per-type orderings and workload maps, and the response models
the published schema declares."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from semif_serve.domain.boxes import POSITIONS
from semif_serve.domain.echo import bounded_message, clipped, quoted
from semif_serve.domain.orderings import ALLOWED_ORDERINGS, MAX_ALL_OPTIONS, OrderingName
from semif_serve.doors.base import TimingBody
from semif_serve.http.errors import ServiceError
from semif_serve.http.json_body import INVALID_JSON, BodyError, decode_json_object, require_finite
from semif_serve.service.methods.lev import LevBlock
from semif_serve.service.methods.semif import BoxCoordinates, BoxEdge, SemIfBlock

SYSTEMONE_PATH = "/v1/systemone"
MODELS_PATH = "/v1/models"
MAX_OPTIONS = 255  # System One's own cap; the loaded tokenizer's answer codes may cap lower
MIN_OPTIONS = 2
MAX_LEVELS = 10
# Text is a string, or structured data (rendered as JSON text, insertion order kept).
Text = str | dict[str, Any] | list[Any]


# A 422 echoes the request's keys: bounded so that a small body never buys a large error reply.
MAX_REPORTED_ERRORS = 32


def bounded_detail(detail: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first MAX_REPORTED_ERRORS items, every loc part and message clipped, then one item
    counting the rest."""
    kept = [
        {
            "loc": [clipped(part) for part in item["loc"]],
            "msg": bounded_message(item["msg"]),
            "type": item["type"],
        }
        for item in detail[:MAX_REPORTED_ERRORS]
    ]
    if len(detail) > MAX_REPORTED_ERRORS:
        more = len(detail) - MAX_REPORTED_ERRORS
        kept.append({"loc": ["body"], "msg": f"and {more} more errors, not listed", "type": "value_error"})
    return kept


class SystemOneValidationError(ServiceError):
    """A request that breaks a rule: 422 with FastAPI's `detail[]` ({loc, msg, type} each),
    bounded (`bounded_detail`)."""

    def __init__(self, detail: list[dict[str, Any]]) -> None:
        bounded = bounded_detail(detail)
        super().__init__(422, "validation_error", bounded[0]["msg"] if bounded else "invalid request")
        self.detail = bounded


def _check_ordering(kind: str, value: str | None, options: int) -> None:
    if value is None:
        return
    if value not in ALLOWED_ORDERINGS[kind]:
        allowed = ", ".join(ALLOWED_ORDERINGS[kind])
        raise ValueError(
            f"x_orderings {quoted(value)} is not allowed for a {kind} question (allowed: {allowed})"
        )
    if value == "all" and options > MAX_ALL_OPTIONS:
        raise ValueError(f'x_orderings "all" is allowed for at most {MAX_ALL_OPTIONS} options, not {options}')


class _Question(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    instructions: Text | None = None
    x_orderings: OrderingName | None = None
    x_workload: str | None = None

    @field_validator("instructions")
    @classmethod
    def _finite(cls, value: Text | None, info: ValidationInfo) -> Text | None:
        return require_finite(value, info.field_name or "text", "text")


class NoulCriteria(BaseModel):
    """What counts as true and as false; either side may be absent or null."""

    model_config = ConfigDict(extra="forbid", strict=True)
    true: Text | None = None
    false: Text | None = None

    @field_validator("true", "false")
    @classmethod
    def _finite(cls, value: Text | None, info: ValidationInfo) -> Text | None:
        return require_finite(value, info.field_name or "text", "text")


class NoulQuestion(_Question):
    """A yes/no question: answered with P(true)."""

    type: Literal["noul"]
    criteria: NoulCriteria | None = None

    @model_validator(mode="after")
    def _orderings(self) -> NoulQuestion:
        _check_ordering("noul", self.x_orderings, 2)
        return self


class ChoiceQuestion(_Question):
    """One of named options (JSON order); a null description means the name says it all."""

    type: Literal["choice"]
    criteria: dict[str, Text | None]

    @field_validator("criteria")
    @classmethod
    def _options(cls, criteria: dict[str, Text | None], info: ValidationInfo) -> dict[str, Text | None]:
        limit = (info.context or {}).get("max_options", MAX_OPTIONS)
        if not MIN_OPTIONS <= len(criteria) <= limit:
            why = "" if limit == MAX_OPTIONS else " (the answer codes of the loaded tokenizer)"
            raise ValueError(f"a choice has {MIN_OPTIONS} to {limit} options{why}, not {len(criteria)}")
        return require_finite(criteria, "criteria", "text")

    @model_validator(mode="after")
    def _orderings(self) -> ChoiceQuestion:
        _check_ordering("choice", self.x_orderings, len(self.criteria))
        return self


class ScoreQuestion(_Question):
    """Ordered levels, low to high, as an array (the map form is refused)."""

    type: Literal["score"]
    criteria: list[Text]

    @field_validator("criteria", mode="before")
    @classmethod
    def _array_form(cls, value: Any) -> Any:
        if isinstance(value, dict):
            raise ValueError(
                "score criteria must be an array of levels, low to high; the map form is refused"
            )
        return value

    @field_validator("criteria")
    @classmethod
    def _levels(cls, levels: list[Text]) -> list[Text]:
        if not MIN_OPTIONS <= len(levels) <= MAX_LEVELS:
            raise ValueError(f"a score has {MIN_OPTIONS} to {MAX_LEVELS} levels, not {len(levels)}")
        return require_finite(levels, "criteria", "text")

    @model_validator(mode="after")
    def _orderings(self) -> ScoreQuestion:
        _check_ordering("score", self.x_orderings, len(self.criteria))
        return self


class BoxQuestion(_Question):
    """Where something is in the request's image: a box of fractions of its height and width,
    asked as four edge questions of `POSITIONS` positions each (domain/boxes.py)."""

    type: Literal["box"]

    @model_validator(mode="after")
    def _orderings(self) -> BoxQuestion:
        _check_ordering("box", self.x_orderings, POSITIONS)
        return self


SystemOneQuestion = Annotated[
    NoulQuestion | ChoiceQuestion | ScoreQuestion | BoxQuestion, Field(discriminator="type")
]


class AssetEntry(BaseModel):
    """One asset of `assets`: an image as base64 (with its `format`), or as a multipart `part`
    (with `part`, `data_base64` is ignored and the format is read from the bytes)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["image"] = "image"
    format: Literal["png", "jpg", "jpeg"] | None = None
    data_base64: str | None = None
    part: str | None = None

    @model_validator(mode="after")
    def _source(self) -> AssetEntry:
        if self.part is None and self.data_base64 is None:
            raise ValueError("an image asset needs `data_base64` (with `format`) or a multipart `part`")
        if self.part is None and self.format is None:
            raise ValueError("`format` (png, jpg or jpeg) is required with `data_base64`")
        return self


class SystemOneRequest(BaseModel):
    """`POST /v1/systemone`: a model, a state, and questions by id (unknown fields are ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    state: Text
    questions: Annotated[dict[str, SystemOneQuestion], Field(min_length=1)]
    assets: Annotated[dict[str, AssetEntry], Field(min_length=1)] | None = None

    @field_validator("assets")
    @classmethod
    def _placeholders(cls, assets: dict[str, AssetEntry] | None) -> dict[str, AssetEntry] | None:
        if assets is not None and "" in assets:
            raise ValueError("an asset placeholder must be a non-empty string")
        return assets

    @field_validator("state")
    @classmethod
    def _finite(cls, value: Text, info: ValidationInfo) -> Text:
        return require_finite(value, info.field_name or "text", "text")

    @field_validator("questions")
    @classmethod
    def _ids(cls, questions: dict[str, Any]) -> dict[str, Any]:
        if "" in questions:
            raise ValueError("a question id must be a non-empty string")
        return questions


def parse_request(
    body: bytes, max_options: int, screen: Callable[[dict[str, Any]], None] | None = None
) -> SystemOneRequest:
    """Decode and validate a JSON body (or a multipart body's `request` part), or raise
    SystemOneValidationError in FastAPI's 422 shape; `screen` sees the decoded object first (a
    cheap refusal before the costly validation)."""
    try:
        data = decode_json_object(body)
    except BodyError as exc:
        kind = "json_invalid" if exc.code == INVALID_JSON else "value_error"
        where = f" (at {exc.field})" if exc.field else ""
        raise SystemOneValidationError(
            [{"loc": ["body"], "msg": exc.message + where, "type": kind}]
        ) from None
    if screen is not None:
        screen(data)
    try:
        return SystemOneRequest.model_validate(data, context={"max_options": max_options})
    except ValidationError as exc:
        errors = exc.errors(include_input=False, include_url=False, include_context=False)
        detail = [{"loc": ["body", *e["loc"]], "msg": e["msg"], "type": e["type"]} for e in errors]
        raise SystemOneValidationError(detail) from None


# -- responses (declared for the published schema) ----------------------------------------------


# An answer's fields are its type's; a method's block follows (`x_semif`, `x_lev`, or a plug-in
# method's own `x_<name>`: the models take extra fields). Fields a method leaves out are not sent.
ANSWER_CONFIG = ConfigDict(extra="allow")


class NoulAnswer(BaseModel):
    """P(true); a lev model adds `probabilities` over its nine rating levels ("0".."8"; null for
    a binary noul) and lev's `confidence` (its normalised Gini), as lev's server sends them."""

    model_config = ANSWER_CONFIG
    type: Literal["noul"]
    noul: float
    probabilities: dict[str, float] | None = None
    confidence: float | None = None
    x_semif: SemIfBlock | None = None
    x_lev: LevBlock | None = None


class ChoiceAnswer(BaseModel):
    """The most probable option, every option's probability (keys = names) and the confidence."""

    model_config = ANSWER_CONFIG
    type: Literal["choice"]
    choice: str
    probabilities: dict[str, float]
    confidence: float
    x_semif: SemIfBlock | None = None
    x_lev: LevBlock | None = None


class ScoreAnswer(BaseModel):
    """The expected level sum(i * p_i), the legend, each level's probability and the confidence."""

    model_config = ANSWER_CONFIG
    type: Literal["score"]
    score: float
    legend: dict[str, str]
    probabilities: dict[str, float]
    confidence: float
    x_semif: SemIfBlock | None = None
    x_lev: LevBlock | None = None


class BoxAnswer(BaseModel):
    """The box, its confidence (the least sure edge's), and each edge's reading."""

    model_config = ANSWER_CONFIG
    type: Literal["box"]
    box: BoxCoordinates
    confidence: float | None
    x_edges: dict[str, BoxEdge]


class Usage(BaseModel):
    """Tokens evaluated (the shared state once); no token is generated."""

    input_tokens: int
    output_tokens: int
    cached_input_tokens: int | None = Field(
        default=None,
        description="lev models only, as lev reports it: the prefix's tokens, read once for every row.",
    )


class BatchTimingBlock(TimingBody):
    """`x_timing`: how the request's batch ran, and its forward and end-to-end seconds."""

    forward_seconds: float
    total_seconds: float


SystemOneAnswer = NoulAnswer | ChoiceAnswer | ScoreAnswer | BoxAnswer
# The one wire shape of each type's answer, whatever method read it.
ANSWERS: dict[str, type[NoulAnswer | ChoiceAnswer | ScoreAnswer | BoxAnswer]] = {
    "noul": NoulAnswer,
    "choice": ChoiceAnswer,
    "score": ScoreAnswer,
    "box": BoxAnswer,
}


class SystemOneResponse(BaseModel):
    """The model that answered (its real identity), one answer per question id, usage, and timing."""

    model: str
    answers: dict[str, SystemOneAnswer]
    usage: Usage
    x_timing: BatchTimingBlock


class AdapterInfo(BaseModel):
    """The LoRA adapter a served model reads over the base: its directory's name, its rank, how
    many of the base's layers it adapts, and the factor on its B(A(x)) (PEFT's alpha / r times
    the serving `scale`)."""

    name: str
    rank: int
    modules: int
    factor: float


class ModelListing(BaseModel):
    """One model name a request may use: the base (with its `x_` limits), a model over it (its
    method, adapter, serving scale and the calibration workloads fitted on it), or an alias."""

    name: str
    description: str
    release_date: str
    x_source: str | None = None
    x_revision: str | None = None
    x_max_options: int | None = None
    x_answer_codes: int | None = None
    x_max_input_tokens: int | None = None
    x_reads_images: bool | None = None
    x_max_images: int | None = None
    x_max_image_pixels: int | None = None
    x_max_image_bytes: int | None = None
    x_method: str | None = None
    x_adapter: AdapterInfo | None = None
    x_scale: float | None = None
    x_calibration: list[str] | None = None
    x_alias_of: str | None = None


class ModelList(BaseModel):
    """`GET /v1/models`."""

    models: list[ModelListing]


class TypeSafeErrorDetail(BaseModel):
    """A non-validation error: a stable type and the rule."""

    error_type: str
    message: str


class TypeSafeError(BaseModel):
    """Every non-validation error on System One's routes."""

    detail: TypeSafeErrorDetail


class ValidationItem(BaseModel):
    """One broken rule: where (`["body", ...]`), what, and its type."""

    loc: list[str | int]
    msg: str
    type: str


class TypeSafeValidationError(BaseModel):
    """422: FastAPI's own shape."""

    detail: list[ValidationItem]
