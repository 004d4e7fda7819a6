"""The System One door: `POST /v1/systemone` and `GET /v1/models`, TypeSafe's wire format.

Map each typed question (noul, choice, score; a box as its four edge questions) onto the
decision core's options, ask every question of a request (in every ordering) as one shared
batch, and map the outcome back to System One answers, or a domain error through
`SYSTEMONE_ERRORS`, the one table of this door. Every error on these paths, whoever raises it
(admission, routing, the door), is rendered by `SystemOneDoor.render` in TypeSafe's shapes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request, Security
from fastapi.responses import JSONResponse, Response

from semif_serve import __version__
from semif_serve.domain import types as domain
from semif_serve.domain.boxes import DEFAULT_TARGET, EDGES, POSITIONS, edge_questions, read_box
from semif_serve.domain.images import VerifiedImages
from semif_serve.domain.numerics import argmax
from semif_serve.domain.orderings import (
    ANSWER_TYPES,
    CORE_ORDERINGS,
    MAX_ALL_OPTIONS,
    NO_ORDERINGS,
    order_count,
)
from semif_serve.domain.prompt import PROMPT_VERSION
from semif_serve.domain.types import DecisionError, DecisionOutcome, Option, Question, QuestionOutcome
from semif_serve.doors.base import (
    BEARER,
    DecisionDoor,
    ErrorRule,
    Limits,
    error_responses,
    json_reply,
    rule_for,
)
from semif_serve.doors.reply_size import (
    FLOAT_BYTES,
    INT_BYTES,
    NULL_BYTES,
    PREFILL_BYTES,
    SHA256_BYTES,
    array_bytes,
    map_bytes,
    object_bytes,
    scalars_bytes,
    text_bytes,
)
from semif_serve.doors.systemone.assets import ImageLimits, place_images, resolve_images
from semif_serve.doors.systemone.multipart import (
    MultipartRefused,
    TooManyParts,
    is_multipart,
    parse_multipart,
)
from semif_serve.doors.systemone.schemas import (
    MAX_OPTIONS,
    MODELS_PATH,
    SYSTEMONE_PATH,
    BatchTimingBlock,
    BoxAnswer,
    BoxCoordinates,
    BoxEdge,
    BoxQuestion,
    ChoiceAnswer,
    ChoiceQuestion,
    ModelEntry,
    ModelList,
    NoulAnswer,
    NoulQuestion,
    Reading,
    ScoreAnswer,
    ScoreQuestion,
    SemIfBlock,
    SystemOneRequest,
    SystemOneResponse,
    SystemOneValidationError,
    TypeSafeError,
    TypeSafeValidationError,
    Usage,
    parse_request,
)
from semif_serve.http.errors import ServiceError
from semif_serve.http.headers import headers_of
from semif_serve.service.startup import Service

# The names a Jev client sends; the loaded model answers them when SEMIF_SYSTEMONE_ALLOW_ALIASES.
ALIASES = ("jev-latest", "jev-preview")
# The wording a question gets where the request leaves it out (fixed: answers stay reproducible).
DEFAULT_INSTRUCTIONS = {
    "noul": "Is the statement this question is about true of the evidence?",
    "choice": "Which option best fits the evidence?",
    "score": "Which level best fits the evidence?",
}
DEFAULT_NOUL_CRITERIA = {"true": "Yes, it is true.", "false": "No, it is false."}
NOUL_OPTIONS = ("true", "false")  # `true` in slot A


# -- errors ---------------------------------------------------------------------------------------


SYSTEMONE_ERRORS: dict[type[DecisionError], ErrorRule] = {
    domain.TooManyOptions: ErrorRule(
        400, "api_usage_error", when="more options than the loaded tokenizer's answer codes"
    ),
    domain.TooManyRows: ErrorRule(
        413, "request_too_large", when="questions × orderings over SEMIF_SYSTEMONE_MAX_ROWS"
    ),
    domain.TooManyTokens: ErrorRule(
        413,
        "request_too_large",
        when="a prompt over SEMIF_SYSTEMONE_MAX_INPUT_TOKENS; the message gives the need",
    ),
    domain.TooLargeForMemory: ErrorRule(
        413, "request_too_large", when="one row alone needs more memory than the cap leaves"
    ),
    domain.ImageTooLargeForMemory: ErrorRule(
        413, "request_too_large", when="an image needs more memory in the vision tower than the cap leaves"
    ),
    domain.UnknownWorkload: ErrorRule(
        400, "api_usage_error", when="`x_workload` is not in the calibration file"
    ),
    domain.AnswerBoundary: ErrorRule(
        400, "api_usage_error", when="appending an answer code would change this prompt's tokenisation"
    ),
    domain.ReplyTooLarge: ErrorRule(
        413,
        "request_too_large",
        when="the reply, counted before any engine work, is over SEMIF_MAX_REPLY_BYTES; gives the need",
    ),
    domain.OutOfMemory: ErrorRule(
        503,
        "overloaded_error",
        headers={"Retry-After": "1"},
        when="the forward ran out of device memory; released",
    ),
    domain.EngineFailure: ErrorRule(500, "internal_error", when="an unexpected engine failure"),
}

# Errors raised outside the core (admission, routing, the door) by native code -> TypeSafe type.
HTTP_ERROR_TYPES = {
    "unauthorized": "authentication_error",
    "not_found": "not_found",
    "method_not_allowed": "method_not_allowed",
    "invalid_content_length": "api_usage_error",
    "duplicate_header": "api_usage_error",
    "invalid_compressed_body": "api_usage_error",
    "unsupported_content_encoding": "api_usage_error",
    "body_too_large": "request_too_large",
    "body_timeout": "timeout_error",
    "header_timeout": "timeout_error",
    "busy": "rate_limit_error",
    "draining": "overloaded_error",
    "internal_error": "internal_error",
}
# The door's own refusals, outside the core.
UNKNOWN_MODEL = ErrorRule(400, "api_usage_error", when="`model` is neither the loaded model nor an alias")
# A checkpoint without a vision tower reads no image, so none is accepted.
NO_VISION = ErrorRule(
    400, "api_usage_error", when="a request with images, and the loaded model does not read them"
)


def systemone_body(error: ServiceError) -> tuple[int, dict[str, Any]]:
    """The status and TypeSafe body of any error on System One's paths."""
    if isinstance(error, SystemOneValidationError):
        return 422, {"detail": error.detail}
    if error.code in ("invalid_json", "validation_error"):
        kind = "json_invalid" if error.code == "invalid_json" else "value_error"
        return 422, {"detail": [{"loc": ["body"], "msg": error.message, "type": kind}]}
    error_type = HTTP_ERROR_TYPES.get(error.code, error.code)
    return error.status, {"detail": {"error_type": error_type, "message": error.message}}


