"""The System One door: `POST /v1/systemone` and `GET /v1/models`, TypeSafe's wire format.

Map each typed question (noul, choice, score) onto the decision core's options, ask every
question of a request (in every ordering) as one shared batch, and map the outcome back to
System One answers, or a domain error through `SYSTEMONE_ERRORS`, the one table of this door.
Every error on these paths is rendered by `render_systemone_error` in TypeSafe's shapes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request, Security
from fastapi.responses import JSONResponse, Response

from . import __version__
from .core import outcome_record
from .domain import (
    AnswerBoundary,
    DecisionError,
    DecisionOutcome,
    EngineFailure,
    Option,
    OutOfMemory,
    Question,
    QuestionOutcome,
    TooLargeForMemory,
    TooManyOptions,
    TooManyRows,
    TooManyTokens,
    UnknownWorkload,
)
from .errors import ServiceError, internal
from .native_api import BEARER, json_body
from .numerics import argmax
from .prompt import PROMPT_VERSION
from .startup import Service
from .systemone_schemas import (
    CORE_ORDERINGS,
    MAX_OPTIONS,
    MODELS_PATH,
    NO_ORDERINGS,
    SYSTEMONE_PATH,
    ChoiceQuestion,
    ModelList,
    NoulQuestion,
    ScoreQuestion,
    SystemOneRequest,
    SystemOneResponse,
    SystemOneValidationError,
    TypeSafeError,
    TypeSafeValidationError,
    orderings_policy,
    parse_request,
    parse_type_map,
)

log = logging.getLogger("semif_serve.systemone")

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


@dataclass(frozen=True)
class SystemOneErrorRule:
    """How System One answers one domain error: status and TypeSafe `error_type`."""

    status: int
    error_type: str
    headers: Mapping[str, str] = field(default_factory=dict)
    when: str = ""


SYSTEMONE_ERRORS: dict[type[DecisionError], SystemOneErrorRule] = {
    TooManyOptions: SystemOneErrorRule(
        400, "api_usage_error", when="more options than the loaded tokenizer's answer codes"
    ),
    TooManyRows: SystemOneErrorRule(
        413, "request_too_large", when="questions × orderings over SEMIF_SYSTEMONE_MAX_ROWS"
    ),
    TooManyTokens: SystemOneErrorRule(
        413,
        "request_too_large",
        when="a prompt over SEMIF_SYSTEMONE_MAX_INPUT_TOKENS; the message gives the need",
    ),
    TooLargeForMemory: SystemOneErrorRule(
        413, "request_too_large", when="one row alone needs more memory than the cap leaves"
    ),
    UnknownWorkload: SystemOneErrorRule(
        400, "api_usage_error", when="`x_workload` is not in the calibration file"
    ),
    AnswerBoundary: SystemOneErrorRule(
        400, "api_usage_error", when="appending an answer code would change this prompt's tokenisation"
    ),
    OutOfMemory: SystemOneErrorRule(
        503, "overloaded_error", {"Retry-After": "1"}, when="the forward ran out of device memory; released"
    ),
    EngineFailure: SystemOneErrorRule(500, "internal_error", when="an unexpected engine failure"),
}

# Errors raised outside the core (admission, routing, the door) by native code -> TypeSafe type.
HTTP_ERROR_TYPES = {
    "unauthorized": "authentication_error",
    "not_found": "not_found",
    "method_not_allowed": "method_not_allowed",
    "invalid_content_length": "api_usage_error",
    "invalid_compressed_body": "api_usage_error",
    "unsupported_content_encoding": "api_usage_error",
    "body_too_large": "request_too_large",
    "body_timeout": "timeout_error",
    "header_timeout": "timeout_error",
    "busy": "rate_limit_error",
    "draining": "overloaded_error",
    "internal_error": "internal_error",
}
# The door's own refusal, outside the core.
UNKNOWN_MODEL = SystemOneErrorRule(
    400, "api_usage_error", when="`model` is neither the loaded model nor an alias"
)


def systemone_error(exc: DecisionError, question_ids: list[str]) -> ServiceError:
    """The System One answer to a domain error; the message names the question where known."""
    rule = next(SYSTEMONE_ERRORS[kind] for kind in type(exc).__mro__ if kind in SYSTEMONE_ERRORS)
    where = ""
    if exc.question is not None and exc.question < len(question_ids):
        where = f"question {question_ids[exc.question]!r}: "
    return ServiceError(rule.status, rule.error_type, where + exc.message, None, dict(rule.headers))


def systemone_body(error: ServiceError) -> tuple[int, dict[str, Any]]:
    """The status and TypeSafe body of any error on System One's paths."""
    if isinstance(error, SystemOneValidationError):
        return 422, {"detail": error.detail}
    if error.code in ("invalid_json", "validation_error"):
        kind = "json_invalid" if error.code == "invalid_json" else "value_error"
        return 422, {"detail": [{"loc": ["body"], "msg": error.message, "type": kind}]}
    error_type = HTTP_ERROR_TYPES.get(error.code, error.code)
    return error.status, {"detail": {"error_type": error_type, "message": error.message}}


