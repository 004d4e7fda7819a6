"""One request from door to engine: what is asked, over which state, under which limits.

A door builds a `DecisionRequest` (its questions, the state, its limits and images); the core
plans its rows and hands the engine the `RowsRequest` of the same call (`with_rows`). Nothing
is unpacked on the way: every layer reads the fields it needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from semif_serve.domain.images import ImageAsset
from semif_serve.domain.types import PromptRow, Question


@dataclass(frozen=True)
class Limits:
    """A door's own bounds on a request."""

    max_input_tokens: int
    max_options: int
    max_rows: int
    max_request_tokens: int | None = None  # tokens over all rows of a request (None: no such budget)
    max_reply_bytes: int | None = None  # the reply's bytes, counted before it is built (None: no budget)


@dataclass(frozen=True)
class RowsRequest:
    """What the engine reads for one call: its rows over one state, under the call's limits.

    `shared=False` with one row runs SemIf's plain forward; otherwise the shared path.
    `images` (each with its placeholder) are shown where their placeholders stand. `model` is
    the served adapter its rows read (its name; None: the base)."""

    state: Any
    rows: tuple[PromptRow, ...]
    shared: bool
    limits: Limits
    images: tuple[ImageAsset, ...] = ()
    model: str | None = None

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
        model: str | None = None,
    ) -> RowsRequest:
        """A request of rows alone (no questions, no door): warm-up, tests and benches."""
        limits = Limits(max_input_tokens, 0, len(rows), max_request_tokens)
        return cls(state, tuple(rows), shared, limits, tuple(images), model)


@dataclass(frozen=True)
class DecisionRequest:
    """One call of a door: its questions over a state, its limits, its images, the door's
    count of the reply it would send (`reply_bytes`, held to `limits.max_reply_bytes`) and the
    served adapter that reads it (`model`, its name; None: the base), and the model's name as
    the reply gives it (`served_as`; None where the door names none)."""

    state: Any
    questions: tuple[Question, ...]
    shared: bool
    limits: Limits
    images: tuple[ImageAsset, ...] = ()
    reply_bytes: int = 0
    model: str | None = None
    served_as: str | None = None

    def with_rows(self, rows: Sequence[PromptRow]) -> RowsRequest:
        """The engine's request for this call, once its questions are planned into `rows`."""
        return RowsRequest(self.state, tuple(rows), self.shared, self.limits, self.images, self.model)