# -- mapping questions onto the core --------------------------------------------------------------


def as_text(value: Any) -> str:
    """Text as the model reads it: a string as is, structured data as JSON (insertion order kept)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class Policy:
    """The operator's defaults per answer type: orderings, and the calibration workload."""

    orderings: dict[str, str]
    workloads: dict[str, str]


def to_question(
    question_id: str, body: NoulQuestion | ChoiceQuestion | ScoreQuestion, policy: Policy
) -> Question:
    """One System One question as the core's domain question (option ids = names / "true" / "0")."""
    kind = body.type
    text = DEFAULT_INSTRUCTIONS[kind] if body.instructions is None else as_text(body.instructions)
    options: tuple[Option, ...]
    if isinstance(body, NoulQuestion):
        given = body.criteria.model_dump() if body.criteria is not None else {}
        options = tuple(
            Option(side, DEFAULT_NOUL_CRITERIA[side] if given.get(side) is None else as_text(given[side]))
            for side in NOUL_OPTIONS
        )
    elif isinstance(body, ChoiceQuestion):
        options = tuple(
            Option(name, name if description is None else as_text(description))
            for name, description in body.criteria.items()
        )
    else:
        options = tuple(Option(str(i), as_text(level)) for i, level in enumerate(body.criteria))
    mode = body.x_orderings or policy.orderings[kind]
    return Question(
        id=question_id,
        text=text,
        options=options,
        orderings=CORE_ORDERINGS[mode],
        workload=body.x_workload or policy.workloads.get(kind),
    )


def box_questions(question_id: str, body: BoxQuestion) -> tuple[Question, ...]:
    """A box question as its four edge questions (domain/boxes.py), in `EDGES` order: asked in
    the caller's `x_orderings` (`none` or `reversal`; no operator default), with its workload."""
    target = DEFAULT_TARGET if body.instructions is None else as_text(body.instructions)
    return edge_questions(
        question_id,
        target,
        orderings=CORE_ORDERINGS[body.x_orderings or NO_ORDERINGS],
        workload=body.x_workload,
    )


