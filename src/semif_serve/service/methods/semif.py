"""SemIf's method as a plug-in: the base and every PEFT adapter of SEMIF_MODELS, read by SemIf's
`direct-options-v1` prompt and its option-letter readout (`service.core`: questions -> rows ->
typed outcomes).

A typed question becomes the core's questions here (a box as its four edge questions,
`domain.boxes`; text rendered as JSON where it is structured), asked in the caller's orderings
or the operator's default; the outcome becomes each type's answer with SemIf's block,
`x_semif` (the native readout of the caller's order, the orderings, the calibration).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel

from semif_serve.domain.answers import (
    box_confidence,
    choice_confidence,
    expected_score,
    final_distribution,
    rows_needed,
    score_confidence,
)
from semif_serve.domain.boxes import DEFAULT_TARGET, EDGES, POSITIONS, edge_questions, read_box
from semif_serve.domain.orderings import CORE_ORDERINGS, NO_ORDERINGS, order_count
from semif_serve.domain.peft_files import ADAPTER_FILES
from semif_serve.domain.prompt import PROMPT_VERSION
from semif_serve.domain.requests import BASE, OPTIONS, AskedQuestion, Defaults, RowsRequest, as_text
from semif_serve.domain.types import (
    ConfigurationError,
    DecisionError,
    DecisionOutcome,
    Option,
    PromptRow,
    Question,
    QuestionOutcome,
)
from semif_serve.engine.adapters import AdapterBank, AdapterError
from semif_serve.engine.rows import RowsJob
from semif_serve.engine.state_cache import state_digest
from semif_serve.service.core import PlannedQuestion, located, plan_rows, question_outcome
from semif_serve.service.methods import (
    Ask,
    Decided,
    MethodStart,
    Served,
    TypedAnswer,
    one_read,
)
from semif_serve.service.methods.semif_probing import SemIfProbing
from semif_serve.service.models import COMMON_KEYS, EntryPlace, ModelEntry
from semif_serve.service.reply_size import (
    FLOAT_BYTES,
    INT_BYTES,
    NULL_BYTES,
    SHA256_BYTES,
    array_bytes,
    map_bytes,
    object_bytes,
    scalars_bytes,
    text_bytes,
)

ADAPTER_KEYS = ("adapter", *COMMON_KEYS)
# The wording a question gets where the request leaves it out (fixed: answers stay reproducible).
DEFAULT_INSTRUCTIONS = {
    "noul": "Is the statement this question is about true of the evidence?",
    "choice": "Which option best fits the evidence?",
    "score": "Which level best fits the evidence?",
}
DEFAULT_NOUL_CRITERIA = {"true": "Yes, it is true.", "false": "No, it is false."}
NOUL_OPTIONS = ("true", "false")  # `true` in slot A


# -- SemIf's block (`x_semif`) and a box's fields --------------------------------------------------


class Reading(BaseModel):
    """One ordering's native readout: the order the options were asked in, and their probabilities."""

    order: list[str]
    probabilities: dict[str, float]


class SemIfBlock(BaseModel):
    """`x_semif`: how one answer was read (native readout of the caller's order, orderings, T)."""

    prompt_sha256: str
    prompt_version: str
    input_tokens: int
    option_logits: dict[str, float]
    orderings: str
    rows: int
    agreement: float
    workload: str | None
    temperature: float | None
    readings: list[Reading]


class BoxCoordinates(BaseModel):
    """A box's edges: fractions of the image's height from its top (`top` < `bottom`) and of its
    width from its left (`left` < `right`), each the expected value of its edge's position."""

    top: float
    bottom: float
    left: float
    right: float


class BoxEdge(BaseModel):
    """How one edge was read: its own distribution over the positions (keys `"0.00"`..`"1.00"`),
    the distribution after the pair rule (whose expectation is the edge), and its question's
    `x_semif`."""

    probabilities: dict[str, float]
    ordered: dict[str, float]
    x_semif: SemIfBlock


