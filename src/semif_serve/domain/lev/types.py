"""lev's vocabulary: the release's files, its settings' values, the questions it reads and the
answers it gives (lev's `types.py`), and its two errors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from semif_serve.domain.types import ConfigurationError, Unanswerable

MANIFEST_FILE = "lev_release.json"
HEAD_FILE = "mode_b_head.pt"
CALIBRATION_FILE = "calibration.json"
TOKENIZER_FILE = "tokenizer.json"

PromptStyle = Literal["plain", "chat"]
NoulReadout = Literal["rating", "binary"]
# A score's orders, in the one vocabulary of `domain.orderings` (lev's names are aliases).
ScoreOrderAverage = Literal["none", "reversal", "rotations"]
SCORE_ORDER_ALIASES = {"off": "none", "reversed": "reversal", "cyclic": "rotations"}  # lev's own names
Mode = Literal["A", "B"]
Order = tuple[int, ...] | None  # shown position j holds the option at index order[j]; None: as given

PROMPT_STYLES: tuple[str, ...] = get_args(PromptStyle)
NOUL_READOUTS: tuple[str, ...] = get_args(NoulReadout)
SCORE_ORDER_AVERAGES: tuple[str, ...] = get_args(ScoreOrderAverage)
BINARY_NOUL_OPTIONS = ("yes", "no")
CHAT_BINARY_DEFAULTS = {"true": "the statement is true", "false": "the statement is false"}
RATING_LEVELS = 9  # digits 0..8 (labels.py NOUL_RATING_TOKENS)
RATING_TEXTS = tuple(str(i) for i in range(RATING_LEVELS))


class LevReleaseError(ConfigurationError):
    """A release (or a setting for it) that cannot be read exactly; names the file and the key."""

    def __init__(self, file: str, key: str | None, problem: str) -> None:
        self.file = file
        self.key = key
        self.problem = problem
        super().__init__(f"{file}: {key}: {problem}" if key else f"{file}: {problem}")


class ModeBUnavailable(Unanswerable):
    """A question lev routes to the candidate head, on a release without one."""


# -- questions and answers ----------------------------------------------------------------------


@dataclass(frozen=True)
class LevNoul:
    """A yes/no question; `criteria` holds optional "true"/"false" descriptions."""

    instructions: Any = None
    criteria: Mapping[str, Any] | None = None
    type: Literal["noul"] = "noul"


@dataclass(frozen=True)
class LevChoice:
    """Pick one of the options; `criteria` maps option names to descriptions, in the caller's order."""

    criteria: Mapping[str, Any]
    instructions: Any = None
    type: Literal["choice"] = "choice"


@dataclass(frozen=True)
class LevScore:
    """Rate against ordered levels, low to high."""

    criteria: tuple[Any, ...]
    instructions: Any = None
    type: Literal["score"] = "score"


LevQuestion = LevNoul | LevChoice | LevScore


@dataclass(frozen=True)
class LevAnswer:
    """One question's answer as lev computes it; `probabilities` in the caller's order.

    noul: `value` is p(yes); `probabilities` the nine rating levels, or None for a binary noul
    (whose two-way distribution is `distribution`). choice: `value` the top option's name.
    score: `value` sum(i * p_i). `lev_confidence` is lev's own statistic (normalised Gini),
    kept for an extra field; System One's `confidence` is computed by the door from
    `probabilities` (see docs/lev.md).
    """

    type: Literal["noul", "choice", "score"]
    value: float | str
    probabilities: tuple[float, ...] | None
    distribution: tuple[float, ...]
    names: tuple[str, ...]
    lev_confidence: float
    mode: Mode
    bucket: str
    temperature: float
    orders: int


def is_int(value: object) -> bool:
    """An int, not a bool (JSON's true is no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)