def core_questions(
    question_id: str, body: NoulQuestion | ChoiceQuestion | ScoreQuestion | BoxQuestion, policy: Policy
) -> tuple[Question, ...]:
    """The core's questions one System One question is asked as: four for a box, else one."""
    if isinstance(body, BoxQuestion):
        return box_questions(question_id, body)
    return (to_question(question_id, body, policy),)


def rows_asked(data: dict[str, Any], policy: Policy) -> int:
    """The rows a decoded (not yet validated) request asks for: each well-formed question's option
    count in its orderings (a box: its four edges'); what is malformed counts one row and is left
    to validation."""
    questions = data.get("questions")
    if not isinstance(questions, dict):
        return 0
    rows = 0
    for question in questions.values():
        kind = question.get("type") if isinstance(question, dict) else None
        if kind == "box":
            n, mode, asked = POSITIONS, question.get("x_orderings") or NO_ORDERINGS, len(EDGES)
        elif kind in ANSWER_TYPES:
            criteria = question.get("criteria")
            n = 2 if kind == "noul" else len(criteria) if isinstance(criteria, (dict, list)) else 0
            mode, asked = question.get("x_orderings") or policy.orderings[kind], 1
        else:
            rows += 1
            continue
        if not isinstance(mode, str) or mode not in CORE_ORDERINGS or n < 2:
            rows += 1
            continue
        if mode == "all" and n > MAX_ALL_OPTIONS:
            rows += 1
            continue
        rows += asked * order_count(n, CORE_ORDERINGS[mode])
    return rows


def final_probabilities(answer: QuestionOutcome) -> list[float]:
    """The probabilities an answer reports, in the caller's option order: calibrated if a
    workload applies, else combined over orderings, else the native readout."""
    if answer.calibrated is not None:
        return [float(p) for p in answer.calibrated.probabilities]
    if answer.combined is not None:
        return [float(answer.combined.probabilities[o.id]) for o in answer.question.options]
    return [float(p) for p in answer.readouts[0].probabilities]


def choice_confidence(probabilities: list[float]) -> float:
    """TypeSafe's reference: (m - 1/n) / (1 - 1/n), m the top probability."""
    n = len(probabilities)
    return min(1.0, max(0.0, (max(probabilities) - 1 / n) / (1 - 1 / n)))


def expected_score(probabilities: list[float]) -> float:
    """sum(i * p_i)."""
    return float(sum(i * p for i, p in enumerate(probabilities)))


def score_confidence(probabilities: list[float]) -> float:
    """TypeSafe's reference: max(0, 1 - sum_i p_i |i - k| / D), k the mode,
    D = (1/n) sum_i |i - (n-1)/2|."""
    n = len(probabilities)
    k = argmax(probabilities)
    spread = sum(abs(i - (n - 1) / 2) for i in range(n)) / n
    return min(1.0, max(0.0, 1 - sum(p * abs(i - k) for i, p in enumerate(probabilities)) / spread))


def box_confidence(marginals: Sequence[Sequence[float]]) -> float:
    """The least sure edge's: TypeSafe's score confidence of each edge's distribution after the
    pair rule (positions are evenly spaced levels), the smallest of the four."""
    return min(score_confidence(list(m)) for m in marginals)


def semif_block(answer: QuestionOutcome) -> SemIfBlock:
    """`x_semif`: the native readout of the caller's order, and how the answer was combined."""
    native = answer.readouts[0]
    combined = answer.combined
    calibrated = answer.calibrated
    return SemIfBlock(
        prompt_sha256=native.prompt_sha256,
        prompt_version=PROMPT_VERSION,
        input_tokens=native.input_tokens,
        option_logits=dict(zip(native.option_ids, native.option_logits, strict=True)),
        orderings=combined.mode if combined is not None else NO_ORDERINGS,
        rows=len(answer.readouts),
        agreement=combined.agreement if combined is not None else 1.0,
        workload=calibrated.workload if calibrated is not None else None,
        temperature=calibrated.temperature if calibrated is not None else None,
        readings=[
            Reading(
                order=list(r.option_ids),
                probabilities=dict(zip(r.option_ids, r.probabilities, strict=True)),
            )
            for r in answer.readouts
        ],
    )