def render_systemone_error(
    error: ServiceError, request_id: str | None = None
) -> tuple[int, dict[str, str], bytes]:
    """Any ServiceError on a System One path (`/v1/...`) as (status, headers, body bytes) in
    TypeSafe's shapes; admission calls it for the errors it raises before the app runs."""
    status, body = systemone_body(error)
    headers = dict(error.headers)
    if "Retry-After" in headers:
        # TypeSafe's clients read the finer `retry-after-ms` first.
        headers["retry-after-ms"] = str(round(float(headers["Retry-After"]) * 1000))
    if request_id is not None:
        headers["X-Request-ID"] = request_id
    response = JSONResponse(body, status_code=status, headers=headers)
    return (
        status,
        {k.decode("latin-1"): v.decode("latin-1") for k, v in response.raw_headers},
        bytes(response.body),
    )


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


def semif_block(answer: QuestionOutcome) -> dict[str, Any]:
    """`x_semif`: the native readout of the caller's order, and how the answer was combined."""
    native = answer.readouts[0]
    combined = answer.combined
    calibrated = answer.calibrated
    return {
        "prompt_sha256": native.prompt_sha256,
        "prompt_version": PROMPT_VERSION,
        "input_tokens": native.input_tokens,
        "option_logits": dict(zip(native.option_ids, native.option_logits, strict=True)),
        "orderings": combined.mode if combined is not None else NO_ORDERINGS,
        "rows": len(answer.readouts),
        "agreement": combined.agreement if combined is not None else 1.0,
        "workload": calibrated.workload if calibrated is not None else None,
        "temperature": calibrated.temperature if calibrated is not None else None,
    }


def answer_dict(kind: str, answer: QuestionOutcome) -> dict[str, Any]:
    """One System One answer from the core's outcome."""
    probabilities = final_probabilities(answer)
    names = [o.id for o in answer.question.options]
    if kind == "noul":
        return {"type": "noul", "noul": probabilities[0], "x_semif": semif_block(answer)}
    by_name = dict(zip(names, probabilities, strict=True))
    if kind == "choice":
        return {
            "type": "choice",
            "choice": names[argmax(probabilities)],
            "probabilities": by_name,
            "confidence": choice_confidence(probabilities),
            "x_semif": semif_block(answer),
        }
    return {
        "type": "score",
        "score": expected_score(probabilities),
        "legend": {o.id: o.description for o in answer.question.options},
        "probabilities": by_name,
        "confidence": score_confidence(probabilities),
        "x_semif": semif_block(answer),
    }


def evaluated_tokens(outcome: DecisionOutcome) -> int:
    """Tokens the engine evaluated: the shared prefix once, plus every row's own suffix."""
    if outcome.timing is None:
        return sum(r.input_tokens for q in outcome.questions for r in q.readouts)
    return outcome.timing.prefix_tokens + outcome.timing.true_suffix_tokens


# -- the door -------------------------------------------------------------------------------------


def release_date(service: Service) -> str:
    """SEMIF_MODEL_RELEASE_DATE, else the day (UTC) the checkpoint's config.json was written."""
    settings = service.settings
    if settings.model_release_date is not None:
        return settings.model_release_date.isoformat()
    config = settings.require_model() / "config.json"
    return datetime.fromtimestamp(config.stat().st_mtime, UTC).date().isoformat()


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": TypeSafeError, "description": "missing, malformed or wrong bearer token"},
    400: {"model": TypeSafeError, "description": "unknown model, or a question the answer codes cannot read"},
    413: {"model": TypeSafeError, "description": "the body, a prompt or the rows pass a limit"},
    422: {"model": TypeSafeValidationError, "description": "a field breaks a rule"},
    429: {"model": TypeSafeError, "description": "too many requests in progress; retry-after"},
    503: {"model": TypeSafeError, "description": "out of device memory, or draining; retry-after"},
}


