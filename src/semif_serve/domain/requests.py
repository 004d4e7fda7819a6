"""One request from door to engine: what is asked, over which state, under which limits.

A door reads its questions as `AskedQuestion`s (their text as sent) under its `Limits` and
`Defaults`; a method plans them into rows, and SemIf's hands the engine a `RowsRequest` (its
rows over one state, read by one adapter). Nothing is unpacked on the way: every layer reads
the fields it needs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from semif_serve.domain.images import ImageAsset
from semif_serve.domain.types import PromptRow


@dataclass(frozen=True)
class Limits:
    """A door's own bounds on a request."""

    max_input_tokens: int
    max_options: int
    max_rows: int
    max_request_tokens: int | None = None  # tokens over all rows of a request (None: no such budget)
    max_reply_bytes: int | None = None  # the reply's bytes, counted before it is built (None: no budget)


BASE = -1  # the adapter index of a row read by the base weights alone (no adapter)
# The question types a door asks: System One's four, and the native door's question over options.
OPTIONS = "options"
QUESTION_TYPES = ("noul", "choice", "score", "box", OPTIONS)


def as_text(value: Any) -> str:
    """Text as SemIf's prompt reads it: a string as is, structured data as JSON (insertion order kept)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class AskedQuestion:
    """One question as a door read it, for whichever method reads it: its id and type
    (`QUESTION_TYPES`), its text and criteria as sent (structured text kept: each method renders
    them its own way; a noul's true/false descriptions, a choice's descriptions by name, a
    score's levels low to high, the native door's `Option`s), the orderings and workload the
    caller named (None: not named), and each part's field as the door names it (`type`,
    `orderings`, `workload`), for a refusal's message."""

    id: str
    type: str
    instructions: Any = None
    criteria: Any = None
    orderings: str | None = None
    workload: str | None = None
    fields: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Defaults:
    """The operator's defaults per question type for a door's questions that name none:
    orderings and calibration workload (SEMIF_SYSTEMONE_ORDERINGS and _WORKLOADS); a method
    that reads its own orders and calibration leaves them."""

    orderings: Mapping[str, str] = field(default_factory=dict)
    workloads: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RowsRequest:
    """What the engine reads for one call: its rows over one state, under the call's limits.

    `shared=False` with one row runs SemIf's plain forward; otherwise the shared path.
    `images` (each with its placeholder) are shown where their placeholders stand. `adapter` is
    the adapter bank's index its rows read (`BASE`: the base weights alone), resolved once with
    the request's model."""

    state: Any
    rows: tuple[PromptRow, ...]
    shared: bool
    limits: Limits
    images: tuple[ImageAsset, ...] = ()
    adapter: int = BASE

    @classmethod
    def of(
        cls,
        state: Any,
        rows: Sequence[PromptRow],
        *,
        shared: bool,
        max_input_tokens: int,
        max_request_tokens: int | None = None,
        images: Sequence[ImageAsset] = (),
        adapter: int = BASE,
    ) -> RowsRequest:
        """A request of rows alone (no questions, no door): warm-up, tests and benches."""
        limits = Limits(max_input_tokens, 0, len(rows), max_request_tokens)
        return cls(state, tuple(rows), shared, limits, tuple(images), adapter)