def answer_body(kind: str, answer: QuestionOutcome) -> NoulAnswer | ChoiceAnswer | ScoreAnswer:
    """One System One answer from the core's outcome."""
    probabilities = final_probabilities(answer)
    names = [o.id for o in answer.question.options]
    if kind == "noul":
        return NoulAnswer(type="noul", noul=probabilities[0], x_semif=semif_block(answer))
    by_name = dict(zip(names, probabilities, strict=True))
    if kind == "choice":
        return ChoiceAnswer(
            type="choice",
            choice=names[argmax(probabilities)],
            probabilities=by_name,
            confidence=choice_confidence(probabilities),
            x_semif=semif_block(answer),
        )
    return ScoreAnswer(
        type="score",
        score=expected_score(probabilities),
        legend={o.id: o.description for o in answer.question.options},
        probabilities=by_name,
        confidence=score_confidence(probabilities),
        x_semif=semif_block(answer),
    )


def box_answer(edges: Sequence[QuestionOutcome]) -> BoxAnswer:
    """A box answer from its four edge questions' outcomes (in `EDGES` order): each edge's final
    probabilities read jointly with its side's other edge (the pair rule of domain/boxes.py)."""
    probabilities = [final_probabilities(edge) for edge in edges]
    reading = read_box(*probabilities)
    names = [o.id for o in edges[0].question.options]
    return BoxAnswer(
        type="box",
        box=BoxCoordinates(top=reading.top, bottom=reading.bottom, left=reading.left, right=reading.right),
        confidence=box_confidence([reading.marginals[edge] for edge in EDGES]),
        x_edges={
            edge: BoxEdge(
                probabilities=dict(zip(names, p, strict=True)),
                ordered=dict(zip(names, reading.marginals[edge], strict=True)),
                x_semif=semif_block(outcome),
            )
            for edge, p, outcome in zip(EDGES, probabilities, edges, strict=True)
        },
    )


def answers_of(
    bodies: dict[str, NoulQuestion | ChoiceQuestion | ScoreQuestion | BoxQuestion],
    asked: Sequence[tuple[Question, ...]],
    outcomes: Sequence[QuestionOutcome],
) -> dict[str, NoulAnswer | ChoiceAnswer | ScoreAnswer | BoxAnswer]:
    """Every System One answer by id from the core's outcomes, `asked[k]` being the core
    questions the k-th question was asked as (its outcomes follow in that order)."""
    answers: dict[str, NoulAnswer | ChoiceAnswer | ScoreAnswer | BoxAnswer] = {}
    start = 0
    for (qid, body), questions in zip(bodies.items(), asked, strict=True):
        own = outcomes[start : start + len(questions)]
        start += len(questions)
        answers[qid] = box_answer(own) if isinstance(body, BoxQuestion) else answer_body(body.type, own[0])
    return answers


def timing_block(outcome: DecisionOutcome) -> BatchTimingBlock:
    """`x_timing`: how the batch ran (prefill fresh, extended or cached; merging) and the engine's seconds."""
    timing = outcome.timing or outcome.lone_timing
    assert timing is not None  # the runner times every request: the shared batch, or the lone row
    return BatchTimingBlock(
        **timing.as_dict(),
        forward_seconds=outcome.forward_seconds,
        total_seconds=outcome.total_seconds,
    )


def evaluated_tokens(outcome: DecisionOutcome) -> int:
    """Tokens the engine evaluated: the shared prefix once, plus every row's own suffix."""
    if outcome.timing is None:
        return sum(r.input_tokens for q in outcome.questions for r in q.readouts)
    return outcome.timing.prefix_tokens + outcome.timing.true_suffix_tokens


# -- the reply's size, counted before it is built ---------------------------------------------------

TIMING_BYTES = scalars_bytes(BatchTimingBlock, {"prefill": PREFILL_BYTES})


