"""lev releases served by name: every `method = "lev"` model of SEMIF_MODELS, read at startup over
the base the engine holds, and answered on the engine thread (never beside another forward).

`load_lev_releases` reads each release with `engine.lev_release.load_lev_release` (the entry's
lev options, its `scale` over the manifest's `adapter_scale`) and places its adapter on the
base's device, so the memory baseline counts it; an unreadable release stops startup with the
SEMIF_MODELS file and key named, and the release's own file and key. `LevCore.decide` renders
and encodes a request once and checks it against the door's limits off the engine thread; its
label rows (Mode A) are then jobs of the worker's batcher like SemIf's rows (the same bounds,
stepped prefill, state cache under the release's model, demand, forward counts), merged with
whatever else is queued; rows read by the candidate head (Mode B) run on the engine thread
through `read_ids`.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from semif_serve.domain.lev import LevPlan, LevQuestion, LevReleaseError, plan_request, read_plan
from semif_serve.domain.requests import Limits
from semif_serve.domain.types import ConfigurationError, TooManyRows, TooManyTokens
from semif_serve.engine.adapters import BASE
from semif_serve.engine.lev_release import (
    LevRelease,
    LevReply,
    base_release,
    head_scores,
    joined,
    load_lev_release,
    served_release,
)
from semif_serve.engine.state_cache import state_digest
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
    engine_seconds: float  # the rows' forwards on the engine thread
    wait_seconds: float  # the wait for the engine before its first forward


@dataclass(frozen=True)
class LevRows:
    """A request's plan, encoded once: lev's prefix ids (with special tokens) and each row's
    suffix ids (without), as lev's server joins them."""

    plan: LevPlan
    prefix_ids: list[int]
    suffixes: list[list[int]]


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
    ) -> LevRows:
        """The request's plan and ids, refused before any forward: Mode B without a head
        (ModeBUnavailable), more rows than `limits.max_rows` (TooManyRows), a row's prompt over
        `max_input_tokens` or the request over `max_request_tokens` (TooManyTokens)."""
        release = self.release(model_name)
        plan = plan_request(
            state, questions, release.codes, release.options, has_head=release.head is not None
        )
        if limits is not None and len(plan.rows) > limits.max_rows:
            raise TooManyRows(len(plan.rows), limits.max_rows)
        tokenizer = release.tokenizer
        prefix_ids = tokenizer.encode(plan.prefix, add_special_tokens=True)
        suffixes: list[list[int]] = []
        total = len(prefix_ids)
        positions = {qid: i for i, qid in enumerate(questions)}
        for counted, row in enumerate(plan.rows, start=1):
            suffixes.append(tokenizer.encode(row.suffix, add_special_tokens=False))
            if limits is None:
                continue
            tokens = len(prefix_ids) + len(suffixes[-1])
            if tokens > limits.max_input_tokens:
                raise TooManyTokens(tokens, limits.max_input_tokens, positions[row.question_id])
            total += len(suffixes[-1])
            budget = limits.max_request_tokens
            if budget is not None and total > budget:
                raise TooManyTokens.for_request(total, budget, counted, len(plan.rows))
        return LevRows(plan, prefix_ids, suffixes)

    async def decide(
        self,
        model_name: str,
        state: Any,
        questions: Mapping[str, LevQuestion],
        limits: Limits | None = None,
    ) -> LevOutcome:
        """Answer `questions` about `state` with the release `model_name`, exactly as lev does:
        rendered, encoded and checked off the event loop; the label rows as one job of the
        worker's batcher (merged with other requests' rows, the prefix prefilled once where it
        pays), the head's rows on the engine thread. Raises the refusals of `check`, and the
        worker's OutOfMemory or EngineFailure."""
        release = self.release(model_name)
        assert self.worker is not None  # release() refuses a core without one
        started = time.perf_counter()
        rows = await asyncio.to_thread(self.check, model_name, state, questions, limits)
        encoded = time.perf_counter() - started
        engine = self.worker.engine
        model = BASE if release.frozen_base else engine.adapters.index(model_name)
        plan = rows.plan
        scores: list[list[float]] = [[] for _ in plan.rows]
        by_labels = [i for i, row in enumerate(plan.rows) if row.label_ids is not None]
        by_head = [i for i, row in enumerate(plan.rows) if row.label_ids is None]
        runs = []
        engine_seconds = wait_seconds = 0.0
        if by_labels:
            prepare = functools.partial(
                engine.prepare_ids,
                rows.prefix_ids,
                [rows.suffixes[i] for i in by_labels],
                [plan.rows[i].label_ids or () for i in by_labels],
                model,
                encoded,
            )
            readout = await self.worker.score_prepared(state_digest(state, (), model_name), prepare)
            for k, i in enumerate(by_labels):
                scores[i] = readout.rows[k].option_logits
            runs.append(readout.timing)
            engine_seconds += readout.forward_seconds
            wait_seconds += readout.wait.behind_requests_seconds + readout.wait.behind_idle_seconds
        if by_head:
            submitted = time.perf_counter()

            def heads() -> tuple[list[list[float]], float, float]:
                began = time.perf_counter()
                got = head_scores(release, engine, model, plan, rows.prefix_ids, rows.suffixes, by_head, runs)
                return got, time.perf_counter() - began, began - submitted

            got, seconds, waited = await self.worker.run(heads)
            for i, row_scores in zip(by_head, got, strict=True):
                scores[i] = row_scores
            engine_seconds += seconds
            wait_seconds += waited
        answers = read_plan(plan, scores, release.calibration)
        input_tokens = len(rows.prefix_ids) + sum(len(s) for s in rows.suffixes)
        reply = LevReply(answers, input_tokens, len(rows.prefix_ids), joined(runs))
        return LevOutcome(reply, len(plan.rows), engine_seconds, wait_seconds)
