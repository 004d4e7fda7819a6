"""The native HTTP door: `POST /decide` and `POST /decide/shared`.

Parse a body (native_schemas), ask the decision core, and map its typed outcome to SemIf
result dicts (keys in upstream's order) or its domain error to a status through
`NATIVE_ERRORS`, the one table of this door.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request, Security
from fastapi.responses import JSONResponse
from fastapi.security import HTTPBearer

from .admission import native_render
from .core import outcome_record
from .domain import (
    AnswerBoundary,
    Calibrated,
    DecisionError,
    DecisionOutcome,
    EngineFailure,
    Option,
    OrderingReadout,
    OutOfMemory,
    Question,
    QuestionOutcome,
    TooLargeForMemory,
    TooManyOptions,
    TooManyRows,
    TooManyTokens,
    UnknownWorkload,
)
from .engine import DIRECT_READOUT, SHARED_READOUT, SHARED_SERVING_CONFIG
from .errors import ServiceError, internal
from .native_schemas import (
    MAX_OPTIONS,
    DecisionBody,
    DecisionResult,
    ErrorEnvelope,
    QuestionBody,
    SharedDecisionsBody,
    SharedResponse,
    parse_body,
)
from .orderings import COMBINE_METHOD
from .prompt import PROMPT_VERSION
from .startup import Service

log = logging.getLogger("semif_serve.native")

PROBABILITY_STATUS = "conditional option score; uncalibrated as decision confidence"


@dataclass(frozen=True)
class NativeErrorRule:
    """How the native door answers one domain error: status, code, and the field it names on
    `/decide` and on `/decide/shared` (`{question}` is the decision's index)."""

    status: int
    code: str
    decide_field: str | None
    shared_field: str | None
    headers: Mapping[str, str] = field(default_factory=dict)
    when: str = ""


NATIVE_ERRORS: dict[type[DecisionError], NativeErrorRule] = {
    TooManyOptions: NativeErrorRule(
        422, "validation_error", "options", "decisions[{question}].options", when="too many options"
    ),
    TooManyRows: NativeErrorRule(
        422, "too_many_rows", "orderings", "decisions", when="decisions × orderings over SEMIF_MAX_ROWS"
    ),
    TooManyTokens: NativeErrorRule(
        422, "too_many_tokens", "state", "decisions[{question}]", when="a prompt over SEMIF_MAX_INPUT_TOKENS"
    ),
    UnknownWorkload: NativeErrorRule(
        422,
        "unknown_workload",
        "workload",
        "decisions[{question}].workload",
        when="`workload` is not in the calibration file; the message lists the known ones",
    ),
    AnswerBoundary: NativeErrorRule(
        422,
        "answer_boundary",
        "state",
        "decisions[{question}]",
        when="appending an answer letter would change this prompt's tokenisation",
    ),
    TooLargeForMemory: NativeErrorRule(
        413,
        "too_large_for_memory",
        "state",
        "decisions[{question}]",
        when="one row alone needs more memory than the cap leaves; the message says how much",
    ),
    OutOfMemory: NativeErrorRule(
        503,
        "out_of_memory",
        None,
        None,
        {"Retry-After": "1"},
        when="the forward ran out of device memory; memory was released; `Retry-After`",
    ),
    EngineFailure: NativeErrorRule(500, "internal_error", None, None, when="an unexpected engine failure"),
}


def native_error(exc: DecisionError, shared: bool) -> ServiceError:
    """The native door's answer to a domain error, naming the request field it concerns."""
    rule = next(NATIVE_ERRORS[kind] for kind in type(exc).__mro__ if kind in NATIVE_ERRORS)
    template = rule.shared_field if shared else rule.decide_field
    path = template.format(question=exc.question or 0) if template else None
    return ServiceError(rule.status, rule.code, exc.message, path, dict(rule.headers))


def to_question(body: QuestionBody) -> Question:
    """A validated body's question as the core's domain type."""
    return Question(
        id=body.id,
        text=body.question,
        options=tuple(Option(o.id, o.description) for o in body.options),
        orderings=body.orderings,
        workload=body.workload,
    )


# -- results ------------------------------------------------------------------------------------


def semif_result(
    question_id: str, readout: OrderingReadout, outcome: DecisionOutcome, model: dict[str, Any]
) -> dict[str, Any]:
    """SemIf's result dict for one ordering, keys in upstream's order."""
    if outcome.shared:
        model = {**model, "serving_config": SHARED_SERVING_CONFIG}
    return {
        "id": question_id,
        "option_ids": list(readout.option_ids),
        "probabilities": readout.probabilities,
        "option_logits": readout.option_logits,
        "input_tokens": readout.input_tokens,
        "forward_seconds": outcome.forward_seconds,
        "total_seconds": outcome.total_seconds,
        "prompt_sha256": readout.prompt_sha256,
        "prompt_version": PROMPT_VERSION,
        "model": model,
        "readout": SHARED_READOUT if outcome.shared else DIRECT_READOUT,
        "probability_status": PROBABILITY_STATUS,
    }


def _calibrated(calibrated: Calibrated, option_ids: list[str] | None) -> dict[str, Any]:
    probs = calibrated.probabilities
    return {
        "workload": calibrated.workload,
        "temperature": calibrated.temperature,
        "temperature_mode": calibrated.temperature_mode,
        "probabilities": dict(zip(option_ids, probs, strict=True)) if option_ids else probs,
    }


def result_dict(answer: QuestionOutcome, outcome: DecisionOutcome, model: dict[str, Any]) -> dict[str, Any]:
    """One decision's reply: the native result for the caller's order, plus orderings/combined/calibrated."""
    question = answer.question
    natives = [semif_result(question.id, r, outcome, model) for r in answer.readouts]
    result = dict(natives[0])
    if answer.combined is None:
        if answer.calibrated is not None:
            result["calibrated"] = _calibrated(answer.calibrated, None)
        return result
    combined = answer.combined
    block: dict[str, Any] = {
        "method": COMBINE_METHOD,
        "mode": combined.mode,
        "orderings": combined.orderings,
        "probabilities": combined.probabilities,
        "top": combined.top,
        "agreement": combined.agreement,
        "spread": combined.spread,
    }
    if answer.calibrated is not None:
        block["calibrated"] = _calibrated(answer.calibrated, [o.id for o in question.options])
    result["orderings"] = natives
    result["combined"] = block
    return result


# -- the door -------------------------------------------------------------------------------------

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorEnvelope, "description": description}
    for status, description in {
        400: "the body is not JSON, or Content-Length is malformed",
        401: "missing, malformed or wrong bearer token",
        413: "the body is too large, or one row needs more memory than the cap leaves",
        422: "a field breaks a rule (the envelope names the field and the rule)",
        429: "too many requests in progress; Retry-After",
        500: "an unexpected failure; the service stays up",
        503: "out of device memory, or draining; Retry-After",
    }.items()
}


