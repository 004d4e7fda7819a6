"""The native HTTP door: `POST /decide`, `POST /decide/shared` and `POST /calibrate`.

Parse a body (native_schemas), ask the decision core, and map its typed outcome to SemIf
result dicts (keys in upstream's order) or its domain error to a status through
`NATIVE_ERRORS`, the one table of this door.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import asdict

from fastapi import APIRouter, Request, Security
from fastapi.responses import JSONResponse

from semif_serve.domain.fitting import calibration_entry, calibration_report, reliability_bins
from semif_serve.domain.orderings import COMBINE_METHOD
from semif_serve.domain.prompt import PROMPT_VERSION
from semif_serve.domain.types import (
    AnswerBoundary,
    BatchTiming,
    Calibrated,
    DecisionError,
    DecisionOutcome,
    EngineFailure,
    ImageTooLargeForMemory,
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
from semif_serve.doors.base import (
    BEARER,
    DecisionDoor,
    ErrorRule,
    Limits,
    error_responses,
    rule_for,
)
from semif_serve.doors.native.schemas import (
    MAX_OPTIONS,
    BinBody,
    CalibrateBody,
    CalibratedBody,
    CalibrationReport,
    CombinedBody,
    DecisionBody,
    DecisionResult,
    ErrorEnvelope,
    ModelInfo,
    NativeResult,
    QuestionBody,
    SharedDecisionsBody,
    SharedResponse,
    TimingBody,
    parse_body,
)
from semif_serve.engine.runner import DIRECT_READOUT, SHARED_READOUT, SHARED_SERVING_CONFIG
from semif_serve.http.errors import ServiceError, error_response, invalid

PROBABILITY_STATUS = "conditional option score; uncalibrated as decision confidence"
CALIBRATE_PATH = "/calibrate"


NATIVE_ERRORS: dict[type[DecisionError], ErrorRule] = {
    TooManyOptions: ErrorRule(
        422, "validation_error", "options", "decisions[{question}].options", when="too many options"
    ),
    TooManyRows: ErrorRule(
        422, "too_many_rows", "orderings", "decisions", when="decisions × orderings over SEMIF_MAX_ROWS"
    ),
    TooManyTokens: ErrorRule(
        422, "too_many_tokens", "state", "decisions[{question}]", when="a prompt over SEMIF_MAX_INPUT_TOKENS"
    ),
    UnknownWorkload: ErrorRule(
        422,
        "unknown_workload",
        "workload",
        "decisions[{question}].workload",
        when="`workload` is not in the calibration file; the message lists the known ones",
    ),
    AnswerBoundary: ErrorRule(
        422,
        "answer_boundary",
        "state",
        "decisions[{question}]",
        when="appending an answer letter would change this prompt's tokenisation",
    ),
    TooLargeForMemory: ErrorRule(
        413,
        "too_large_for_memory",
        "state",
        "decisions[{question}]",
        when="one row alone needs more memory than the cap leaves; the message says how much",
    ),
    # The native door carries no images; the rule is here so that every domain error has one.
    ImageTooLargeForMemory: ErrorRule(
        413,
        "too_large_for_memory",
        "state",
        when="an image needs more memory in the vision tower than the cap leaves",
    ),
    OutOfMemory: ErrorRule(
        503,
        "out_of_memory",
        None,
        None,
        {"Retry-After": "1"},
        when="the forward ran out of device memory; memory was released; `Retry-After`",
    ),
    EngineFailure: ErrorRule(500, "internal_error", None, None, when="an unexpected engine failure"),
}


def native_error(exc: DecisionError, shared: bool) -> ServiceError:
    """The native door's answer to a domain error, naming the request field it concerns: the
    decision's own field where its position is known, else the list of decisions."""
    rule = rule_for(NATIVE_ERRORS, exc)
    template = rule.shared_field if shared else rule.field
    path = None
    if template is not None:
        known = exc.question is not None
        path = template.format(question=exc.question) if known else template.split("[{question}]")[0]
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


def model_info(identity: dict[str, str], outcome: DecisionOutcome) -> ModelInfo:
    """The `model` block: the engine's identity, plus the serving config on the shared path."""
    if outcome.shared:
        return ModelInfo(**identity, serving_config=SHARED_SERVING_CONFIG)
    return ModelInfo(**identity)


def semif_result(
    question_id: str, readout: OrderingReadout, outcome: DecisionOutcome, model: ModelInfo
) -> NativeResult:
    """SemIf's result dict for one ordering, keys in upstream's order."""
    return NativeResult(
        id=question_id,
        option_ids=list(readout.option_ids),
        probabilities=readout.probabilities,
        option_logits=readout.option_logits,
        input_tokens=readout.input_tokens,
        forward_seconds=outcome.forward_seconds,
        total_seconds=outcome.total_seconds,
        prompt_sha256=readout.prompt_sha256,
        prompt_version=PROMPT_VERSION,
        model=model,
        readout=SHARED_READOUT if outcome.shared else DIRECT_READOUT,
        probability_status=PROBABILITY_STATUS,
    )


def calibrated_body(calibrated: Calibrated, option_ids: list[str] | None) -> CalibratedBody:
    """Probabilities at the workload's temperature: a list for a single read, by id when combined."""
    probs = calibrated.probabilities
    return CalibratedBody(
        workload=calibrated.workload,
        temperature=calibrated.temperature,
        temperature_mode=calibrated.temperature_mode,
        probabilities=dict(zip(option_ids, probs, strict=True)) if option_ids else probs,
    )


