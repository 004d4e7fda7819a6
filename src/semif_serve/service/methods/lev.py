"""lev's method as a plug-in: every lev release of SEMIF_MODELS (and the frozen base read with
lev's method), answered exactly as lev's server does (`service.lev_core`; docs/lev.md).

The question's text goes to lev as the request sent it (lev renders it itself: the state and
descriptions as sorted-key JSON, a structured `instructions` as Python's repr). `confidence`
keeps System One's definition (`domain.answers`), computed from lev's final probabilities; lev's
own statistic (its normalised Gini) is kept in its block, `x_lev`. A request lev does not read
(images, a box, SemIf's orderings or workload) is refused naming the field, never approximated.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel

from semif_serve.domain.answers import choice_confidence, score_confidence
from semif_serve.domain.lev.types import (
    MANIFEST_FILE,
    RATING_TEXTS,
    SCORE_ORDER_ALIASES,
    SCORE_ORDER_AVERAGES,
    LevAnswer,
    LevChoice,
    LevNoul,
    LevQuestion,
    LevReleaseError,
    LevScore,
)
from semif_serve.domain.requests import AskedQuestion, as_text
from semif_serve.domain.types import ConfigurationError, DecisionError, NotRead
from semif_serve.engine.lev_release import LevRelease, base_release, load_lev_release
from semif_serve.engine.rows import RowsJob
from semif_serve.engine.state_cache import state_digest
from semif_serve.service.lev_core import LevEncoder, LevRows, lev_answers, lev_jobs, lev_rows
from semif_serve.service.methods import Ask, Decided, EngineStages, MethodStart, Served, TypedAnswer
from semif_serve.service.methods.lev_probing import LevProbing
from semif_serve.service.models import COMMON_KEYS, EntryPlace, ModelEntry
from semif_serve.service.reply_size import FLOAT_BYTES, INT_BYTES, map_bytes, object_bytes, text_bytes

# lev's server flags an entry may set, and the values it accepts (orders in the one vocabulary of
# `domain.orderings`; lev's own names, `off`, `reversed` and `cyclic`, are accepted too).
LEV_OPTIONS: dict[str, tuple[str, ...]] = {
    "noul_readout": ("binary", "rating"),
    "prompt_style": ("plain", "chat"),
    "score_order_average": (*SCORE_ORDER_AVERAGES, *SCORE_ORDER_ALIASES),
}
LABEL_CAP = "max_label_options"  # lev's label cap: a question with more candidates reads its head
RELEASE_KEYS = ("release", *LEV_OPTIONS, LABEL_CAP, *COMMON_KEYS)
# The base read with lev's method (lev's `serve --model` without a checkpoint): lev's flags only.
LEV_BASE_KEYS = ("method", *LEV_OPTIONS, LABEL_CAP)
# What lev's server reads the frozen base with: a binary noul in two orders (a release reads a rating).
LEV_BASE_OPTIONS = {"noul_readout": "binary"}
# SemIf's per-question extensions: a lev model has its own orders and calibration.
SEMIF_ONLY = ("orderings", "workload")


class LevBlock(BaseModel):
    """`x_lev`: how lev read one answer: Mode A (label codes) or B (the candidate head), the
    calibration bucket and its temperature, the orders averaged, lev's own `confidence` (its
    normalised Gini, (K sum p^2 - 1) / (K - 1)) and the distribution it was computed from (a
    rating noul: the levels "0".."8"; a binary noul: "yes", "no")."""

    mode: Literal["A", "B"]
    bucket: str
    temperature: float
    orders: int
    confidence: float
    distribution: dict[str, float]


# lev's calibration buckets (`{type}:{mode}[:{band}]`, or "default"): the longest bounds every one.
LEV_BUCKET_BYTES = max(
    text_bytes(f"{kind}:{mode}:{band}")
    for kind in ("noul", "noul_binary", "choice", "score")
    for mode in ("A", "B")
    for band in ("small", "mid", "large")
)


def lev_question(asked: AskedQuestion) -> LevQuestion:
    """One typed question as lev's, its text as sent (lev renders it)."""
    if asked.type == "noul":
        return LevNoul(instructions=asked.instructions, criteria=asked.criteria)
    if asked.type == "choice":
        return LevChoice(criteria=dict(asked.criteria), instructions=asked.instructions)
    return LevScore(criteria=tuple(asked.criteria), instructions=asked.instructions)


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


