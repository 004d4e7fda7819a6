"""One call through whichever method reads it: the same checks, bounds, batcher, cache and
failure handling for every method and model (`Decisions.decide`).

The method plans the call's rows off the event loop (refusing before any forward), the door's
count of the reply is held to its budget, the rows run as jobs of the one batcher (a refused or
cancelled job takes its siblings with it: no orphan forwards), and the method reads the answers
off the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from semif_serve.domain.types import DecisionError, NotRead, ReplyTooLarge
from semif_serve.engine.worker import EngineWorker
from semif_serve.service.methods import Ask, Decided

# The door's count of its reply, from the method's plan (None: the door counted it before).
ReplyCount = Callable[[Any], int]


def human_list(items: tuple[str, ...] | list[str]) -> str:
    """`a, b and c`."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def refuse_unread(ask: Ask, images: bool | None = None) -> None:
    """Refuse what the method of `ask.served` does not read, naming the field as the door calls it:
    images (`images`: whether the request has any, where they are not read yet), then each
    question's type; before anything is decoded or rendered."""
    method = ask.served.method
    name = ask.served.name
    if (bool(ask.images) if images is None else images) and not method.images:
        raise NotRead(
            ask.fields.get("images", "images"),
            f"the {method.name} model {name!r} reads text only ({method.name}'s method reads no image)",
        )
    for question in ask.questions:
        if question.type not in method.answers:
            raise NotRead(
                question.fields.get("type", "type"),
                f"the {method.name} model {name!r} answers {human_list(list(method.answers))}, "
                f"not {question.type}",
            )


@dataclass(frozen=True)
class Decisions:
    """Calls answered through the worker's batcher over its engine."""

    worker: EngineWorker

    async def decide(self, ask: Ask, reply_bytes: ReplyCount | None = None) -> Decided:
        """Answer `ask` with its model's method. Raises the `DecisionError`s of the method's plan
        (placed at the question by its position in `ask.questions`), `ReplyTooLarge` where the
        door's count of the reply (`reply_bytes`, from the plan) passes `ask.limits`'s budget,
        and the worker's OutOfMemory or EngineFailure."""
        method = ask.served.method
        refuse_unread(ask)
        plan = await asyncio.to_thread(method.plan, ask)
        budget = ask.limits.max_reply_bytes
        if budget is not None and reply_bytes is not None:
            need = await asyncio.to_thread(reply_bytes, plan)
            if need > budget:
                raise ReplyTooLarge(need, budget, method.reply_remedy())
        jobs = method.jobs(plan, self.worker.engine)
        tasks = [asyncio.ensure_future(self.worker.score_job(job)) for job in jobs]
        try:
            readouts = await asyncio.gather(*tasks)
        except DecisionError as exc:
            for task in tasks:
                task.cancel()
            raise method.located(plan, exc) from None
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        return await asyncio.to_thread(method.outcome, plan, readouts)