# -- typed questions as the core's -----------------------------------------------------------------


def core_question(asked: AskedQuestion, defaults: Defaults) -> Question:
    """A noul, choice or score (or the native door's question over options) as the core's
    question (option ids: names, "true"/"false", "0".."n-1", or the native ids)."""
    kind = asked.type
    options: tuple[Option, ...]
    if kind == OPTIONS:
        options = tuple(asked.criteria)
    elif kind == "noul":
        given = asked.criteria or {}
        options = tuple(
            Option(side, DEFAULT_NOUL_CRITERIA[side] if given.get(side) is None else as_text(given[side]))
            for side in NOUL_OPTIONS
        )
    elif kind == "choice":
        options = tuple(
            Option(name, name if description is None else as_text(description))
            for name, description in asked.criteria.items()
        )
    else:
        options = tuple(Option(str(i), as_text(level)) for i, level in enumerate(asked.criteria))
    if kind == OPTIONS:
        text = asked.instructions
    else:
        text = DEFAULT_INSTRUCTIONS[kind] if asked.instructions is None else as_text(asked.instructions)
    mode = asked.orderings or defaults.orderings.get(kind) or NO_ORDERINGS
    return Question(
        id=asked.id,
        text=text,
        options=options,
        orderings=CORE_ORDERINGS[mode],
        workload=asked.workload or defaults.workloads.get(kind),
    )


def box_questions(asked: AskedQuestion) -> tuple[Question, ...]:
    """A box question as its four edge questions (domain/boxes.py), in `EDGES` order: asked in
    the caller's orderings (`none` or `reversal`; no operator default), with its workload."""
    target = DEFAULT_TARGET if asked.instructions is None else as_text(asked.instructions)
    return edge_questions(
        asked.id,
        target,
        orderings=CORE_ORDERINGS[asked.orderings or NO_ORDERINGS],
        workload=asked.workload,
    )


def core_questions(asked: AskedQuestion, defaults: Defaults) -> tuple[Question, ...]:
    """The core's questions one question is asked as: four for a box, else one."""
    if asked.type == "box":
        return box_questions(asked)
    return (core_question(asked, defaults),)


# -- the core's outcomes as typed answers --------------------------------------------------------


def semif_block(answer: QuestionOutcome) -> SemIfBlock:
    """`x_semif`: the native readout of the caller's order, and how the answer was combined."""
    native = answer.readouts[0]
    combined = answer.combined
    calibrated = answer.calibrated
    return SemIfBlock(
        prompt_sha256=native.prompt_sha256,
        prompt_version=PROMPT_VERSION,
        input_tokens=native.input_tokens,
        option_logits=dict(zip(native.option_ids, native.option_logits, strict=True)),
        orderings=combined.mode if combined is not None else NO_ORDERINGS,
        rows=len(answer.readouts),
        agreement=combined.agreement if combined is not None else 1.0,
        workload=calibrated.workload if calibrated is not None else None,
        temperature=calibrated.temperature if calibrated is not None else None,
        readings=[
            Reading(
                order=list(r.option_ids),
                probabilities=dict(zip(r.option_ids, r.probabilities, strict=True)),
            )
            for r in answer.readouts
        ],
    )


def typed_answer(kind: str, answer: QuestionOutcome) -> TypedAnswer:
    """One noul, choice or score answer from the core's outcome."""
    final = final_distribution(answer)
    block = semif_block(answer)
    if kind == "noul":
        return TypedAnswer(kind, {"noul": final.probabilities[0]}, block)
    if kind == "choice":
        fields = {
            "choice": final.top(),
            "probabilities": final.by_id(),
            "confidence": choice_confidence(final.probabilities),
        }
        return TypedAnswer(kind, fields, block)
    fields = {
        "score": expected_score(final.probabilities),
        "legend": {o.id: o.description for o in answer.question.options},
        "probabilities": final.by_id(),
        "confidence": score_confidence(final.probabilities),
    }
    return TypedAnswer(kind, fields, block)