def typed_answer(asked: AskedQuestion, answer: LevAnswer) -> TypedAnswer:
    """One answer from lev's: its value, and System One's confidence of its distribution
    (`domain.answers`, as SemIf's answers compute it); a noul, which System One gives no
    confidence, carries lev's own and its rating levels, as lev's server sends them."""
    probs = answer.distribution
    block = lev_block(answer)
    if asked.type == "noul":
        rated = answer.probabilities
        levels = None if rated is None else dict(zip(RATING_TEXTS, rated, strict=True))
        fields: dict[str, Any] = {
            "noul": float(answer.value),
            "probabilities": levels,
            "confidence": answer.lev_confidence,
        }
        return TypedAnswer("noul", fields, block)
    if asked.type == "choice":
        fields = {
            "choice": str(answer.value),
            "probabilities": dict(zip(asked.criteria, probs, strict=True)),
            "confidence": choice_confidence(probs),
        }
        return TypedAnswer("choice", fields, block)
    fields = {
        "score": float(answer.value),
        "legend": {str(i): as_text(level) for i, level in enumerate(asked.criteria)},
        "probabilities": {str(i): p for i, p in enumerate(probs)},
        "confidence": score_confidence(probs),
    }
    return TypedAnswer("score", fields, block)


def answer_sizes(asked: AskedQuestion) -> dict[str, int]:
    """At least the bytes of each field of a lev answer to `asked`: its value, the probabilities
    and `x_lev`'s distribution by name (a noul by its rating levels, the larger of lev's readouts)."""
    if asked.type == "noul":
        names = [text_bytes(level) for level in RATING_TEXTS]  # a binary noul's yes, no are fewer
    elif asked.type == "choice":
        names = [text_bytes(name) for name in asked.criteria]
    else:
        names = [text_bytes(str(i)) for i in range(len(asked.criteria))]
    by_name = map_bytes(sum(names), len(names) * FLOAT_BYTES, len(names))
    block = object_bytes(
        LevBlock,
        {
            "mode": text_bytes("A"),
            "bucket": LEV_BUCKET_BYTES,
            "temperature": FLOAT_BYTES,
            "orders": INT_BYTES,
            "confidence": FLOAT_BYTES,
            "distribution": by_name,
        },
    )
    spread = {"probabilities": by_name, "confidence": FLOAT_BYTES, "x_lev": block}
    if asked.type == "noul":
        return {"noul": FLOAT_BYTES, **spread}
    if asked.type == "choice":
        return {"choice": max(names), **spread}
    legend = map_bytes(sum(names), sum(text_bytes(as_text(level)) for level in asked.criteria), len(names))
    return {"score": FLOAT_BYTES, "legend": legend, **spread}


@dataclass(frozen=True)
class LevPlan:
    """A call's release, its lev questions and their rows, encoded once (and how long that took)."""

    ask: Ask
    release: LevRelease
    rows: LevRows
    encode_seconds: float


