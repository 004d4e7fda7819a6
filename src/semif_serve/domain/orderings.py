"""Order averaging: which option orders a question is asked in, and the combined answer."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Literal

from semif_serve.domain.numerics import argmax, softmax
from semif_serve.domain.types import Combined, Ordering

COMBINE_METHOD = "log-mean"
# Calibration modes: one per orderings value, "single" for a question asked once.
NATIVE_MODES = ("single", "rotations", "all")  # what the native door can ask
MODES = (*NATIVE_MODES, "shifts", "reversal")  # System One adds the bounded modes
MAX_ALL_OPTIONS = 4  # every permutation of 5 options would be 120 rows
MAX_SHIFTS = 4  # "shifts": at most this many evenly spaced cyclic shifts, whatever the option count

ANSWER_TYPES = ("noul", "choice", "score")
NO_ORDERINGS = "none"
# Which orderings each question type may be asked in: score levels and box positions keep their
# order (reversal only). A box has no operator default (SEMIF_SYSTEMONE_ORDERINGS): asked once.
ALLOWED_ORDERINGS: dict[str, tuple[str, ...]] = {
    "noul": (NO_ORDERINGS, "rotations", "reversal"),
    "choice": (NO_ORDERINGS, "rotations", "shifts", "reversal", "all"),
    "score": (NO_ORDERINGS, "reversal"),
    "box": (NO_ORDERINGS, "reversal"),  # per edge question; positions keep their order (domain/boxes.py)
}
OrderingName = Literal["none", "rotations", "shifts", "reversal", "all"]
# The core's orderings for each name (`none`: asked once, in the caller's order).
CORE_ORDERINGS: dict[str, Ordering | None] = {
    NO_ORDERINGS: None,
    "rotations": "rotations",
    "shifts": "shifts",
    "reversal": "reversal",
    "all": "all",
}


def option_orders(n: int, mode: str | None) -> list[tuple[int, ...]]:
    """The orders (indices into the caller's options) to ask; the caller's own order comes first.

    rotations: every cyclic shift (n rows); shifts: min(n, MAX_SHIFTS) cyclic shifts evenly spaced
    (start k*n//count); reversal: the caller's order and its reverse (keeps ordinal adjacency);
    all: every permutation, lexicographic.
    """
    identity = tuple(range(n))
    if mode is None:
        return [identity]
    if mode == "rotations":
        return [tuple((start + i) % n for i in range(n)) for start in range(n)]
    if mode == "all":
        return list(itertools.permutations(identity))
    if mode == "shifts":
        count = min(n, MAX_SHIFTS)
        starts = [(k * n) // count for k in range(count)]
        return [tuple((start + i) % n for i in range(n)) for start in starts]
    if mode == "reversal":
        return [identity, identity[::-1]]
    raise ValueError(f"unknown orderings mode {mode!r}")


def order_count(n: int, mode: str | None) -> int:
    """How many orders `option_orders(n, mode)` gives, without building them."""
    counts = {
        None: 1,
        "rotations": n,
        "all": math.factorial(n),
        "shifts": min(n, MAX_SHIFTS),
        "reversal": 2,
    }
    if mode not in counts:
        raise ValueError(f"unknown orderings mode {mode!r}")
    return counts[mode]


def mean_option_logits(
    n: int, orders: Sequence[Sequence[int]], logits_per_order: Sequence[Sequence[float]]
) -> list[float]:
    """Each option's logit averaged over the orders it was asked in (caller's option order)."""
    sums = [0.0] * n
    for order, logits in zip(orders, logits_per_order, strict=True):
        for slot, option in enumerate(order):
            sums[option] += logits[slot]
    return [s / len(orders) for s in sums]


def combine(
    option_ids: Sequence[str],
    orders: Sequence[Sequence[int]],
    logits_per_order: Sequence[Sequence[float]],
    mode: str,
) -> Combined:
    """The combined answer over orderings.

    probabilities: softmax of each option's mean logit (= the renormalised log-mean of its
    probabilities); top: the most probable option; agreement: the share of orderings whose own
    argmax is top; spread: the largest minus the smallest probability any ordering gave top.
    """
    n = len(option_ids)
    probs = softmax(mean_option_logits(n, orders, logits_per_order))
    top = argmax(probs)
    agree = 0
    top_probs = []
    for order, logits in zip(orders, logits_per_order, strict=True):
        p = softmax(logits)
        if order[argmax(p)] == top:
            agree += 1
        top_probs.append(p[list(order).index(top)])
    return Combined(
        mode=mode,
        orderings=len(orders),
        probabilities={option_ids[i]: probs[i] for i in range(n)},
        top=option_ids[top],
        agreement=agree / len(orders),
        spread=max(top_probs) - min(top_probs),
    )


# -- the operator's per-type maps (SEMIF_SYSTEMONE_ORDERINGS, SEMIF_SYSTEMONE_WORKLOADS) ------------


def parse_type_map(text: str) -> dict[str, str]:
    """`"noul=a,choice=b"` -> `{"noul": "a", "choice": "b"}`; every key an answer type, once."""
    mapping: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not value:
            raise ValueError(f"{item!r} is not <type>=<value>")
        if kind not in ANSWER_TYPES:
            raise ValueError(f"{kind!r} is not an answer type ({', '.join(ANSWER_TYPES)})")
        if kind in mapping:
            raise ValueError(f"{kind!r} appears more than once")
        mapping[kind] = value
    return mapping


def orderings_policy(text: str) -> dict[str, str]:
    """Every answer type's default orderings: `none`, or `<type>=<mode>,...` (a type left out: none)."""
    if text.strip() == NO_ORDERINGS:
        return dict.fromkeys(ANSWER_TYPES, NO_ORDERINGS)
    policy = dict.fromkeys(ANSWER_TYPES, NO_ORDERINGS) | parse_type_map(text)
    for kind, mode in policy.items():
        if mode not in ALLOWED_ORDERINGS[kind]:
            raise ValueError(f"{kind}={mode} is not allowed (allowed: {', '.join(ALLOWED_ORDERINGS[kind])})")
    return policy
