"""Asking the service below its doors, as a door does: the core's questions (the native door's
questions over options) over a state, through `Service.decide` and the method of the model
named (the base's where none is), with a door's limits."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from semif_serve.domain.images import ImageAsset
from semif_serve.domain.requests import OPTIONS, AskedQuestion, Limits
from semif_serve.domain.types import DecisionOutcome, Question
from semif_serve.service.methods import Ask, Decided
from semif_serve.service.startup import Service


def asked(question: Question) -> AskedQuestion:
    """A core question as the native door asks it: over its options, in its orderings."""
    return AskedQuestion(
        question.id, OPTIONS, question.text, question.options, question.orderings, question.workload
    )


def ask_of(
    service: Service,
    state: Any,
    questions: Sequence[Question],
    limits: Limits,
    *,
    shared: bool = False,
    model: str | None = None,
    images: Sequence[ImageAsset] = (),
) -> Ask:
    """The call of `questions` over `state` read by `model` (None: the base)."""
    served = service.models.base if model is None else service.models.resolve(model)
    assert served is not None, f"{model!r} is not served"
    return Ask(served, state, tuple(asked(q) for q in questions), limits, shared=shared, images=tuple(images))


async def decided(
    service: Service, state: Any, questions: Sequence[Question], limits: Limits, **kw: Any
) -> Decided:
    """`Service.decide` of the call `ask_of` makes."""
    return await service.decide(ask_of(service, state, questions, limits, **kw))


async def outcome(
    service: Service, state: Any, questions: Sequence[Question], limits: Limits, **kw: Any
) -> DecisionOutcome:
    """The per-ordering readouts of the call `ask_of` makes (SemIf's outcome)."""
    answer = await decided(service, state, questions, limits, **kw)
    assert answer.outcome is not None
    return answer.outcome


def outcome_now(
    service: Service, state: Any, questions: Sequence[Question], limits: Limits, **kw: Any
) -> DecisionOutcome:
    """`outcome`, run to its end here."""
    return asyncio.run(outcome(service, state, questions, limits, **kw))
