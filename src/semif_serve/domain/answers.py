"""Answer math that knows no wire format: the distribution an answer reports, its confidence,
its expected score, a box's confidence, and the rows a question needs per ordering.

A door maps these onto its own fields; the formulas are TypeSafe's reference ones, written once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from semif_serve.domain.numerics import argmax
from semif_serve.domain.orderings import CORE_ORDERINGS, MAX_ALL_OPTIONS, order_count
from semif_serve.domain.types import QuestionOutcome


@dataclass(frozen=True)
class Distribution:
    """Probabilities over a question's options, in the caller's option order, keyed by option id."""

    ids: tuple[str, ...]
    probabilities: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.probabilities):
            raise ValueError(f"{len(self.ids)} option ids for {len(self.probabilities)} probabilities")

    def __len__(self) -> int:
        return len(self.probabilities)

    def __iter__(self) -> Iterator[float]:
        return iter(self.probabilities)

    def by_id(self) -> dict[str, float]:
        """The probabilities keyed by option id, in the option order."""
        return dict(zip(self.ids, self.probabilities, strict=True))

    def top(self) -> str:
        """The id of the most probable option (the first of a tie)."""
        return self.ids[argmax(self.probabilities)]


def final_distribution(answer: QuestionOutcome) -> Distribution:
    """The distribution an answer reports, in the caller's option order: calibrated if a workload
    applies, else combined over orderings, else the native readout."""
    ids = tuple(o.id for o in answer.question.options)
    if answer.calibrated is not None:
        values = [float(p) for p in answer.calibrated.probabilities]
    elif answer.combined is not None:
        values = [float(answer.combined.probabilities[i]) for i in ids]
    else:
        values = [float(p) for p in answer.readouts[0].probabilities]
    return Distribution(ids, tuple(values))


def choice_confidence(probabilities: Sequence[float]) -> float:
    """TypeSafe's reference: (m - 1/n) / (1 - 1/n), m the top probability."""
    n = len(probabilities)
    return min(1.0, max(0.0, (max(probabilities) - 1 / n) / (1 - 1 / n)))


def expected_score(probabilities: Sequence[float]) -> float:
    """sum(i * p_i): the levels are 0, 1, ..., n-1."""
    return float(sum(i * p for i, p in enumerate(probabilities)))


def score_confidence(probabilities: Sequence[float]) -> float:
    """TypeSafe's reference: max(0, 1 - sum_i p_i |i - k| / D), k the mode,
    D = (1/n) sum_i |i - (n-1)/2|."""
    n = len(probabilities)
    k = argmax(probabilities)
    spread = sum(abs(i - (n - 1) / 2) for i in range(n)) / n
    return min(1.0, max(0.0, 1 - sum(p * abs(i - k) for i, p in enumerate(probabilities)) / spread))


def box_confidence(marginals: Sequence[Sequence[float]]) -> float:
    """The least sure edge's: the score confidence of each edge's distribution after the pair rule
    (positions are evenly spaced levels), the smallest of the four."""
    return min(score_confidence(m) for m in marginals)


def rows_needed(options: int, mode: object, asked: int = 1) -> int:
    """The rows `asked` questions of `options` options need in ordering `mode` (a name of
    CORE_ORDERINGS); one row where the count or the mode cannot be asked (left to validation)."""
    if not isinstance(mode, str) or mode not in CORE_ORDERINGS or options < 2:
        return 1
    if mode == "all" and options > MAX_ALL_OPTIONS:
        return 1
    return asked * order_count(options, CORE_ORDERINGS[mode])
