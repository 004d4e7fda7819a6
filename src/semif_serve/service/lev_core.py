"""lev releases served by name: every `method = "lev"` model of SEMIF_MODELS, read at startup over
the base the engine holds, and answered on the engine thread (never beside another forward).

`load_lev_releases` reads each release with `engine.lev_release.load_lev_release` (the entry's
lev options, its `scale` over the manifest's `adapter_scale`) and places its adapter on the
base's device, so the memory baseline counts it; an unreadable release stops startup with the
SEMIF_MODELS file and key named, and the release's own file and key. `LevCore.decide` checks a
request against the door's limits off the engine thread, then runs `score_lev_on` (the engine's
batched rows, the release's adapter in its bank) through the worker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from semif_serve.domain.lev import LevPlan, LevQuestion, LevReleaseError, plan_request
from semif_serve.domain.requests import Limits
from semif_serve.domain.types import ConfigurationError, TooManyRows, TooManyTokens
from semif_serve.engine.adapters import BASE
from semif_serve.engine.lev_release import (
    LevRelease,
    LevReply,
    base_release,
    load_lev_release,
    score_lev_on,
    served_release,
)
from semif_serve.service.models import LEV, ModelSet

if TYPE_CHECKING:
    from pathlib import Path

    from semif_serve.engine.runner import TorchEngine
    from semif_serve.engine.worker import EngineWorker


def load_lev_releases(
    models: ModelSet, engine: TorchEngine, base_name: str, base_directory: Path
) -> dict[str, LevRelease]:
    """Every lev model of `models` by name, read over `engine`'s base (`base_name`, the name a
    release's `base_model` must give unless its entry vouches for another with `base_model`)."""
    releases: dict[str, LevRelease] = {}
    for entry in models.models.values():
        if entry.method != LEV:
            continue
        key = f"models.{entry.name}"
        where = f"SEMIF_MODELS: {models.source}: {key}"
        options = entry.lev_options
        flags: dict[str, Any] = {
            "prompt_style": options.get("prompt_style"),
            "noul_readout": options.get("noul_readout"),
            "score_order_average": options.get("score_order_average", "off"),
            "max_label_options": entry.max_label_options,
            "settings_source": where,
        }
        try:
            if entry.release is None:  # the frozen base, read with lev's method
                tokenizer = engine.codec.tokenizer
                releases[entry.name] = base_release(base_directory, tokenizer, base_name=base_name, **flags)
                continue
            release = load_lev_release(
                entry.release,
                engine.model,
                engine.codec.tokenizer,
                base_name=entry.base_model or base_name,
                base_directory=base_directory,
                adapter_scale=entry.scale,
                **flags,
            )
        except LevReleaseError as exc:
            # A setting of the entry names its own key; a release file names the release key too.
            if exc.file == where:
                raise ConfigurationError(f"{where}.{exc.key}: {exc.problem}") from None
            raise ConfigurationError(f"{where}.release: {exc}") from None
        releases[entry.name] = served_release(release, engine.model)
    return releases


@dataclass(frozen=True)
class LevOutcome:
    """One request's answers with one release, and how it ran on the engine thread."""

    reply: LevReply
    rows: int  # forward rows: each question in each of its orders
    engine_seconds: float  # score_lev_on on the engine thread
    wait_seconds: float  # the wait for the engine thread before it started


@dataclass(frozen=True)
class LevCore:
    """The lev releases the service serves, by model name, and the worker whose engine thread
    runs them. Empty (no release, no worker) where SEMIF_MODELS declares no lev model."""

    releases: Mapping[str, LevRelease] = field(default_factory=dict)
    worker: EngineWorker | None = None

    def release(self, model_name: str) -> LevRelease:
        """The release served as `model_name` (a LookupError names a model that is not one)."""
        release = self.releases.get(model_name)
        if release is None or self.worker is None:
            raise LookupError(f"{model_name!r} is not a lev model of this service")
        return release

    def check(
        self, model_name: str, state: Any, questions: Mapping[str, LevQuestion], limits: Limits | None
    ) -> LevPlan:
        """The request's plan, refused before any forward: Mode B without a head
        (ModeBUnavailable), more rows than `limits.max_rows` (TooManyRows), a row's prompt over
        `max_input_tokens` or the request over `max_request_tokens` (TooManyTokens)."""
        release = self.release(model_name)
        plan = plan_request(
            state, questions, release.codes, release.options, has_head=release.head is not None
        )
        if limits is None:
            return plan
        if len(plan.rows) > limits.max_rows:
            raise TooManyRows(len(plan.rows), limits.max_rows)
        tokenizer = release.tokenizer
        prefix = len(tokenizer.encode(plan.prefix, add_special_tokens=True))
        total = prefix
        positions = {qid: i for i, qid in enumerate(questions)}
        for counted, row in enumerate(plan.rows, start=1):
            suffix = len(tokenizer.encode(row.suffix, add_special_tokens=False))
            if prefix + suffix > limits.max_input_tokens:
                raise TooManyTokens(prefix + suffix, limits.max_input_tokens, positions[row.question_id])
            total += suffix
            budget = limits.max_request_tokens
            if budget is not None and total > budget:
                raise TooManyTokens.for_request(total, budget, counted, len(plan.rows))
        return plan

    async def decide(
        self,
        model_name: str,
        state: Any,
        questions: Mapping[str, LevQuestion],
        limits: Limits | None = None,
    ) -> LevOutcome:
        """Answer `questions` about `state` with the release `model_name`, exactly as lev does:
        checked off the event loop, then `score_lev_on` on the engine thread through the worker
        (so it never runs beside another forward): the prefix once, the rows batched over it.
        Raises the refusals of `check`, and the worker's OutOfMemory or EngineFailure."""
        release = self.release(model_name)
        assert self.worker is not None  # release() refuses a core without one
        plan = await asyncio.to_thread(self.check, model_name, state, questions, limits)
        engine = self.worker.engine
        submitted = time.perf_counter()

        def job() -> tuple[LevReply, float, float]:
            started = time.perf_counter()
            model = BASE if release.frozen_base else engine.adapters.index(model_name)
            reply = score_lev_on(release, engine, model, state, questions)
            return reply, time.perf_counter() - started, started - submitted

        reply, seconds, waited = await self.worker.run(job)
        return LevOutcome(reply, len(plan.rows), seconds, waited)