def semif_bytes(question: Question) -> int:
    """At least the bytes of `semif_block` for `question`: each reading echoes every option name
    twice (its order, and its probabilities by name)."""
    n = len(question.options)
    names = sum(text_bytes(o.id) for o in question.options)
    by_name = map_bytes(names, n * FLOAT_BYTES, n)
    reading = object_bytes(Reading, {"order": array_bytes(names, n), "probabilities": by_name})
    readings = order_count(n, question.orderings)
    calibrated = question.workload is not None
    return object_bytes(
        SemIfBlock,
        {
            "prompt_sha256": SHA256_BYTES,
            "prompt_version": text_bytes(PROMPT_VERSION),
            "input_tokens": INT_BYTES,
            "option_logits": by_name,
            "orderings": text_bytes(question.orderings or NO_ORDERINGS),
            "rows": INT_BYTES,
            "agreement": FLOAT_BYTES,
            "workload": text_bytes(question.workload) if question.workload is not None else NULL_BYTES,
            "temperature": FLOAT_BYTES if calibrated else NULL_BYTES,
            "readings": array_bytes(readings * reading, readings),
        },
    )


def answer_bytes(kind: str, asked: tuple[Question, ...]) -> int:
    """At least the bytes of the answer to a System One question of `kind`, asked as `asked`."""
    first = asked[0]
    n = len(first.options)
    names = [text_bytes(o.id) for o in first.options]
    by_name = map_bytes(sum(names), n * FLOAT_BYTES, n)
    sizes = {"type": text_bytes(kind)}
    if kind == "box":
        edges = [
            object_bytes(BoxEdge, {"probabilities": by_name, "ordered": by_name, "x_semif": semif_bytes(q)})
            for q in asked
        ]
        return object_bytes(
            BoxAnswer,
            sizes
            | {
                "box": scalars_bytes(BoxCoordinates),
                "confidence": FLOAT_BYTES,
                "x_edges": map_bytes(sum(map(text_bytes, EDGES)), sum(edges), len(edges)),
            },
        )
    sizes["x_semif"] = semif_bytes(first)
    if kind == "noul":
        return object_bytes(NoulAnswer, sizes | {"noul": FLOAT_BYTES})
    sizes |= {"probabilities": by_name, "confidence": FLOAT_BYTES}
    if kind == "choice":
        return object_bytes(ChoiceAnswer, sizes | {"choice": max(names)})
    legend = map_bytes(sum(names), sum(text_bytes(o.description) for o in first.options), n)
    return object_bytes(ScoreAnswer, sizes | {"score": FLOAT_BYTES, "legend": legend})


def reply_bytes(
    bodies: dict[str, NoulQuestion | ChoiceQuestion | ScoreQuestion | BoxQuestion],
    asked: Sequence[tuple[Question, ...]],
    model_name: str,
) -> int:
    """At least the bytes of the reply to a request's questions (`asked[k]`: the core questions
    the k-th was asked as), counted without building it."""
    answers = [answer_bytes(body.type, own) for body, own in zip(bodies.values(), asked, strict=True)]
    return object_bytes(
        SystemOneResponse,
        {
            "model": text_bytes(model_name),
            "answers": map_bytes(sum(map(text_bytes, bodies)), sum(answers), len(answers)),
            "usage": scalars_bytes(Usage),
            "x_timing": TIMING_BYTES,
        },
    )


# -- the door -------------------------------------------------------------------------------------


def release_date(service: Service) -> str:
    """SEMIF_MODEL_RELEASE_DATE, else the day (UTC) the checkpoint's config.json was written."""
    settings = service.settings
    if settings.model_release_date is not None:
        return settings.model_release_date.isoformat()
    config = settings.require_model() / "config.json"
    return datetime.fromtimestamp(config.stat().st_mtime, UTC).date().isoformat()


# TypeSafe's bodies for the published error responses (422 is FastAPI's own shape).
PUBLISHED_ERRORS = error_responses(
    TypeSafeError,
    {
        400: (
            TypeSafeError,
            "unknown model, a question the answer codes cannot read, a repeated header, or a corrupt body",
        ),
        422: (TypeSafeValidationError, "a field breaks a rule"),
    },
)


