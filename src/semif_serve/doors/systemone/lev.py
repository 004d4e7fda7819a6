"""System One over a lev model (method "lev"): the request as lev's questions, lev's answers as
System One's, and what a lev model cannot read refused (docs/lev.md).

The question's text goes to lev exactly as the request sent it (lev renders it itself: the
state and descriptions as sorted-key JSON, a structured `instructions` as Python's repr).
`confidence` keeps System One's definition (`domain.answers`), computed from lev's final
probabilities; lev's own statistic (its normalised Gini) is kept in `x_lev.confidence`.
"""

from __future__ import annotations

import asyncio

from fastapi import Request

from semif_serve.domain.answers import choice_confidence, score_confidence
from semif_serve.domain.lev.types import (
    RATING_TEXTS,
    LevAnswer,
    LevChoice,
    LevNoul,
    LevQuestion,
    LevScore,
    ModeBUnavailable,
)
from semif_serve.domain.requests import Limits
from semif_serve.domain.types import DecisionError, ReplyTooLarge
from semif_serve.doors.base import ErrorRule, refusal_of
from semif_serve.doors.systemone.errors import SYSTEMONE_ERRORS
from semif_serve.doors.systemone.mapping import as_text
from semif_serve.doors.systemone.schemas import (
    MAX_OPTIONS,
    AdapterInfo,
    BatchTimingBlock,
    BoxQuestion,
    ChoiceQuestion,
    LevBlock,
    LevChoiceAnswer,
    LevNoulAnswer,
    LevScoreAnswer,
    NoulQuestion,
    ScoreQuestion,
    SystemOneAnswer,
    SystemOneRequest,
    SystemOneResponse,
    Usage,
)
from semif_serve.doors.systemone.schemas import (
    ModelEntry as ModelListing,
)
from semif_serve.doors.systemone.sizes import lev_reply_bytes
from semif_serve.engine.lev_release import LevRelease
from semif_serve.http.errors import ServiceError
from semif_serve.service.lev_core import LevOutcome, LevRequest
from semif_serve.service.models import ModelEntry
from semif_serve.service.records import RequestRecord
from semif_serve.service.startup import Service

# A request a lev model cannot read as lev does is refused, never approximated.
LEV_UNREADABLE = ErrorRule(
    400,
    "api_usage_error",
    when="a lev model is asked what lev does not read: a box, images, `x_orderings` or `x_workload`",
)
LEV_ERRORS: dict[type[DecisionError], ErrorRule] = {
    **SYSTEMONE_ERRORS,
    ModeBUnavailable: ErrorRule(
        400,
        "api_usage_error",
        when="a question lev routes to its candidate head (past the single-token codes or the "
        "label cap) on a release without `mode_b_head.pt`",
    ),
}
# SemIf's per-question extensions: a lev model has its own orders and calibration.
SEMIF_ONLY_FIELDS = ("x_orderings", "x_workload")


def unreadable(field: str, why: str) -> ServiceError:
    """The door's 400 for a request a lev model cannot read, naming the field."""
    return ServiceError(LEV_UNREADABLE.status, LEV_UNREADABLE.code, f"{field}: {why}", field)


def lev_questions(parsed: SystemOneRequest, model: str) -> dict[str, LevQuestion]:
    """The request's questions as lev's, in its order; refuses images, a box, and SemIf's
    `x_orderings` / `x_workload`, naming the field."""
    if parsed.assets:
        raise unreadable("assets", f"the lev model {model!r} reads text only (lev's method reads no image)")
    questions: dict[str, LevQuestion] = {}
    for qid, body in parsed.questions.items():
        where = f"questions.{qid}"
        if isinstance(body, BoxQuestion):
            raise unreadable(
                f"{where}.type", f"the lev model {model!r} answers noul, choice and score, not box"
            )
        for name in SEMIF_ONLY_FIELDS:
            if getattr(body, name) is not None:
                raise unreadable(
                    f"{where}.{name}",
                    f"SemIf's {name} does not apply to the lev model {model!r}, which reads its "
                    "release's own orders and calibration",
                )
        questions[qid] = to_lev(body)
    return questions


def to_lev(body: NoulQuestion | ChoiceQuestion | ScoreQuestion) -> LevQuestion:
    """One System One question as lev's, its text as sent (lev renders it)."""
    if isinstance(body, NoulQuestion):
        criteria = None if body.criteria is None else body.criteria.model_dump(exclude_unset=True)
        return LevNoul(instructions=body.instructions, criteria=criteria)
    if isinstance(body, ChoiceQuestion):
        return LevChoice(criteria=dict(body.criteria), instructions=body.instructions)
    return LevScore(criteria=tuple(body.criteria), instructions=body.instructions)