class SystemOneDoor:
    """TypeSafe's System One over the decision core."""

    path_prefix = "/v1/"
    protected_paths = frozenset({SYSTEMONE_PATH, MODELS_PATH})

    def __init__(self, service: Service) -> None:
        self.service = service
        settings = service.settings
        self.policy = Policy(
            orderings_policy(settings.systemone_orderings), parse_type_map(settings.systemone_workloads)
        )
        identity = service.engine.identity
        self.model_name = f"{identity.source}@{identity.revision}"
        self.max_options = min(MAX_OPTIONS, service.engine.codec.capacity)
        self.release_date = release_date(service)

    def accepts(self, model: str) -> bool:
        """Whether a request naming `model` is served: the real name, or an alias when allowed."""
        return model == self.model_name or (
            self.service.settings.systemone_allow_aliases and model in ALIASES
        )

    def render(self, error: ServiceError, request: Request) -> Response:
        """Any error on `/v1/...` in TypeSafe's shapes, with the request id."""
        status, headers, body = render_systemone_error(error, getattr(request.state, "request_id", None))
        headers.pop("content-length", None)
        return Response(body, status_code=status, headers=headers)

    def models(self) -> dict[str, Any]:
        """`GET /v1/models`: the loaded model's real identity first, then the aliases it answers."""
        identity = self.service.engine.identity
        demo = " Random demo weights: the answers carry no meaning." if identity.demo else ""
        real = {
            "name": self.model_name,
            "description": (
                f"{identity.source} at revision {identity.revision} ({identity.dtype}), read by SemIf's "
                f"option-logit readout in one forward pass (semif-serve {__version__}); up to "
                f"{self.max_options} options.{demo}"
            ),
            "release_date": self.release_date,
            "x_source": identity.source,
            "x_revision": identity.revision,
            "x_max_options": self.max_options,
            "x_answer_codes": self.service.engine.codec.capacity,
            "x_max_input_tokens": self.service.settings.systemone_max_input_tokens,
        }
        aliases = [
            {
                "name": alias,
                "description": f"Alias of {self.model_name}.",
                "release_date": self.release_date,
                "x_alias_of": self.model_name,
            }
            for alias in (ALIASES if self.service.settings.systemone_allow_aliases else ())
        ]
        return {"models": [real, *aliases]}

    async def answer(self, body: bytes, record: dict[str, Any]) -> dict[str, Any]:
        """`POST /v1/systemone`: every question (and ordering) over the state in one shared batch."""
        request = await asyncio.to_thread(parse_request, body, self.max_options)
        if not self.accepts(request.model):
            raise ServiceError(
                UNKNOWN_MODEL.status,
                UNKNOWN_MODEL.error_type,
                f"unknown model {request.model!r}; this server serves {self.model_name!r}"
                + (
                    f" (aliases: {', '.join(ALIASES)})"
                    if self.service.settings.systemone_allow_aliases
                    else ""
                ),
            )
        ids = list(request.questions)
        questions = await asyncio.to_thread(
            lambda: [to_question(qid, q, self.policy) for qid, q in request.questions.items()]
        )
        outcome = await self._ask(request, questions, ids)
        record.update(outcome_record(outcome))
        answers = {
            qid: answer_dict(request.questions[qid].type, answer)
            for qid, answer in zip(ids, outcome.questions, strict=True)
        }
        return {
            "model": self.model_name,
            "answers": answers,
            "usage": {"input_tokens": evaluated_tokens(outcome), "output_tokens": 0},
        }

    async def _ask(
        self, request: SystemOneRequest, questions: list[Question], ids: list[str]
    ) -> DecisionOutcome:
        settings = self.service.settings
        try:
            return await self.service.core.decide(
                request.state,
                questions,
                shared=True,
                max_input_tokens=settings.systemone_max_input_tokens,
                max_options=self.max_options,
                max_rows=settings.systemone_max_rows,
                max_request_tokens=settings.systemone_max_request_tokens,
            )
        except DecisionError as exc:
            raise systemone_error(exc, ids) from None

    def router(self) -> APIRouter:
        """`POST /v1/systemone` and `GET /v1/models`, declared for the published schema."""
        router = APIRouter(dependencies=[Security(BEARER)], responses=ERROR_RESPONSES)

        @router.post(
            SYSTEMONE_PATH,
            summary="System One: noul, choice and score questions over one state, one batch",
            responses={200: {"model": SystemOneResponse}},
            openapi_extra=json_body(SystemOneRequest),
        )
        async def systemone(request: Request) -> JSONResponse:
            body = await request.body()
            record = request.state.log if hasattr(request.state, "log") else {}
            try:
                return JSONResponse(await self.answer(body, record))
            except ServiceError:
                raise
            except Exception as exc:  # noqa: BLE001 - a failure building the reply is a 500 in TypeSafe's shape
                log.error("failed to build the response: %s", type(exc).__name__)
                raise internal() from None

        @router.get(
            MODELS_PATH, summary="The loaded model and its aliases", responses={200: {"model": ModelList}}
        )
        async def models() -> JSONResponse:
            return JSONResponse(self.models())

        return router


REQUEST_MODELS = (SystemOneRequest,)