class SystemOneDoor(DecisionDoor):
    """TypeSafe's System One over the decision core."""

    path_prefix = "/v1/"
    protected_paths = frozenset({SYSTEMONE_PATH, MODELS_PATH})
    request_models = (SystemOneRequest,)
    errors = SYSTEMONE_ERRORS
    request_id_headers = (b"x-typesafe-request-id",)  # what TypeSafe's SDKs read

    def __init__(self, service: Service) -> None:
        super().__init__(service)
        settings = service.settings
        self.policy = Policy(settings.systemone_orderings, settings.systemone_workloads)
        identity = service.core.identity
        self.model_name = f"{identity.source}@{identity.revision}"
        self.max_options = min(MAX_OPTIONS, service.core.capacity)
        self.release_date = release_date(service)
        self.verified_images = VerifiedImages()  # decoded whole once: a cached image is not decoded again

    @property
    def limits(self) -> Limits:
        """System One's bounds: the operator's token and row caps, the tokenizer's answer codes."""
        settings = self.service.settings
        return Limits(
            settings.systemone_max_input_tokens,
            self.max_options,
            settings.systemone_max_rows,
            settings.systemone_max_request_tokens,
            settings.max_reply_bytes,
        )

    def refuse_past_row_cap(self, data: dict[str, Any]) -> None:
        """Refuse (413) a decoded request whose questions already ask for more rows than the cap,
        counted from the JSON before it is validated or mapped: milliseconds, whatever it holds."""
        rows = rows_asked(data, self.policy)
        limit = self.service.settings.systemone_max_rows
        if rows > limit:
            exc = domain.TooManyRows(rows, limit)
            raise self.refusal(exc, rule_for(self.errors, exc), True, [])

    @property
    def image_limits(self) -> ImageLimits:
        """The operator's bounds on a request's images."""
        settings = self.service.settings
        return ImageLimits(
            settings.systemone_max_images,
            settings.systemone_max_image_pixels,
            settings.systemone_max_image_bytes,
        )

    def body_limit(self, path: str, content_type: str | None, default: int) -> int:
        """A multipart body on `/v1/systemone` may carry SEMIF_SYSTEMONE_MAX_IMAGE_BYTES of images
        beside a JSON request part of at most the JSON body limit."""
        if path == SYSTEMONE_PATH and is_multipart(content_type):
            return default + self.service.settings.systemone_max_image_bytes
        return default

    def parse(
        self, content_type: str | None, body: bytes
    ) -> tuple[SystemOneRequest, dict[str, bytes] | None]:
        """The validated request and, for a multipart body, its parts by name (None for JSON);
        run off the event loop."""
        if not is_multipart(content_type):
            return parse_request(body, self.max_options, self.refuse_past_row_cap), None
        try:
            # The `request` part, one per image allowed, and one more: an image over the count
            # gets the image-count 413 below, with the request read.
            multipart = parse_multipart(content_type or "", body, self.image_limits.max_images + 2)
        except TooManyParts as exc:
            raise ServiceError(
                413, "request_too_large", f"{exc} (a `request` part and SEMIF_SYSTEMONE_MAX_IMAGES images)"
            ) from None
        except MultipartRefused as exc:
            raise SystemOneValidationError(
                [{"loc": ["body"], "msg": str(exc), "type": "value_error"}]
            ) from None
        limit = self.service.settings.max_body_bytes
        if len(multipart.request) > limit:
            raise ServiceError(
                413,
                "request_too_large",
                f"the `request` part is {len(multipart.request)} bytes, over SEMIF_MAX_BODY_BYTES ({limit})",
            )
        return parse_request(multipart.request, self.max_options, self.refuse_past_row_cap), multipart.parts

    def mapped(self, parsed: SystemOneRequest) -> tuple[list[tuple[Question, ...]], int]:
        """The core questions each question is asked as, and the count of the reply; run off the
        event loop (both are linear in the request's text)."""
        asked = [core_questions(qid, q, self.policy) for qid, q in parsed.questions.items()]
        return asked, reply_bytes(parsed.questions, asked, self.model_name)

    def accepts(self, model: str) -> bool:
        """Whether a request naming `model` is served: the real name, or an alias when allowed."""
        return model == self.model_name or (
            self.service.settings.systemone_allow_aliases and model in ALIASES
        )

    def render(self, error: ServiceError, request: Request) -> Response:
        """Any error on `/v1/...` in TypeSafe's shapes: `retry-after-ms` beside `Retry-After`
        (TypeSafe's clients read the finer one first); the request id headers are stamped by
        the request context."""
        status, body = systemone_body(error)
        headers = dict(error.headers)
        if "Retry-After" in headers:
            headers["retry-after-ms"] = str(round(float(headers["Retry-After"]) * 1000))
        return JSONResponse(body, status_code=status, headers=headers)

    def refusal(self, exc: DecisionError, rule: ErrorRule, shared: bool, ids: Sequence[str]) -> ServiceError:
        """The TypeSafe error for a domain error; the message names the question where known."""
        where = ""
        if exc.question is not None and exc.question < len(ids):
            where = f"question {ids[exc.question]!r}: "
        return ServiceError(rule.status, rule.code, where + exc.message, None, dict(rule.headers))

    def models(self) -> ModelList:
        """`GET /v1/models`: the loaded model's real identity first, then the aliases it answers."""
        identity = self.service.core.identity
        demo = " Random demo weights: the answers carry no meaning." if identity.demo else ""
        real = ModelEntry(
            name=self.model_name,
            description=(
                f"{identity.source} at revision {identity.revision} ({identity.dtype}), read by SemIf's "
                f"option-logit readout in one forward pass (semif-serve {__version__}); up to "
                f"{self.max_options} options.{demo}"
            ),
            release_date=self.release_date,
            x_source=identity.source,
            x_revision=identity.revision,
            x_max_options=self.max_options,
            x_answer_codes=self.service.core.capacity,
            x_max_input_tokens=self.service.settings.systemone_max_input_tokens,
            x_reads_images=self.service.core.reads_images,
            x_max_images=self.image_limits.max_images,
            x_max_image_pixels=self.image_limits.max_image_pixels,
            x_max_image_bytes=self.image_limits.max_image_bytes,
        )
        aliases = [
            ModelEntry(
                name=alias,
                description=f"Alias of {self.model_name}.",
                release_date=self.release_date,
                x_alias_of=self.model_name,
            )
            for alias in (ALIASES if self.service.settings.systemone_allow_aliases else ())
        ]
        return ModelList(models=[real, *aliases])

    async def answer(self, request: Request, body: bytes) -> SystemOneResponse:
        """`POST /v1/systemone`: every question (and ordering) over the state in one batch."""
        content_type = headers_of(request.scope).media_type  # the one Content-Type admission bounded
        parsed, parts = await asyncio.to_thread(self.parse, content_type, body)
        if parsed.assets:  # decoding images is CPU work: off the event loop
            images = await asyncio.to_thread(
                resolve_images, parsed, parts, self.image_limits, self.verified_images
            )
        else:  # only the placeholder and part checks: no thread hop for a text-only request
            images = resolve_images(parsed, parts, self.image_limits)
        if not self.accepts(parsed.model):
            aliases = (
                f" (aliases: {', '.join(ALIASES)})" if self.service.settings.systemone_allow_aliases else ""
            )
            raise ServiceError(
                UNKNOWN_MODEL.status,
                UNKNOWN_MODEL.code,
                f"unknown model {parsed.model!r}; this server serves {self.model_name!r}{aliases}",
            )
        if images and not self.service.core.reads_images:
            raise ServiceError(
                NO_VISION.status,
                NO_VISION.code,
                f"the loaded model {self.model_name!r} does not read images: its checkpoint has no "
                "vision tower, so a request with `assets` is refused rather than answered from "
                "the placeholder text",
                "assets",
            )
        parsed, images = place_images(parsed, images)
        asked, need = await asyncio.to_thread(self.mapped, parsed)
        questions = [question for own in asked for question in own]
        # One row runs like /decide's (the plain forward or a cached state); several share one prefill.
        outcome = await self.ask(
            request,
            parsed.state,
            questions,
            shared=False,
            limits=self.limits,
            reply_bytes=need,
            images=images,
        )
        answers = await asyncio.to_thread(answers_of, parsed.questions, asked, outcome.questions)
        return SystemOneResponse(
            model=self.model_name,
            answers=answers,
            usage=Usage(input_tokens=evaluated_tokens(outcome), output_tokens=0),
            x_timing=timing_block(outcome),
        )

    def router(self) -> APIRouter:
        """`POST /v1/systemone` and `GET /v1/models`, declared for the published schema."""
        router = APIRouter(dependencies=[Security(BEARER)], responses=PUBLISHED_ERRORS)

        self.add_post(
            router,
            SYSTEMONE_PATH,
            name="systemone",
            summary="System One: noul, choice, score and box questions over one state, one batch",
            body=SystemOneRequest,
            reply=SystemOneResponse,
            build=self.answer,
        )

        @router.get(
            MODELS_PATH, summary="The loaded model and its aliases", responses={200: {"model": ModelList}}
        )
        async def models() -> JSONResponse:
            return json_reply(self.models())

        return router