def box_answer(edges: Sequence[QuestionOutcome]) -> TypedAnswer:
    """A box answer from its four edge questions' outcomes (in `EDGES` order): each edge's final
    distribution read jointly with its side's other edge (the pair rule of domain/boxes.py)."""
    finals = [final_distribution(edge) for edge in edges]
    reading = read_box(*(final.probabilities for final in finals))
    fields = {
        "box": BoxCoordinates(top=reading.top, bottom=reading.bottom, left=reading.left, right=reading.right),
        "confidence": box_confidence([reading.marginals[edge] for edge in EDGES]),
        "x_edges": {
            edge: BoxEdge(
                probabilities=final.by_id(),
                ordered=dict(zip(final.ids, reading.marginals[edge], strict=True)),
                x_semif=semif_block(outcome),
            )
            for edge, final, outcome in zip(EDGES, finals, edges, strict=True)
        },
    }
    return TypedAnswer("box", fields)


def evaluated_tokens(outcome: DecisionOutcome) -> int:
    """Tokens the engine evaluated: the shared prefix once, plus every row's own suffix."""
    if not outcome.shared:
        return sum(r.input_tokens for q in outcome.questions for r in q.readouts)
    return outcome.timing.prefix_tokens + outcome.timing.true_suffix_tokens


# -- sizes -----------------------------------------------------------------------------------------


def semif_bytes(question: Question) -> int:
    """At least the bytes of `semif_block` for `question`: each reading echoes every option name
    twice (its order, and its probabilities by name)."""
    n = len(question.options)
    names = sum(text_bytes(o.id) for o in question.options)
    by_name = map_bytes(names, n * FLOAT_BYTES, n)
    reading = object_bytes(Reading, {"order": array_bytes(names, n), "probabilities": by_name})
    readings = order_count(n, question.orderings)
    calibrated = question.workload is not None
    return object_bytes(
        SemIfBlock,
        {
            "prompt_sha256": SHA256_BYTES,
            "prompt_version": text_bytes(PROMPT_VERSION),
            "input_tokens": INT_BYTES,
            "option_logits": by_name,
            "orderings": text_bytes(question.orderings or NO_ORDERINGS),
            "rows": INT_BYTES,
            "agreement": FLOAT_BYTES,
            "workload": text_bytes(question.workload) if question.workload is not None else NULL_BYTES,
            "temperature": FLOAT_BYTES if calibrated else NULL_BYTES,
            "readings": array_bytes(readings * reading, readings),
        },
    )


def answer_sizes(kind: str, asked: tuple[Question, ...]) -> dict[str, int]:
    """At least the bytes of each field of the answer to a question of `kind` asked as `asked`."""
    first = asked[0]
    n = len(first.options)
    names = [text_bytes(o.id) for o in first.options]
    by_name = map_bytes(sum(names), n * FLOAT_BYTES, n)
    if kind == "box":
        edges = [
            object_bytes(BoxEdge, {"probabilities": by_name, "ordered": by_name, "x_semif": semif_bytes(q)})
            for q in asked
        ]
        return {
            "box": scalars_bytes(BoxCoordinates),
            "confidence": FLOAT_BYTES,
            "x_edges": map_bytes(sum(map(text_bytes, EDGES)), sum(edges), len(edges)),
        }
    block = {"x_semif": semif_bytes(first)}
    if kind == "noul":
        return {"noul": FLOAT_BYTES, **block}
    spread = {"probabilities": by_name, "confidence": FLOAT_BYTES}
    if kind == "choice":
        return {"choice": max(names), **spread, **block}
    legend = map_bytes(sum(names), sum(text_bytes(o.description) for o in first.options), n)
    return {"score": FLOAT_BYTES, "legend": legend, **spread, **block}


