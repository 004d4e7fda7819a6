"""Box questions: where something is in an image, read as four edge questions, no generation.

A box is four edges. Each edge is asked as an ordinary option-letter question whose options
are `POSITIONS` evenly spaced positions of the image's side (0, 0.05, ..., 1: fractions of
the height from the top for `top`/`bottom`, of the width from the left for `left`/`right`),
so every edge is a probability distribution over positions read in the same batch as the
other questions of the request.

The pair rule: `top < bottom` and `left < right` hold by construction. The two edges of a
side are read jointly, `w_ij = p_i q_j` over the ordered pairs `i < j` only (p the low
edge's distribution, q the high edge's), renormalised; each edge is its expected position
under that joint distribution (what the format says each coordinate is). As every ordered
pair has `x_i < x_j`, so do the expectations. See docs/images.md.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from semif_serve.domain.types import Option, Ordering, Question

EDGES = ("top", "bottom", "left", "right")
POSITIONS = 21  # 0, 0.05, ..., 1: a resolution of 5% of the side
DEFAULT_TARGET = "the main subject of the image"
# A probability of exactly 0 (a float64 softmax that underflowed) weighs as the smallest normal float.
FLOOR = sys.float_info.min

# Per edge: how far along which side, which extreme of the object it touches, and the scale.
_EDGE_WORDING = {
    "top": ("down from the top", "top", "highest", "height", "its top", "its bottom"),
    "bottom": ("down from the top", "bottom", "lowest", "height", "its top", "its bottom"),
    "left": ("across from the left", "left", "leftmost", "width", "its left side", "its right side"),
    "right": ("across from the left", "right", "rightmost", "width", "its left side", "its right side"),
}


def positions(count: int = POSITIONS) -> tuple[float, ...]:
    """`count` evenly spaced positions from 0 to 1, both ends included."""
    if count < 2:
        raise ValueError(f"a side needs at least 2 positions, not {count}")
    return tuple(i / (count - 1) for i in range(count))


def position_id(position: float) -> str:
    """An edge option's id: the position with two decimals (`0.05`)."""
    return f"{position:.2f}"


def edge_text(edge: str, target: str) -> str:
    """The criterion an edge question asks: the target, which edge measured from where, and the
    scale its options are on (so that each option can be a bare percentage)."""
    along, name, extreme, side, start, end = _EDGE_WORDING[edge]
    return (
        f"Locate in the image: {target}\n"
        f"How far {along} of the image is the {name} edge of the smallest box around it "
        f"(its {extreme} point)? Each option is a percentage of the image's {side}, "
        f"from 0% ({start}) to 100% ({end})."
    )


def edge_options(count: int = POSITIONS) -> tuple[Option, ...]:
    """An edge's options, low to high: id the position (`"0.05"`), description its percentage
    of the side (`"5%"`); the same for every edge, the criterion says which side."""
    return tuple(Option(position_id(x), f"{round(x * 100)}%") for x in positions(count))


def edge_questions(
    question_id: str,
    target: str,
    *,
    orderings: Ordering | None = None,
    workload: str | None = None,
    count: int = POSITIONS,
) -> tuple[Question, ...]:
    """The four edge questions (in `EDGES` order) a box question about `target` is asked as;
    each keeps the box question's id, so a refusal names it."""
    return tuple(
        Question(
            id=question_id,
            text=edge_text(edge, target),
            options=edge_options(count),
            orderings=orderings,
            workload=workload,
        )
        for edge in EDGES
    )


@dataclass(frozen=True)
class PairReading:
    """Two edges of one side read jointly: their expected positions (`low < high`) and each
    edge's marginal distribution over the positions under the ordered joint."""

    low: float
    high: float
    low_marginal: tuple[float, ...]
    high_marginal: tuple[float, ...]


def _within(at: Sequence[float], value: float) -> float:
    """An expected position kept within the positions' span (marginals normalised by a division
    can sum to 1 plus an ulp, and put the expectation an ulp past the last position)."""
    return min(max(value, at[0]), at[-1])


def read_pair(low: Sequence[float], high: Sequence[float], at: Sequence[float] | None = None) -> PairReading:
    """The pair rule: the joint `p_i q_j` over ordered pairs `i < j` of positions `at`,
    renormalised, and each edge's expectation under it.

    Computed in log space (the largest pair weighs 1), so it never divides by zero: when the
    readings leave no representable mass on ordered pairs (a probability of 0 counts as
    `FLOOR`), the weights that remain decide, and at worst every ordered pair weighs the same.
    """
    at = positions(len(low)) if at is None else tuple(at)
    if not len(low) == len(high) == len(at) >= 2:
        raise ValueError("both edges need one probability per position, and at least 2 positions")
    if any(b <= a for a, b in zip(at, at[1:], strict=False)):
        raise ValueError("positions must increase")
    a = [math.log(max(p, FLOOR)) for p in low]
    b = [math.log(max(q, FLOOR)) for q in high]
    n = len(at)
    peak = max(a[i] + b[j] for i in range(n) for j in range(i + 1, n))
    low_mass = [0.0] * n
    high_mass = [0.0] * n
    for i in range(n):
        for j in range(i + 1, n):
            weight = math.exp(a[i] + b[j] - peak)
            low_mass[i] += weight
            high_mass[j] += weight
    total = math.fsum(low_mass)
    # A share is at most 1 (a division by the total can overshoot it by an ulp).
    low_marginal = tuple(min(1.0, m / total) for m in low_mass)
    high_marginal = tuple(min(1.0, m / total) for m in high_mass)
    return PairReading(
        low=_within(at, math.fsum(m * x for m, x in zip(low_marginal, at, strict=True))),
        high=_within(at, math.fsum(m * x for m, x in zip(high_marginal, at, strict=True))),
        low_marginal=low_marginal,
        high_marginal=high_marginal,
    )


@dataclass(frozen=True)
class BoxReading:
    """A box: its edges (fractions of the height from the top, of the width from the left) and
    each edge's distribution over the positions after the pair rule (by edge name)."""

    top: float
    bottom: float
    left: float
    right: float
    marginals: dict[str, tuple[float, ...]]


def read_box(
    top: Sequence[float],
    bottom: Sequence[float],
    left: Sequence[float],
    right: Sequence[float],
    at: Sequence[float] | None = None,
) -> BoxReading:
    """The box from its four edges' probability vectors over positions `at` (default: evenly
    spaced from 0 to 1): each side read jointly by the pair rule, so top < bottom and
    left < right."""
    vertical = read_pair(top, bottom, at)
    horizontal = read_pair(left, right, at)
    return BoxReading(
        top=vertical.low,
        bottom=vertical.high,
        left=horizontal.low,
        right=horizontal.high,
        marginals={
            "top": vertical.low_marginal,
            "bottom": vertical.high_marginal,
            "left": horizontal.low_marginal,
            "right": horizontal.high_marginal,
        },
    )