def json_body(model: type[Any]) -> dict[str, Any]:
    """The OpenAPI request body of a route that parses `model` itself (to keep its own 4xx)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


BEARER = HTTPBearer(auto_error=False, description="`Authorization: Bearer <token>`")


class NativeDoor:
    """SemIf's native API over the decision core."""

    path_prefix = ""
    protected_paths = frozenset({"/decide", "/decide/shared"})

    def __init__(self, service: Service) -> None:
        self.service = service

    def render(self, error: ServiceError, request: Request) -> JSONResponse:
        """The native envelope, with the error's headers and the request id."""
        return native_render(error, request)

    async def decide(self, body: bytes, record: dict[str, Any]) -> dict[str, Any]:
        """`POST /decide`: one decision; orderings run as one shared batch."""
        decision = await asyncio.to_thread(parse_body, DecisionBody, body)
        outcome = await self._ask(decision.state, [to_question(decision)], shared=False)
        record.update(outcome_record(outcome))
        result = result_dict(outcome.questions[0], outcome, self.service.core.model_info)
        if outcome.timing is not None:
            result["timing"] = outcome.timing.as_dict()
        return result

    async def decide_shared(self, body: bytes, record: dict[str, Any]) -> dict[str, Any]:
        """`POST /decide/shared`: every decision (and ordering) over one state in one batch."""
        request = await asyncio.to_thread(parse_body, SharedDecisionsBody, body)
        questions = [to_question(d) for d in request.decisions]
        outcome = await self._ask(request.state, questions, shared=True)
        record.update(outcome_record(outcome))
        model = self.service.core.model_info
        results = [result_dict(q, outcome, model) for q in outcome.questions]
        timing = outcome.timing.as_dict() if outcome.timing is not None else {}
        return {"results": results, "timing": timing}

    async def _ask(self, state: Any, questions: list[Question], shared: bool) -> DecisionOutcome:
        settings = self.service.settings
        try:
            return await self.service.core.decide(
                state,
                questions,
                shared=shared,
                max_input_tokens=settings.max_input_tokens,
                max_options=MAX_OPTIONS,
                max_rows=settings.max_rows,
            )
        except DecisionError as exc:
            raise native_error(exc, shared) from None

    async def _answer(
        self, request: Request, handler: Callable[[bytes, dict[str, Any]], Awaitable[dict[str, Any]]]
    ) -> JSONResponse:
        body = await request.body()
        record = request.state.log if hasattr(request.state, "log") else {}
        try:
            return JSONResponse(await handler(body, record))
        except ServiceError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failure building the reply is a 500 envelope
            log.error("failed to build the response: %s", type(exc).__name__)
            raise internal() from None

    def router(self) -> APIRouter:
        """`POST /decide` and `POST /decide/shared`, declared for the published schema."""
        router = APIRouter(dependencies=[Security(BEARER)], responses=ERROR_RESPONSES)

        @router.post(
            "/decide",
            summary="One decision",
            responses={200: {"model": DecisionResult}},
            openapi_extra=json_body(DecisionBody),
        )
        async def decide(request: Request) -> JSONResponse:
            return await self._answer(request, self.decide)

        @router.post(
            "/decide/shared",
            summary="Many decisions over one state, one batch",
            responses={200: {"model": SharedResponse}},
            openapi_extra=json_body(SharedDecisionsBody),
        )
        async def decide_shared(request: Request) -> JSONResponse:
            return await self._answer(request, self.decide_shared)

        return router


REQUEST_MODELS = (DecisionBody, SharedDecisionsBody)
