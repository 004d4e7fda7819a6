"""The native HTTP door: `POST /decide`, `POST /decide/shared` and `POST /calibrate`.

Parse a body (native_schemas), ask the decision core, and map its typed outcome to SemIf
result dicts (keys in upstream's order) or its domain error to a status through
`NATIVE_ERRORS`, the one table of this door.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import APIRouter, Request, Security
from fastapi.responses import JSONResponse

from semif_serve.domain.echo import quoted
from semif_serve.domain.fitting import calibration_entry, calibration_report, reliability_bins
from semif_serve.domain.orderings import COMBINE_METHOD, order_count
from semif_serve.domain.prompt import PROMPT_VERSION
from semif_serve.domain.requests import OPTIONS, AskedQuestion, Limits
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
    ReplyTooLarge,
    TooLargeForMemory,
    TooManyOptions,
    TooManyRows,
    TooManyTokens,
    Unanswerable,
    UnknownWorkload,
    WorkloadOfAnotherModel,
)
from semif_serve.doors.base import (
    BEARER,
    DecisionDoor,
    ErrorRule,
    error_responses,
)
from semif_serve.doors.native.schemas import (
    MAX_OPTIONS,
    SYSTEM_ONE_PATH,
    BinBody,
    CalibrateBody,
    CalibratedBody,
    CalibrationReport,
    CombinedBody,
    DecisionBody,
    DecisionResult,
    ModelInfo,
    NativeResult,
    QuestionBody,
    SharedDecisionsBody,
    SharedResponse,
    TimingBody,
    parse_body,
)
from semif_serve.engine.runner import DIRECT_READOUT, SHARED_READOUT, SHARED_SERVING_CONFIG
from semif_serve.http.errors import ErrorEnvelope, ServiceError, error_response, invalid
from semif_serve.service.methods import Ask, Decided, Served
from semif_serve.service.reply_size import (
    FLOAT_BYTES,
    INT_BYTES,
    PREFILL_BYTES,
    SHA256_BYTES,
    TEMPERATURE_MODE_BYTES,
    array_bytes,
    map_bytes,
    object_bytes,
    scalars_bytes,
    text_bytes,
)

PROBABILITY_STATUS = "conditional option score; uncalibrated as decision confidence"
CALIBRATE_PATH = "/calibrate"


# The door's own refusal, outside the core: `model` names no model this door reads.
UNKNOWN_MODEL = ErrorRule(
    422,
    "unknown_model",
    "model",
    when="`model` is no served model or alias, or a lev release (System One only)",
)
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
    WorkloadOfAnotherModel: ErrorRule(
        422,
        "workload_model",
        "workload",
        "decisions[{question}].workload",
        when="`workload` is calibrated on another served model than the one `model` names",
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
    ReplyTooLarge: ErrorRule(
        413,
        "reply_too_large",
        "options",
        "decisions",
        when="the reply, counted before any engine work, is over SEMIF_MAX_REPLY_BYTES; gives the need",
    ),
    Unanswerable: ErrorRule(
        422,
        "validation_error",
        when="the model's method does not read a field of the decision; the message names it",
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


def to_question(body: QuestionBody) -> Question:
    """A validated body's question as the core's domain type."""
    return Question(
        id=body.id,
        text=body.question,
        options=tuple(Option(o.id, o.description) for o in body.options),
        orderings=body.orderings,
        workload=body.workload,
    )


def asked_question(index: int, question: Question) -> AskedQuestion:
    """A decision as the methods read it: a question over its options, its fields named."""
    where = f"decisions[{index}]"
    return AskedQuestion(
        id=question.id,
        type=OPTIONS,
        instructions=question.text,
        criteria=question.options,
        orderings=question.orderings,
        workload=question.workload,
        fields={"type": where, "orderings": f"{where}.orderings", "workload": f"{where}.workload"},
    )


def readouts_of(decided: Decided) -> DecisionOutcome:
    """The per-ordering readouts every native result reports (a method answering questions over
    options gives them)."""
    if decided.outcome is None:
        raise TypeError("a method that answers questions over options gave no readouts")
    return decided.outcome


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
    block = CombinedBody.model_validate({"method": COMBINE_METHOD, **asdict(answer.combined)})
    if answer.calibrated is not None:
        block.calibrated = calibrated_body(answer.calibrated, [o.id for o in question.options])
    result.orderings = natives
    result.combined = block
    return result


# -- the reply's size, counted before it is built ---------------------------------------------------

READOUT_BYTES = max(text_bytes(DIRECT_READOUT), text_bytes(SHARED_READOUT))
TIMING_BYTES = scalars_bytes(TimingBody, {"prefill": PREFILL_BYTES})


def model_bytes(identity: dict[str, str]) -> int:
    """The `model` block of every result (with the shared path's `serving_config`)."""
    info = {**identity, "serving_config": SHARED_SERVING_CONFIG}
    return map_bytes(sum(map(text_bytes, info)), sum(map(text_bytes, info.values())), len(info))


def result_bytes(question: Question, block_bytes: int, *, timed: bool) -> int:
    """At least the bytes of `decision_result` for `question` (`block_bytes`: its `model`
    block's, `model_bytes`; `timed`: with its `timing`): every ordering's result echoes the ids,
    and `combined` and `calibrated` key them again."""
    n = len(question.options)
    ids = [text_bytes(o.id) for o in question.options]
    floats = array_bytes(n * FLOAT_BYTES, n)
    by_id = map_bytes(sum(ids), n * FLOAT_BYTES, n)
    native = {
        "id": text_bytes(question.id),
        "option_ids": array_bytes(sum(ids), n),
        "probabilities": floats,
        "option_logits": floats,
        "input_tokens": INT_BYTES,
        "forward_seconds": FLOAT_BYTES,
        "total_seconds": FLOAT_BYTES,
        "prompt_sha256": SHA256_BYTES,
        "prompt_version": text_bytes(PROMPT_VERSION),
        "model": block_bytes,
        "readout": READOUT_BYTES,
        "probability_status": text_bytes(PROBABILITY_STATUS),
    }
    sizes = dict(native)
    calibrated = {}
    if question.workload is not None:
        calibrated = {
            "workload": text_bytes(question.workload),
            "temperature": FLOAT_BYTES,
            "temperature_mode": TEMPERATURE_MODE_BYTES,
        }
    if question.orderings is None:
        if calibrated:
            sizes["calibrated"] = object_bytes(CalibratedBody, {**calibrated, "probabilities": floats})
    else:
        rows = order_count(n, question.orderings)
        sizes["orderings"] = array_bytes(rows * object_bytes(NativeResult, native), rows)
        combined = {
            "method": text_bytes(COMBINE_METHOD),
            "mode": text_bytes(question.orderings),
            "orderings": INT_BYTES,
            "probabilities": by_id,
            "top": max(ids),
            "agreement": FLOAT_BYTES,
            "spread": FLOAT_BYTES,
        }
        if calibrated:
            combined["calibrated"] = object_bytes(CalibratedBody, {**calibrated, "probabilities": by_id})
        sizes["combined"] = object_bytes(CombinedBody, combined)
    if timed:
        sizes["timing"] = TIMING_BYTES
    return object_bytes(DecisionResult, sizes)


def shared_reply_bytes(questions: Sequence[Question], identity: dict[str, str]) -> int:
    """At least the bytes of `/decide/shared`'s reply to `questions`."""
    block = model_bytes(identity)
    results = [result_bytes(q, block, timed=False) for q in questions]
    return object_bytes(
        SharedResponse, {"results": array_bytes(sum(results), len(results)), "timing": TIMING_BYTES}
    )


@dataclass(frozen=True)
class NativeCall:
    """A validated native body: its state, its questions, the model it names and the count of
    its reply."""

    state: Any
    questions: list[Question]
    model: str | None
    reply_bytes: int


def read_decision(body: bytes, identity: dict[str, str]) -> NativeCall:
    """`/decide`'s body as a call (the route runs this on a worker thread)."""
    decision = parse_body(DecisionBody, body)
    question = to_question(decision)
    need = result_bytes(question, model_bytes(identity), timed=True)
    return NativeCall(decision.state, [question], decision.model, need)


def read_shared(body: bytes, identity: dict[str, str]) -> NativeCall:
    """`/decide/shared`'s body as a call (the route runs this on a worker thread)."""
    shared = parse_body(SharedDecisionsBody, body)
    questions = [to_question(d) for d in shared.decisions]
    return NativeCall(shared.state, questions, shared.model, shared_reply_bytes(questions, identity))


# -- the door -------------------------------------------------------------------------------------


# Fits take turns on one thread of their own: however many arrive, decisions keep the shared pool.
FITS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="semif-calibrate")


