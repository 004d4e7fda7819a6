"""A decision method is a plug-in: what the service, the doors, the records and the limits know of
one, and the registry that names them.

A method reads a served model's questions its own way: it renders them as rows (`plan`), hands
the rows to the one batcher as jobs (`jobs`), and reads the answers from their readouts
(`outcome`), each answer in the one shape of its type (`TypedAnswer`: the type's own fields, and
the method's block, `x_<name>`). Nothing above a method names one: a request's model is resolved
once (`service.served.ServedModels.resolve` -> `Served`, carrying its method), and
`Service.decide` runs any method's plan the same way, under the same bounds, cache, batching,
metrics and logs (docs/architecture.md, "Where to add a method").

SemIf's method (`service.methods.semif`) and lev's (`service.methods.lev`) are built in; an
operator adds one with SEMIF_METHODS (`module:attribute`, the class), and SEMIF_MODELS' `method`
key serves a model with it.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from semif_serve.domain.calibration import CalibrationTable
from semif_serve.domain.images import ImageAsset
from semif_serve.domain.requests import AskedQuestion, Defaults, Limits
from semif_serve.domain.types import (
    BatchTiming,
    ConfigurationError,
    DecisionError,
    DecisionOutcome,
    EngineWait,
)

if TYPE_CHECKING:
    from semif_serve.engine.rows import Readout, RowsJob
    from semif_serve.engine.runner import TorchEngine
    from semif_serve.service.models import EntryPlace, ModelEntry
    from semif_serve.service.settings import Settings


@dataclass(frozen=True)
class Served:
    """A served model as a request resolved it, once: its name (the base's is
    `<source>@<revision>`), the method that reads it, the adapter bank's index its rows read
    (`domain.requests.BASE`: the base weights alone), its SEMIF_MODELS entry, and whether it is
    the base itself."""

    name: str
    method: DecisionMethod
    adapter: int
    entry: ModelEntry
    is_base: bool = False


@dataclass(frozen=True)
class Ask:
    """One call from any door, for the method of `served`: the state, the questions in the
    caller's order, the door's limits, images (each with its placeholder), whether the route asks
    many questions over one state (`shared`), the door's defaults for questions that name no
    orderings or workload, the name the reply gives the model (`named`), and request-wide fields
    as the door names them (`images`)."""

    served: Served
    state: Any
    questions: tuple[AskedQuestion, ...]
    limits: Limits
    shared: bool = False
    images: tuple[ImageAsset, ...] = ()
    defaults: Defaults = Defaults()
    named: str | None = None
    fields: Mapping[str, str] = field(default_factory=dict)


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
class TypedAnswer:
    """One answer in the one shape of its type, whatever method read it: the type's own fields
    (`noul`; `choice`, `probabilities`, `confidence`; `score`, `legend`, ...; `box`, `confidence`,
    `x_edges`), and the method's block, sent as `x_<method>` (None: none)."""

    type: str
    fields: Mapping[str, Any]
    block: Any = None


@dataclass(frozen=True)
class Decided:
    """A method's outcome of one call.

    `answers`: each typed question's answer, in order (None for the native door's questions);
    `outcome`: the per-ordering readouts the native door reports (None where the method has
    none); `input_tokens` / `cached_input_tokens`: the reply's usage; `timing`,
    `forward_seconds`, `total_seconds`: its `x_timing`; the rest is what the record keeps."""

    answers: tuple[TypedAnswer, ...] | None
    outcome: DecisionOutcome | None
    input_tokens: int
    timing: BatchTiming
    forward_seconds: float
    total_seconds: float
    rows: int
    counted_tokens: int  # the record's input tokens (every row's whole prompt, or the method's own count)
    engine_seconds: float
    wait: EngineWait
    stages: EngineStages
    batch: BatchTiming | None  # the record's batch fields (None: a lone row's path)
    cached_input_tokens: int | None = None
    workloads: tuple[str, ...] = ()


def one_read(run: Any) -> dict[str, Any]:
    """The fields of a `Decided` that say how a call read in one job ran (its `Readout`, or an
    outcome carrying its numbers): the timing, forward, total and engine seconds, wait, stages."""
    return {
        "timing": run.timing,
        "forward_seconds": run.forward_seconds,
        "total_seconds": run.total_seconds,
        "engine_seconds": run.total_seconds,
        "wait": run.wait,
        "stages": EngineStages.of(
            run.total_seconds - run.forward_seconds, run.wait, run.timing, run.forward_seconds
        ),
    }


@dataclass(frozen=True)
class MethodStart:
    """What a method is started with: the engine (its adapter bank open to the method's entries),
    the settings, the calibration table, and the base's served name."""

    engine: TorchEngine
    settings: Settings
    calibration: CalibrationTable
    base_name: str
    models_file: Path | None