def lev_block(answer: LevAnswer) -> LevBlock:
    """`x_lev`: how lev read the answer, and its own confidence."""
    return LevBlock(
        mode=answer.mode,
        bucket=answer.bucket,
        temperature=answer.temperature,
        orders=answer.orders,
        confidence=answer.lev_confidence,
        distribution=dict(zip(answer.names, answer.distribution, strict=True)),
    )


def lev_answer(
    body: NoulQuestion | ChoiceQuestion | ScoreQuestion, answer: LevAnswer
) -> LevNoulAnswer | LevChoiceAnswer | LevScoreAnswer:
    """One System One answer from lev's: its value, and System One's confidence of its
    distribution (`domain.answers`, as the SemIf path computes it); a noul, which System One
    gives no confidence, carries lev's own and its rating levels, as lev's server sends them."""
    probs = answer.distribution
    if isinstance(body, NoulQuestion):
        rated = answer.probabilities
        levels = None if rated is None else dict(zip(RATING_TEXTS, rated, strict=True))
        return LevNoulAnswer(
            type="noul",
            noul=float(answer.value),
            probabilities=levels,
            confidence=answer.lev_confidence,
            x_lev=lev_block(answer),
        )
    if isinstance(body, ChoiceQuestion):
        return LevChoiceAnswer(
            type="choice",
            choice=str(answer.value),
            probabilities=dict(zip(body.criteria, probs, strict=True)),
            confidence=choice_confidence(probs),
            x_lev=lev_block(answer),
        )
    return LevScoreAnswer(
        type="score",
        score=float(answer.value),
        legend={str(i): as_text(level) for i, level in enumerate(body.criteria)},
        probabilities={str(i): p for i, p in enumerate(probs)},
        confidence=score_confidence(probs),
        x_lev=lev_block(answer),
    )


def lev_timing(outcome: LevOutcome) -> BatchTimingBlock:
    """`x_timing` of a lev request: how the batcher ran its rows (the prefix once with every row
    over it, or each row whole), and its engine seconds."""
    timing = outcome.reply.timing
    return BatchTimingBlock(
        **timing.as_dict(), forward_seconds=outcome.engine_seconds, total_seconds=outcome.engine_seconds
    )


async def answer_lev(
    service: Service, request: Request, parsed: SystemOneRequest, entry: ModelEntry, limits: Limits
) -> SystemOneResponse:
    """`POST /v1/systemone` for the lev model `entry`: lev's answers under System One's names,
    `usage.input_tokens` as lev counts it (the prefix once, plus every row's suffix)."""
    questions = lev_questions(parsed, entry.name)
    need = await asyncio.to_thread(lev_reply_bytes, parsed.questions, entry.name)
    if limits.max_reply_bytes is not None and need > limits.max_reply_bytes:  # before any engine work
        remedy = "ask fewer questions or options, shorten the names, or split it across requests"
        raise refusal_of(LEV_ERRORS, ReplyTooLarge(need, limits.max_reply_bytes, remedy), True, [])
    try:
        outcome = await service.lev.decide(LevRequest(entry.name, parsed.state, questions, limits))
    except DecisionError as exc:
        named = () if isinstance(exc, ModeBUnavailable) else list(questions)  # its message names it
        raise refusal_of(LEV_ERRORS, exc, True, named) from None
    reply = outcome.reply
    request.state.record = RequestRecord.of_lev(outcome, entry.name)
    answers: dict[str, SystemOneAnswer] = {
        qid: lev_answer(body, reply.answers[qid])  # type: ignore[arg-type]  # boxes refused above
        for qid, body in parsed.questions.items()
    }
    return SystemOneResponse(
        model=entry.name,
        answers=answers,
        usage=Usage(
            input_tokens=reply.input_tokens, output_tokens=0, cached_input_tokens=reply.cached_input_tokens
        ),
        x_timing=lev_timing(outcome),
    )


def lev_listing(
    release: LevRelease, adapter: AdapterInfo | None, name: str, base: str, release_date: str
) -> ModelListing:
    """`/v1/models`' entry of a lev release: method `lev`, its adapter as the engine serves it
    (the factor on B(A(x)) with the serving scale in it; None for the frozen base), the serving
    scale, and its calibration buckets."""
    what = "the frozen base" if release.frozen_base else f"the lev release {release.name!r} over {base}"
    return ModelListing(
        name=name,
        description=f"{name}: {what}, read by lev's method (its "
        f"{release.options.prompt_style} prompt, label codes, orders and calibration; docs/lev.md); "
        f"candidate head: {'yes' if release.head is not None else 'no'}.",
        release_date=release_date,
        x_method="lev",
        x_max_options=MAX_OPTIONS,
        x_reads_images=False,
        x_adapter=adapter,
        x_scale=release.adapter_scale,
        x_calibration=sorted(release.calibration.temperatures),
    )