class NativeDoor(DecisionDoor):
    """SemIf's native API over the decision core."""

    path_prefix = ""
    protected_paths = frozenset({"/decide", "/decide/shared", CALIBRATE_PATH})
    request_models = (DecisionBody, SharedDecisionsBody, CalibrateBody)
    errors = NATIVE_ERRORS

    def render(self, error: ServiceError, request: Request) -> JSONResponse:
        """The native envelope, with the error's headers and the request id."""
        return error_response(error, getattr(request.state, "request_id", None))

    @property
    def limits(self) -> Limits:
        """SemIf's own bounds: at most 16 options (A..P), the native row and token caps."""
        settings = self.service.settings
        return Limits(
            settings.max_input_tokens,
            MAX_OPTIONS,
            settings.max_rows,
            max_reply_bytes=settings.max_reply_bytes,
        )

    def reader(self, call: NativeCall) -> Served:
        """What reads a call, resolved once: the model it names, else the one its workloads'
        calibration names (several: the base, and the method refuses the mismatch). A name that
        is no served model, or one whose method answers no question over options (a lev release,
        System One only), is a 422 on `model`."""
        models = self.service.models
        if call.model is None:
            named = self.service.calibration.models
            implied = {named[w] for q in call.questions if (w := q.workload) is not None and w in named}
            name = implied.pop() if len(implied) == 1 else None
            return models.base if name is None else models.served[name]
        served = models.resolve(call.model)
        if served is None:
            listed = ", ".join(repr(n) for n in models.names())
            raise ServiceError(
                UNKNOWN_MODEL.status,
                UNKNOWN_MODEL.code,
                f"unknown model {quoted(call.model)}; served: {listed}",
                "model",
            )
        method = served.method
        if OPTIONS not in method.answers:
            raise ServiceError(
                UNKNOWN_MODEL.status,
                UNKNOWN_MODEL.code,
                f"model {quoted(call.model)} is {method.noun}, read with {method.name}'s method: "
                f"ask it on {SYSTEM_ONE_PATH}",
                "model",
            )
        return served

    async def asked(
        self, request: Request, call: NativeCall, *, shared: bool
    ) -> tuple[Decided, dict[str, str]]:
        """A call's outcome, read by the model it names, and its results' `model` block."""
        served = self.reader(call)
        adapter = None if served.is_base else served.name
        ask = Ask(
            served,
            call.state,
            tuple(asked_question(k, q) for k, q in enumerate(call.questions)),
            self.limits,
            shared=shared,
            named=adapter or self.service.engine.model_info["source"],
        )
        decided = await self.ask(request, ask, lambda plan: call.reply_bytes)
        return decided, self.identity(adapter)

    async def decide(self, request: Request, body: bytes) -> DecisionResult:
        """`POST /decide`: one decision; orderings run as one shared batch."""
        call = await asyncio.to_thread(read_decision, body, self.service.engine.model_info)
        decided, identity = await self.asked(request, call, shared=False)
        outcome = readouts_of(decided)
        result = await asyncio.to_thread(decision_result, outcome.questions[0], outcome, identity)
        if outcome.shared:
            result.timing = timing_body(outcome.timing)
        return result

    async def decide_shared(self, request: Request, body: bytes) -> SharedResponse:
        """`POST /decide/shared`: every decision (and ordering) over one state in one batch."""
        call = await asyncio.to_thread(read_shared, body, self.service.engine.model_info)
        decided, identity = await self.asked(request, call, shared=True)
        outcome = readouts_of(decided)
        results = await asyncio.to_thread(
            lambda: [decision_result(q, outcome, identity) for q in outcome.questions]
        )
        return SharedResponse(results=results, timing=timing_body(outcome.timing))

    def identity(self, model: str | None) -> dict[str, str]:
        """The results' `model` block: the base's identity, and the adapter that read them."""
        identity = self.service.engine.model_info
        return identity if model is None else {**identity, "adapter": model}

    async def calibrate(self, request: Request, body: bytes) -> CalibrationReport:
        """`POST /calibrate`: fit the workload's single-read T on labelled rows, with the code
        `semif-serve calibrate` runs (on the one fitting thread: the fit is seconds of CPU work, and
        fits in turn never take the threads every request's parsing runs on)."""
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
        loop = asyncio.get_running_loop()
        report = await loop.run_in_executor(
            FITS, calibration_report, rows, [row.group for row in parsed.rows]
        )
        before, after = await loop.run_in_executor(
            FITS, lambda: (reliability_bins(rows, 1.0), reliability_bins(rows, report["temperature"]))
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