class LevMethod:
    """lev's method over the releases (and the frozen base) SEMIF_MODELS serves with it."""

    name: ClassVar[str] = "lev"
    answers: ClassVar[tuple[str, ...]] = ("noul", "choice", "score")
    images: ClassVar[bool] = False
    workloads: ClassVar[bool] = False
    noun: ClassVar[str] = "a lev release"
    claims: ClassVar[tuple[str, ...]] = ("release",)
    probing: ClassVar[LevProbing] = LevProbing()

    def __init__(self, releases: Mapping[str, LevRelease], base_name: str) -> None:
        self.releases = dict(releases)
        self.base_name = base_name
        by_tokenizer: dict[int, LevEncoder] = {}
        self.encoders: dict[str, LevEncoder] = {}
        for name, release in self.releases.items():
            key = id(release.tokenizer)
            if key not in by_tokenizer:
                by_tokenizer[key] = LevEncoder(release.tokenizer)
            self.encoders[name] = by_tokenizer[key]
            self.encoders[name].preamble(release.options.prompt_style)  # found at start: no request pays

    @classmethod
    def read_entry(cls, name: str, table: Mapping[str, Any], place: EntryPlace) -> ModelEntry:
        """A lev release (`release`, lev's flags, the label cap, `scale`, `base_model`), or with
        `method = "lev"` and no release the frozen base read with lev's method (flags only)."""
        if "release" not in table:
            place.allow(table, LEV_BASE_KEYS, "the base read with lev's method")
            options = {**LEV_BASE_OPTIONS, **_options(table, place)}
            return ModelEntry(name, cls.name, options=options)
        if "adapter" in table:
            raise place.error(None, "sets both release and adapter (exactly one)")
        place.allow({k: v for k, v in table.items() if k != "method"}, RELEASE_KEYS, "a release")
        directory = place.directory(table, "release", MANIFEST_FILE)
        return ModelEntry(
            name,
            cls.name,
            directory=directory,
            scale=place.scale(table),
            base_model=place.base_model(table),
            options=_options(table, place),
        )

    @classmethod
    def start(cls, entries: Sequence[ModelEntry], context: MethodStart) -> LevMethod:
        """Every release of `entries` read over the engine's base: its adapter an entry of the
        bank (read once, by the bank's rules; the entry's `scale` over the manifest's), its head
        on the base's device, so the memory baseline counts both. An unreadable release stops
        startup naming the SEMIF_MODELS file and key, and the release's own file and key."""
        engine = context.engine
        base_directory = context.settings.require_model()
        releases: dict[str, LevRelease] = {}
        for entry in entries:
            where = f"SEMIF_MODELS: {context.models_file}: models.{entry.name}"
            options = entry.options
            flags: dict[str, Any] = {
                "prompt_style": options.get("prompt_style"),
                "noul_readout": options.get("noul_readout"),
                "score_order_average": options.get("score_order_average", "none"),
                "max_label_options": options.get(LABEL_CAP),
                "settings_source": where,
            }
            try:
                if entry.directory is None:  # the frozen base, read with lev's method
                    tokenizer = engine.codec.tokenizer
                    releases[entry.name] = base_release(
                        base_directory, tokenizer, base_name=context.settings.model_source, **flags
                    )
                    continue
                releases[entry.name] = load_lev_release(
                    entry.directory,
                    engine.adapters,
                    engine.codec.tokenizer,
                    name=entry.name,
                    base_name=entry.base_model or context.settings.model_source,
                    base_directory=base_directory,
                    adapter_scale=entry.scale,
                    **flags,
                )
            except LevReleaseError as exc:
                # A setting of the entry names its own key; a release file names the release key too.
                if exc.file == where:
                    raise ConfigurationError(f"{where}.{exc.key}: {exc.problem}") from None
                raise ConfigurationError(f"{where}.release: {exc}") from None
        return cls(releases, context.base_name)

    def with_releases(self, releases: Mapping[str, LevRelease]) -> LevMethod:
        """This method serving `releases` (copies of its own under other names, say) besides its own."""
        return type(self)({**self.releases, **releases}, self.base_name)

    @staticmethod
    def rows_for(asked: AskedQuestion, options: int, defaults: Any) -> int:
        """At least one row a question (its orders and candidates are counted from its plan)."""
        return 1

    def plan(self, ask: Ask) -> LevPlan:
        """lev's questions, refused where they name SemIf's orderings or workload; then rendered,
        encoded once and checked against the door's limits (`lev_rows`)."""
        model = ask.served.name
        for question in ask.questions:
            for part in SEMIF_ONLY:
                if getattr(question, part) is not None:
                    field = question.fields.get(part, part)
                    wire = field.rsplit(".", 1)[-1]
                    raise NotRead(
                        field,
                        f"SemIf's {wire} does not apply to the lev model {model!r}, which reads its "
                        "release's own orders and calibration",
                    )
        started = time.perf_counter()
        release = self.releases[model]
        questions = {q.id: lev_question(q) for q in ask.questions}
        rows = lev_rows(release, self.encoders[model], ask.state, questions, ask.limits)
        return LevPlan(ask, release, rows, time.perf_counter() - started)

    def jobs(self, plan: LevPlan, engine: Any) -> list[RowsJob]:
        """The label rows, the head's rows and the candidates (`lev_jobs`), over the state as this
        model keys it."""
        key = state_digest(plan.ask.state, (), plan.ask.served.name)
        prepares = lev_jobs(plan.rows, engine, plan.release.adapter, plan.encode_seconds)
        return [RowsJob(key, prepare) for prepare in prepares]

    def located(self, plan: LevPlan, error: DecisionError) -> DecisionError:
        """lev's rows are refused by the plan, with their question: an engine error is the call's."""
        return error

    def outcome(self, plan: LevPlan, readouts: Sequence[Any]) -> Decided:
        """lev's answers (the head over Mode B's states, then lev's softmax, orders and
        calibration), each in its type's one shape."""
        reply = lev_answers(plan.release, plan.rows, readouts)
        engine_seconds = sum(r.forward_seconds for r in readouts)
        wait = max((r.wait for r in readouts), key=lambda w: w.seconds)
        timing = reply.timing
        return Decided(
            answers=tuple(typed_answer(q, reply.answers[q.id]) for q in plan.ask.questions),
            outcome=None,
            input_tokens=reply.input_tokens,
            cached_input_tokens=reply.cached_input_tokens,
            timing=timing,
            forward_seconds=engine_seconds,
            total_seconds=engine_seconds,
            rows=plan.rows.forward_rows,
            counted_tokens=reply.input_tokens,
            engine_seconds=engine_seconds + plan.encode_seconds,
            wait=wait,
            stages=EngineStages.of(plan.encode_seconds, wait, timing, engine_seconds),
            batch=timing,
        )

    def answer_sizes(self, plan: Any, index: int) -> dict[str, int]:
        """The sizes of question `index`'s answer fields."""
        return answer_sizes(plan.ask.questions[index])

    def listing(self, served: Served) -> dict[str, Any]:
        """/v1/models' fields of a lev model: method `lev`, its serving scale, its buckets."""
        release = self.releases[served.name]
        what = (
            "the frozen base"
            if release.frozen_base
            else f"the lev release {release.name!r} over {self.base_name}"
        )
        return {
            "description": f"{served.name}: {what}, read by lev's method (its "
            f"{release.options.prompt_style} prompt, label codes, orders and calibration; docs/lev.md); "
            f"candidate head: {'yes' if release.head is not None else 'no'}.",
            "x_method": self.name,
            "x_reads_images": False,
            "x_adapter": None,
            "x_scale": release.adapter_scale,
            "x_calibration": sorted(release.calibration.temperatures),
        }

    def reply_remedy(self) -> str:
        """Fewer questions or options, shorter names, or several requests (lev's orders are its own)."""
        return "ask fewer questions or options, shorten the names, or split it across requests"


def _options(table: Mapping[str, Any], place: EntryPlace) -> dict[str, Any]:
    """lev's flags (orders in the one vocabulary, lev's names read as aliases) and the label cap."""
    options: dict[str, Any] = place.choices(table, LEV_OPTIONS)
    if "score_order_average" in options:
        options["score_order_average"] = SCORE_ORDER_ALIASES.get(
            options["score_order_average"], options["score_order_average"]
        )
    cap = table.get(LABEL_CAP)
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise place.error(LABEL_CAP, f"must be an integer >= 1, not {cap!r}")
    if cap is not None:
        options[LABEL_CAP] = cap
    return options
