"""The System One reply's size, counted before any engine work from the plan of the method that
reads it: each answer's fields as the method counts them (`answer_sizes`), in its type's one
shape, and the reply around them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from semif_serve.doors.systemone import schemas as wire
from semif_serve.service.methods import DecisionMethod
from semif_serve.service.reply_size import PREFILL_BYTES, map_bytes, object_bytes, scalars_bytes, text_bytes

TIMING_BYTES = scalars_bytes(wire.BatchTimingBlock, {"prefill": PREFILL_BYTES})


def answer_bytes(kind: str, sizes: dict[str, int]) -> int:
    """At least the bytes of an answer of `kind` whose fields are at least `sizes`."""
    return object_bytes(wire.ANSWERS[kind], {"type": text_bytes(kind), **sizes})


def reply_bytes(method: DecisionMethod, plan: Any, kinds: Sequence[tuple[str, str]], model_name: str) -> int:
    """At least the bytes of the reply naming `model_name` to the questions `kinds` (each its id
    and type, in order) that `method` planned as `plan`, counted without building it."""
    answers = [answer_bytes(kind, method.answer_sizes(plan, k)) for k, (_, kind) in enumerate(kinds)]
    return response_bytes(model_name, [qid for qid, _ in kinds], answers)


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
