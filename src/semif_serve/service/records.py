"""What an answered call leaves for the request log line, the metrics and the trace, built one way
for every method and model (`RequestRecord.of_run`): SemIf's outcomes (`of`) and lev's (`of_lev`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from semif_serve.domain.requests import DecisionRequest
from semif_serve.domain.types import BatchTiming, EngineWait
from semif_serve.service.core import DecisionOutcome
from semif_serve.service.lev_core import LevOutcome

SEMIF_METHOD = "semif"
LEV_METHOD = "lev"
# Record fields that never reach the log line: the metrics' and traces' own.
UNLOGGED = ("workloads", "stages", "adapter")


@dataclass(frozen=True)
class EngineStages:
    """The stages the engine measured for one call, in the order they ran, and when its outcome
    reached the door (`time.perf_counter()`): what a trace lays out as spans, never logged."""

    encode_seconds: float
    wait_seconds: float
    prefill_seconds: float
    forward_seconds: float  # the forwards after the prefill (the state's copies and the suffixes)
    finished: float

    @classmethod
    def of(cls, encode: float, wait: EngineWait, timing: BatchTiming, forward_seconds: float) -> EngineStages:
        """The stages of a call that encoded for `encode` seconds, waited `wait` and ran its
        forwards (`forward_seconds` in all, its prefill's in `timing`), finished now."""
        prefill = timing.prefill_seconds
        return cls(
            encode_seconds=max(encode, 0.0),
            wait_seconds=wait.seconds,
            prefill_seconds=prefill,
            forward_seconds=max(forward_seconds - prefill, 0.0),
            finished=time.perf_counter(),
        )


@dataclass(frozen=True)
class RequestRecord:
    """What the request log line and the metrics keep of an answered call (no text, no token)."""

    rows: int
    input_tokens: int
    forward_seconds: float
    engine_seconds: float
    decision_method: str  # the method that read it ("semif", "lev"); `method` is the HTTP method's
    prefix_tokens: int | None = None  # None on the direct path
    forward_batches: int | None = None
    merged_requests: int | None = None
    prefill: str | None = None
    workloads: tuple[str, ...] = ()
    images: int | None = None  # images the request showed the model (None: text only)
    wait_seconds: float = 0.0  # its wait for the engine before its first forward
    model: str | None = None  # the model's name as the reply gives it
    adapter: str | None = None  # the served model over the base that read it (None: the base); metrics
    stages: EngineStages | None = None  # for traces; not a log field

    @classmethod
    def of_run(
        cls,
        *,
        method: str,
        rows: int,
        input_tokens: int,
        forward_seconds: float,
        engine_seconds: float,
        timing: BatchTiming | None,
        wait: EngineWait,
        model: str | None,
        adapter: str | None,
        stages: EngineStages | None,
        workloads: Sequence[str] = (),
        images: int = 0,
    ) -> RequestRecord:
        """The record of one answered call whatever read it (`timing` None: a lone row's path,
        which is not a batch)."""
        return cls(
            rows=rows,
            input_tokens=input_tokens,
            forward_seconds=round(forward_seconds, 6),
            engine_seconds=round(engine_seconds, 6),
            decision_method=method,
            prefix_tokens=timing.prefix_tokens if timing else None,
            forward_batches=timing.forward_batches if timing else None,
            merged_requests=timing.merged_requests if timing else None,
            prefill=timing.prefill if timing else None,
            workloads=tuple(sorted(set(workloads))),
            images=images or None,
            wait_seconds=round(wait.seconds, 6),
            model=model,
            adapter=adapter,
            stages=stages,
        )

    @classmethod
    def of(cls, outcome: DecisionOutcome, asked: DecisionRequest) -> RequestRecord:
        """The record of a call SemIf's method answered (`asked`: the call, its model and images)."""
        readouts = [r for q in outcome.questions for r in q.readouts]
        return cls.of_run(
            method=SEMIF_METHOD,
            rows=len(readouts),
            input_tokens=sum(r.input_tokens for r in readouts),
            forward_seconds=outcome.forward_seconds,
            engine_seconds=outcome.total_seconds,
            timing=outcome.timing if outcome.shared else None,
            wait=outcome.wait,
            model=asked.served_as,
            adapter=asked.model,
            stages=EngineStages.of(
                outcome.total_seconds - outcome.forward_seconds,
                outcome.wait,
                outcome.timing,
                outcome.forward_seconds,
            ),
            workloads=[q.question.workload for q in outcome.questions if q.question.workload],
            images=len(asked.images),
        )

    @classmethod
    def of_lev(cls, outcome: LevOutcome, model: str) -> RequestRecord:
        """The record of a call lev's method answered as the served model `model` (counted under
        its own name, the frozen base read by lev's method included)."""
        timing = outcome.reply.timing
        return cls.of_run(
            method=LEV_METHOD,
            rows=outcome.rows,
            input_tokens=outcome.reply.input_tokens,
            forward_seconds=outcome.engine_seconds,
            engine_seconds=outcome.engine_seconds + outcome.encode_seconds,
            timing=timing,
            wait=outcome.wait,
            model=model,
            adapter=model,
            stages=EngineStages.of(outcome.encode_seconds, outcome.wait, timing, outcome.engine_seconds),
        )

    def log_fields(self) -> dict[str, Any]:
        """The fields of the request's JSON log line (those that apply to this call)."""
        fields = {k: v for k, v in asdict(self).items() if v is not None and k not in UNLOGGED}
        if self.workloads:
            fields["workloads"] = list(self.workloads)
        return fields
