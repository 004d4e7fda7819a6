"""What an answered call leaves for the request log line, the metrics and the trace, built one way
for every method and model (`RequestRecord.of`, from a method's `Decided` and the call)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from semif_serve.service.methods import EngineStages

if TYPE_CHECKING:
    from semif_serve.service.methods import Ask, Decided

# Record fields that never reach the log line: the metrics' and traces' own.
UNLOGGED = ("workloads", "stages", "adapter")


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
    def of(cls, decided: Decided, ask: Ask) -> RequestRecord:
        """The record of one answered call, whatever method read it: counted under the served
        model's name (the base: None, as `(base)`), the model named as the reply names it."""
        served = ask.served
        batch = decided.batch
        return cls(
            rows=decided.rows,
            input_tokens=decided.counted_tokens,
            forward_seconds=round(decided.forward_seconds, 6),
            engine_seconds=round(decided.engine_seconds, 6),
            decision_method=served.method.name,
            prefix_tokens=batch.prefix_tokens if batch else None,
            forward_batches=batch.forward_batches if batch else None,
            merged_requests=batch.merged_requests if batch else None,
            prefill=batch.prefill if batch else None,
            workloads=tuple(sorted(set(decided.workloads))),
            images=len(ask.images) or None,
            wait_seconds=round(decided.wait.seconds, 6),
            model=ask.named or served.name,
            adapter=None if served.is_base else served.name,
            stages=decided.stages,
        )

    def log_fields(self) -> dict[str, Any]:
        """The fields of the request's JSON log line (those that apply to this call)."""
        fields = {k: v for k, v in asdict(self).items() if v is not None and k not in UNLOGGED}
        if self.workloads:
            fields["workloads"] = list(self.workloads)
        return fields