class DecisionMethod(Protocol):
    """A decision method, started over the engine with the models it serves.

    The class declares `name` (SEMIF_MODELS' `method`, /v1/models' `x_method`, the log's
    `decision_method`), the question types it `answers` (`domain.requests.QUESTION_TYPES`),
    whether it reads `images` and the calibration file's `workloads`, `noun` (how a refusal
    calls one of its models), the SEMIF_MODELS keys it `claims` (an entry setting one is its
    without naming it), `read_entry` and `start`. An instance plans, runs and reads calls,
    raising nothing but `DecisionError`s."""

    name: ClassVar[str]
    answers: ClassVar[tuple[str, ...]]
    images: ClassVar[bool]
    workloads: ClassVar[bool]
    noun: ClassVar[str]
    claims: ClassVar[tuple[str, ...]]

    @classmethod
    def read_entry(cls, name: str, table: Mapping[str, Any], place: EntryPlace) -> ModelEntry:
        """The SEMIF_MODELS entry `name` of this method from its `table`, every key checked
        (`place` names the file and key in a refusal, and reads paths)."""
        ...

    @classmethod
    def start(cls, entries: Sequence[ModelEntry], context: MethodStart) -> DecisionMethod:
        """The method serving `entries` (its models of SEMIF_MODELS, the base's first where it
        reads the base), each loaded over `context.engine` (an adapter into its bank); a model
        that cannot be served raises ConfigurationError naming the file and key."""
        ...

    def rows_for(self, asked: AskedQuestion, options: int, defaults: Defaults) -> int:
        """At least the rows a question of `options` options needs (the door's screen of a body
        before it is validated; the plan counts them exactly)."""
        ...

    def plan(self, ask: Ask) -> Any:
        """The call's rows and counts, refused before any forward (`DecisionError`s naming the
        question by its position in `ask.questions`); run off the event loop."""
        ...

    def jobs(self, plan: Any, engine: TorchEngine) -> list[RowsJob]:
        """The plan's rows as the batcher's jobs over `engine`."""
        ...

    def outcome(self, plan: Any, readouts: Sequence[Readout]) -> Decided:
        """The call's answers from its jobs' readouts (in `jobs`' order); run off the event loop."""
        ...

    def located(self, plan: Any, error: DecisionError) -> DecisionError:
        """An engine refusal of one of the plan's rows, placed at its question."""
        ...

    def answer_sizes(self, plan: Any, index: int) -> dict[str, int]:
        """At least the bytes of each field of question `index`'s typed answer (its block under
        `x_<name>`), counted before any forward."""
        ...

    def listing(self, served: Served) -> dict[str, Any]:
        """/v1/models' fields of a model it serves, beyond its name and release date:
        `description` and the `x_` facts (`x_method` first)."""
        ...

    def reply_remedy(self) -> str:
        """What a client whose reply passes the budget can do."""
        ...


def block_field(method: type[DecisionMethod] | DecisionMethod) -> str:
    """The answer field a method's block is sent as: `x_` and its name (`-` as `_`)."""
    return "x_" + method.name.replace("-", "_")


def plug_in(path: str) -> type[DecisionMethod]:
    """The method class at `module:attribute` (SEMIF_METHODS); ConfigurationError naming it."""
    module_name, _, attribute = path.partition(":")
    where = f"SEMIF_METHODS: {path!r}"
    if not module_name or not attribute:
        raise ConfigurationError(f"{where}: expected module:attribute")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"{where}: cannot import {module_name} ({exc})") from None
    method = getattr(module, attribute, None)
    if method is None:
        raise ConfigurationError(f"{where}: {module_name} has no {attribute}")
    missing = [
        name
        for name in ("name", "answers", "images", "workloads", "noun", "claims", "read_entry", "start")
        if not hasattr(method, name)
    ]
    if missing:
        raise ConfigurationError(f"{where}: not a decision method (no {', '.join(missing)})")
    return method


@dataclass(frozen=True)
class MethodRegistry:
    """Every method the service may serve a model with, by name: the built-in ones (SemIf's
    first: it reads the base and plain adapters), then SEMIF_METHODS' in their order."""

    methods: Mapping[str, type[DecisionMethod]]

    @classmethod
    def of(cls, plug_ins: Sequence[str] = ()) -> MethodRegistry:
        """The built-in methods and the plug-ins at `plug_ins` (`module:attribute` each)."""
        from semif_serve.service.methods.lev import LevMethod
        from semif_serve.service.methods.semif import SemIfMethod

        methods: dict[str, type[DecisionMethod]] = {SemIfMethod.name: SemIfMethod, LevMethod.name: LevMethod}
        for path in plug_ins:
            method = plug_in(path)
            if method.name in methods:
                raise ConfigurationError(
                    f"SEMIF_METHODS: {path!r}: the method {method.name!r} is served already"
                )
            methods[method.name] = method
        return cls(methods)

    @property
    def default(self) -> type[DecisionMethod]:
        """The method of the base and of an entry that names none: the first."""
        return next(iter(self.methods.values()))

    def named(self, name: str) -> type[DecisionMethod] | None:
        """The method called `name`, or None."""
        return self.methods.get(name)

    def claiming(self, key: str) -> type[DecisionMethod] | None:
        """The method whose entries alone may set `key` (lev's `release`), or None."""
        claims = [m for m in self.methods.values() if key in m.claims]
        return claims[0] if claims else None