# -- the method ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SemIfPlan:
    """A call's core questions (`asked[k]`: those question k is asked as; `owners[i]`: the
    question core question i belongs to), their planned orders and the rows."""

    ask: Ask
    asked: tuple[tuple[Question, ...], ...]
    owners: tuple[int, ...]
    planned: list[PlannedQuestion]
    rows: list[PromptRow]


class SemIfMethod:
    """SemIf's method over the base and its PEFT adapters (docs/adapters.md)."""

    name: ClassVar[str] = "semif"
    answers: ClassVar[tuple[str, ...]] = ("noul", "choice", "score", "box", OPTIONS)
    images: ClassVar[bool] = True
    workloads: ClassVar[bool] = True
    noun: ClassVar[str] = "a SemIf model"
    claims: ClassVar[tuple[str, ...]] = ("adapter",)
    probing: ClassVar[SemIfProbing] = SemIfProbing()

    def __init__(self, context: MethodStart) -> None:
        self.engine = context.engine
        self.calibration = context.calibration
        self.base_name = context.base_name

    @classmethod
    def read_entry(cls, name: str, table: Mapping[str, Any], place: EntryPlace) -> ModelEntry:
        """A PEFT LoRA adapter over the base (`adapter`, with `scale` and `base_model`)."""
        if "adapter" not in table:
            if "method" in table:
                raise place.error(
                    "method", f"{table['method']!r} needs an adapter (the base is served already)"
                )
            raise place.error(None, "sets neither release nor adapter (exactly one)")
        if "release" in table:
            raise place.error(None, "sets both release and adapter (exactly one)")
        place.allow({k: v for k, v in table.items() if k != "method"}, ADAPTER_KEYS, "an adapter")
        directory = place.directory(table, "adapter", *ADAPTER_FILES)
        return ModelEntry(
            name, cls.name, directory=directory, scale=place.scale(table), base_model=place.base_model(table)
        )

    @classmethod
    def start(cls, entries: Sequence[ModelEntry], context: MethodStart) -> SemIfMethod:
        """Every adapter of `entries` into the engine's bank (read once, checked against the base;
        an adapter that does not match is refused naming the file's key and the adapter's file)."""
        bank: AdapterBank = context.engine.adapters
        settings = context.settings
        base_names = (settings.model_source, str(settings.require_model()))
        for entry in entries:
            if entry.directory is None:
                continue  # the base itself
            names = (*base_names, entry.base_model) if entry.base_model else base_names
            try:
                bank.add(entry.name, entry.directory, multiplier=entry.scale or 1.0, base_names=names)
            except AdapterError as exc:
                raise ConfigurationError(
                    f"SEMIF_MODELS: {context.models_file}: models.{entry.name}.adapter: {exc}"
                ) from None
        return cls(context)

    @staticmethod
    def rows_for(asked: AskedQuestion, options: int, defaults: Defaults) -> int:
        """The rows a question of `options` options needs (a box: its four edges')."""
        if asked.type == "box":
            return rows_needed(POSITIONS, asked.orderings or NO_ORDERINGS, len(EDGES))
        return rows_needed(options, asked.orderings or defaults.orderings.get(asked.type) or NO_ORDERINGS, 1)

    def plan(self, ask: Ask) -> SemIfPlan:
        """Every question as the core's (in its orderings), planned into rows and checked
        (`plan_rows`): options, workloads, the row cap."""
        asked = tuple(core_questions(q, ask.defaults) for q in ask.questions)
        owners = tuple(k for k, own in enumerate(asked) for _ in own)
        questions = [q for own in asked for q in own]
        served = ask.served
        try:
            planned, rows = plan_rows(
                questions,
                max_rows=ask.limits.max_rows,
                max_options=ask.limits.max_options,
                calibration=self.calibration,
                model=None if served.is_base else served.name,
                base_name=self.base_name,
            )
        except DecisionError as exc:
            raise _owned(exc, owners) from None
        return SemIfPlan(ask, asked, owners, planned, rows)

    def jobs(self, plan: SemIfPlan, engine: Any) -> list[RowsJob]:
        """One job: every row over the state, encoded by the engine's codec (images placed)."""
        ask = plan.ask
        request = RowsRequest(
            ask.state, tuple(plan.rows), ask.shared, ask.limits, ask.images, ask.served.adapter
        )
        key = state_digest(ask.state, [image.sha256 for image in ask.images], _model_key(ask.served))
        return [RowsJob(key, functools.partial(engine.prepare, request), images=bool(ask.images))]

    def located(self, plan: SemIfPlan, error: DecisionError) -> DecisionError:
        """The engine's refusal of a row, at its question (an option slot as the caller's option)."""
        return _owned(located(error, plan.planned), plan.owners)

    def outcome(self, plan: SemIfPlan, readouts: Sequence[Any]) -> Decided:
        """The core's outcomes of every question, and each typed question's answer."""
        readout = readouts[0]
        outcome = DecisionOutcome(
            questions=tuple(question_outcome(p, readout, self.calibration) for p in plan.planned),
            shared=readout.shared,
            forward_seconds=readout.forward_seconds,
            total_seconds=readout.total_seconds,
            timing=readout.timing,
            wait=readout.wait,
        )
        answers = None
        if all(q.type != OPTIONS for q in plan.ask.questions):
            answers = tuple(_answers(plan, outcome.questions))
        read = [r for q in outcome.questions for r in q.readouts]
        return Decided(
            answers=answers,
            outcome=outcome,
            input_tokens=evaluated_tokens(outcome),
            rows=len(read),
            counted_tokens=sum(r.input_tokens for r in read),
            **one_read(outcome),
            batch=outcome.timing if outcome.shared else None,
            workloads=tuple(q.question.workload for q in outcome.questions if q.question.workload),
        )

    def answer_sizes(self, plan: SemIfPlan, index: int) -> dict[str, int]:
        """The sizes of question `index`'s answer fields, from its core questions."""
        return answer_sizes(plan.ask.questions[index].type, plan.asked[index])

    def listing(self, served: Served) -> dict[str, Any]:
        """An adapter's /v1/models fields: SemIf's readout, its scale and the workloads fitted on it."""
        bank = self.engine.adapters
        return {
            "description": f"{served.name}: a LoRA adapter over {self.base_name}, read by SemIf's "
            "option-logit readout in the same forwards as the base.",
            "x_method": self.name,
            "x_max_options": self.engine.capacity,
            "x_reads_images": self.engine.reads_images,
            "x_scale": bank.adapters[served.adapter].multiplier if served.adapter != BASE else None,
            "x_calibration": self.calibration.workloads_of(served.name),
        }

    def reply_remedy(self) -> str:
        """Fewer orderings or options, shorter names, or several requests."""
        return "ask fewer orderings or options, shorten the names, or split it across requests"


def _answers(plan: SemIfPlan, outcomes: Sequence[QuestionOutcome]) -> list[TypedAnswer]:
    answers = []
    start = 0
    for question, own in zip(plan.ask.questions, plan.asked, strict=True):
        read = outcomes[start : start + len(own)]
        start += len(own)
        answers.append(box_answer(read) if question.type == "box" else typed_answer(question.type, read[0]))
    return answers


def _owned(error: DecisionError, owners: Sequence[int]) -> DecisionError:
    """`error` at the asked question its core question belongs to (a box's edges are one question)."""
    if error.question is None or error.question >= len(owners):
        return error
    return (
        error.located(question=owners[error.question]) if owners[error.question] != error.question else error
    )


def _model_key(served: Served) -> str | None:
    """The name the state's digest carries (None: the base, as its states are keyed)."""
    return None if served.is_base else served.name