def timing_body(timing: BatchTiming) -> TimingBody:
    """How the shared-path batch ran."""
    return TimingBody(**timing.as_dict())


def decision_result(
    answer: QuestionOutcome, outcome: DecisionOutcome, identity: dict[str, str]
) -> DecisionResult:
    """One decision's reply: the native result for the caller's order, plus orderings/combined/calibrated."""
    question = answer.question
    model = model_info(identity, outcome)
    natives = [semif_result(question.id, r, outcome, model) for r in answer.readouts]
    result = DecisionResult(**dict(natives[0]))
    if answer.combined is None:
        if answer.calibrated is not None:
            result.calibrated = calibrated_body(answer.calibrated, None)
        return result
    combined = answer.combined
    block = CombinedBody(
        method=COMBINE_METHOD,
        mode=combined.mode,
        orderings=combined.orderings,
        probabilities=combined.probabilities,
        top=combined.top,
        agreement=combined.agreement,
        spread=combined.spread,
    )
    if answer.calibrated is not None:
        block.calibrated = calibrated_body(answer.calibrated, [o.id for o in question.options])
    result.orderings = natives
    result.combined = block
    return result


# -- the door -------------------------------------------------------------------------------------


class NativeDoor(DecisionDoor):
    """SemIf's native API over the decision core."""

    path_prefix = ""
    protected_paths = frozenset({"/decide", "/decide/shared", CALIBRATE_PATH})
    request_models = (DecisionBody, SharedDecisionsBody, CalibrateBody)
    errors = NATIVE_ERRORS

    def render(self, error: ServiceError, request: Request) -> JSONResponse:
        """The native envelope, with the error's headers and the request id."""
        return error_response(error, getattr(request.state, "request_id", None))

    def refusal(self, exc: DecisionError, rule: ErrorRule, shared: bool, ids: Sequence[str]) -> ServiceError:
        """The native envelope's error for a domain error (the field names the decision)."""
        return native_error(exc, shared)

    @property
    def limits(self) -> Limits:
        """SemIf's own bounds: at most 16 options (A..P), the native row and token caps."""
        settings = self.service.settings
        return Limits(settings.max_input_tokens, MAX_OPTIONS, settings.max_rows)

    async def decide(self, request: Request, body: bytes) -> DecisionResult:
        """`POST /decide`: one decision; orderings run as one shared batch."""
        decision = await asyncio.to_thread(parse_body, DecisionBody, body)
        outcome = await self.ask(
            request, decision.state, [to_question(decision)], shared=False, limits=self.limits
        )
        result = decision_result(outcome.questions[0], outcome, self.service.core.model_info)
        if outcome.timing is not None:
            result.timing = timing_body(outcome.timing)
        return result

    async def decide_shared(self, request: Request, body: bytes) -> SharedResponse:
        """`POST /decide/shared`: every decision (and ordering) over one state in one batch."""
        shared = await asyncio.to_thread(parse_body, SharedDecisionsBody, body)
        questions = [to_question(d) for d in shared.decisions]
        outcome = await self.ask(request, shared.state, questions, shared=True, limits=self.limits)
        identity = self.service.core.model_info
        results = [decision_result(q, outcome, identity) for q in outcome.questions]
        assert outcome.timing is not None  # the shared path always times its batch
        return SharedResponse(results=results, timing=timing_body(outcome.timing))

    async def calibrate(self, request: Request, body: bytes) -> CalibrationReport:
        """`POST /calibrate`: fit the workload's single-read T on labelled rows, with the code
        `semif-serve calibrate` runs (on a worker thread: the fit is CPU work)."""
        parsed = await asyncio.to_thread(parse_body, CalibrateBody, body)
        limit = self.service.settings.calibrate_max_logits
        logits = sum(len(row.logits) for row in parsed.rows)
        if logits > limit:
            raise invalid(
                "rows",
                f"the rows hold {logits} logits (rows x options), over the limit of {limit} "
                "(SEMIF_CALIBRATE_MAX_LOGITS); fit fewer rows per request",
            )
        rows = [(row.logits, row.label) for row in parsed.rows]
        report = await asyncio.to_thread(calibration_report, rows, [row.group for row in parsed.rows])
        before, after = await asyncio.to_thread(
            lambda: (reliability_bins(rows, 1.0), reliability_bins(rows, report["temperature"]))
        )
        return CalibrationReport(
            **report,
            workload=parsed.workload,
            bins_before=[BinBody(**asdict(b)) for b in before],
            bins_after=[BinBody(**asdict(b)) for b in after],
            entry=calibration_entry(parsed.workload, "single", report["temperature"]),
        )

    def router(self) -> APIRouter:
        """`POST /decide`, `POST /decide/shared` and `POST /calibrate`, declared for the published schema."""
        router = APIRouter(dependencies=[Security(BEARER)], responses=error_responses(ErrorEnvelope))

        self.add_post(
            router,
            "/decide",
            name="decide",
            summary="One decision",
            body=DecisionBody,
            reply=DecisionResult,
            build=self.decide,
        )
        self.add_post(
            router,
            "/decide/shared",
            name="decide_shared",
            summary="Many decisions over one state, one batch",
            body=SharedDecisionsBody,
            reply=SharedResponse,
            build=self.decide_shared,
        )
        self.add_post(
            router,
            CALIBRATE_PATH,
            name="calibrate",
            summary="Fit a workload's temperature on labelled reads, as `semif-serve calibrate` does",
            body=CalibrateBody,
            reply=CalibrationReport,
            build=self.calibrate,
        )
        return router
