"""The System One reply's size, counted from the mapped questions before any engine work."""

from __future__ import annotations

from collections.abc import Sequence

from semif_serve.domain.boxes import EDGES
from semif_serve.domain.lev.types import RATING_TEXTS
from semif_serve.domain.orderings import (
    NO_ORDERINGS,
    order_count,
)
from semif_serve.domain.prompt import PROMPT_VERSION
from semif_serve.domain.types import Question
from semif_serve.doors.reply_size import (
    FLOAT_BYTES,
    INT_BYTES,
    NULL_BYTES,
    PREFILL_BYTES,
    SHA256_BYTES,
    array_bytes,
    map_bytes,
    object_bytes,
    scalars_bytes,
    text_bytes,
)
from semif_serve.doors.systemone import schemas as wire
from semif_serve.doors.systemone.mapping import as_text

TIMING_BYTES = scalars_bytes(wire.BatchTimingBlock, {"prefill": PREFILL_BYTES})


def semif_bytes(question: Question) -> int:
    """At least the bytes of `semif_block` for `question`: each reading echoes every option name
    twice (its order, and its probabilities by name)."""
    n = len(question.options)
    names = sum(text_bytes(o.id) for o in question.options)
    by_name = map_bytes(names, n * FLOAT_BYTES, n)
    reading = object_bytes(wire.Reading, {"order": array_bytes(names, n), "probabilities": by_name})
    readings = order_count(n, question.orderings)
    calibrated = question.workload is not None
    return object_bytes(
        wire.SemIfBlock,
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


def answer_bytes(kind: str, asked: tuple[Question, ...]) -> int:
    """At least the bytes of the answer to a System One question of `kind`, asked as `asked`."""
    first = asked[0]
    n = len(first.options)
    names = [text_bytes(o.id) for o in first.options]
    by_name = map_bytes(sum(names), n * FLOAT_BYTES, n)
    sizes = {"type": text_bytes(kind)}
    if kind == "box":
        edges = [
            object_bytes(
                wire.BoxEdge, {"probabilities": by_name, "ordered": by_name, "x_semif": semif_bytes(q)}
            )
            for q in asked
        ]
        return object_bytes(
            wire.BoxAnswer,
            sizes
            | {
                "box": scalars_bytes(wire.BoxCoordinates),
                "confidence": FLOAT_BYTES,
                "x_edges": map_bytes(sum(map(text_bytes, EDGES)), sum(edges), len(edges)),
            },
        )
    sizes["x_semif"] = semif_bytes(first)
    if kind == "noul":
        return object_bytes(wire.NoulAnswer, sizes | {"noul": FLOAT_BYTES})
    sizes |= {"probabilities": by_name, "confidence": FLOAT_BYTES}
    if kind == "choice":
        return object_bytes(wire.ChoiceAnswer, sizes | {"choice": max(names)})
    legend = map_bytes(sum(names), sum(text_bytes(o.description) for o in first.options), n)
    return object_bytes(wire.ScoreAnswer, sizes | {"score": FLOAT_BYTES, "legend": legend})


def reply_bytes(
    bodies: dict[str, wire.NoulQuestion | wire.ChoiceQuestion | wire.ScoreQuestion | wire.BoxQuestion],
    asked: Sequence[tuple[Question, ...]],
    model_name: str,
) -> int:
    """At least the bytes of the reply to a request's questions (`asked[k]`: the core questions
    the k-th was asked as), counted without building it."""
    answers = [answer_bytes(body.type, own) for body, own in zip(bodies.values(), asked, strict=True)]
    return response_bytes(model_name, list(bodies), answers)


def response_bytes(model_name: str, ids: list[str], answers: list[int]) -> int:
    """The reply around its answers (`answers[k]`: the bytes of question `ids[k]`'s)."""
    return object_bytes(
        wire.SystemOneResponse,
        {
            "model": text_bytes(model_name),
            "answers": map_bytes(sum(map(text_bytes, ids)), sum(answers), len(answers)),
            "usage": scalars_bytes(wire.Usage),
            "x_timing": TIMING_BYTES,
        },
    )


# lev's calibration buckets (`{type}:{mode}[:{band}]`, or "default"): the longest bounds every one.
LEV_BUCKET_BYTES = max(
    text_bytes(f"{kind}:{mode}:{band}")
    for kind in ("noul", "noul_binary", "choice", "score")
    for mode in ("A", "B")
    for band in ("small", "mid", "large")
)


def lev_answer_bytes(body: wire.NoulQuestion | wire.ChoiceQuestion | wire.ScoreQuestion) -> int:
    """At least the bytes of a lev model's answer to `body`: its value, the probabilities and
    `x_lev`'s distribution by name (a noul by its rating levels, the larger of lev's readouts)."""
    if isinstance(body, wire.NoulQuestion):
        names = [text_bytes(level) for level in RATING_TEXTS]  # a binary noul's yes, no are fewer
    elif isinstance(body, wire.ChoiceQuestion):
        names = [text_bytes(name) for name in body.criteria]
    else:
        names = [text_bytes(str(i)) for i in range(len(body.criteria))]
    by_name = map_bytes(sum(names), len(names) * FLOAT_BYTES, len(names))
    block = object_bytes(
        wire.LevBlock,
        {
            "mode": text_bytes("A"),
            "bucket": LEV_BUCKET_BYTES,
            "temperature": FLOAT_BYTES,
            "orders": INT_BYTES,
            "confidence": FLOAT_BYTES,
            "distribution": by_name,
        },
    )
    sizes = {
        "type": text_bytes(body.type),
        "x_lev": block,
        "probabilities": by_name,
        "confidence": FLOAT_BYTES,
    }
    if isinstance(body, wire.NoulQuestion):
        return object_bytes(wire.LevNoulAnswer, sizes | {"noul": FLOAT_BYTES})
    if isinstance(body, wire.ChoiceQuestion):
        return object_bytes(wire.LevChoiceAnswer, sizes | {"choice": max(names)})
    legend = map_bytes(sum(names), sum(text_bytes(as_text(level)) for level in body.criteria), len(names))
    return object_bytes(wire.LevScoreAnswer, sizes | {"score": FLOAT_BYTES, "legend": legend})


def lev_reply_bytes(
    bodies: dict[str, wire.NoulQuestion | wire.ChoiceQuestion | wire.ScoreQuestion | wire.BoxQuestion],
    model_name: str,
) -> int:
    """At least the bytes of a lev model's reply to a request's questions (`lev_questions` has
    refused a box before), counted without building it."""
    answers = [lev_answer_bytes(body) for body in bodies.values()]  # type: ignore[arg-type]
    return response_bytes(model_name, list(bodies), answers)
