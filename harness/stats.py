"""Pure statistics for the acceptance commands: readout comparisons, percentiles, ECE and the
group bootstrap. No I/O, so the tests pin every formula on hand-made numbers."""

from __future__ import annotations

import math
import random
from collections.abc import Hashable, Sequence
from typing import Any

from semif_serve.domain.numerics import argmax as top_index  # the first of equal maxima, as torch takes it


def top2_margin(probabilities: Sequence[float]) -> float:
    """The top probability minus the runner-up (1.0 for a single option)."""
    ranked = sorted(probabilities, reverse=True)
    return ranked[0] - ranked[1] if len(ranked) > 1 else 1.0


def top_option(result: dict[str, Any]) -> str:
    """The option id a SemIf result dict chose."""
    return result["option_ids"][top_index(result["probabilities"])]


def probabilities_by_id(result: dict[str, Any]) -> dict[str, float]:
    return dict(zip(result["option_ids"], result["probabilities"], strict=True))


def probability_gap(ours: dict[str, Any], reference: dict[str, Any]) -> float | None:
    """The largest |p_ours - p_ref| over options, matched by option id; None if the ids differ."""
    a, b = probabilities_by_id(ours), probabilities_by_id(reference)
    if set(a) != set(b):
        return None
    return max(abs(a[k] - b[k]) for k in a)


def compare_results(ours: dict[str, Any], reference: dict[str, Any], tie_margin: float) -> dict[str, Any]:
    """One row of a parity comparison: hashes, tops, margins, the probability gap and a verdict.

    kind: "match" (same top), "tie_flip" (different top, and either side's top-2 margin is
    below `tie_margin`: an exact or near tie broken differently), "flip" (a real difference),
    or "option_mismatch" (the two results do not cover the same option ids).
    """
    gap = probability_gap(ours, reference)
    our_top, ref_top = top_option(ours), top_option(reference)
    our_margin, ref_margin = top2_margin(ours["probabilities"]), top2_margin(reference["probabilities"])
    if gap is None:
        kind = "option_mismatch"
    elif our_top == ref_top:
        kind = "match"
    elif min(our_margin, ref_margin) < tie_margin:
        kind = "tie_flip"
    else:
        kind = "flip"
    return {
        "id": ours.get("id", reference.get("id")),
        "kind": kind,
        "same_hash": ours.get("prompt_sha256") == reference.get("prompt_sha256"),
        "identical": ours.get("prompt_sha256") == reference.get("prompt_sha256")
        and ours.get("option_ids") == reference.get("option_ids")
        and ours.get("probabilities") == reference.get("probabilities"),
        "our_top": our_top,
        "reference_top": ref_top,
        "our_margin": our_margin,
        "reference_margin": ref_margin,
        "gap": gap,
    }


def summarise_comparisons(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Counts over compared rows: same top, identical hashes, tie flips, real flips, gaps."""
    gaps = [r["gap"] for r in rows if r["gap"] is not None]
    kinds = [r["kind"] for r in rows]
    return {
        "rows": len(rows),
        "same_top": kinds.count("match"),
        "same_hash": sum(r["same_hash"] for r in rows),
        "identical": sum(r["identical"] for r in rows),
        "tie_flips": kinds.count("tie_flip"),
        "real_flips": kinds.count("flip"),
        "option_mismatches": kinds.count("option_mismatch"),
        "max_gap": max(gaps) if gaps else None,
        "median_gap": median(gaps) if gaps else None,
    }


def median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def accuracy(correct: Sequence[bool]) -> float | None:
    return sum(correct) / len(correct) if correct else None


def group_bootstrap_difference(
    groups: Sequence[Hashable],
    baseline: Sequence[bool],
    treatment: Sequence[bool],
    resamples: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> dict[str, float]:
    """Accuracy of `treatment` minus `baseline`, with a percentile bootstrap CI that resamples
    whole groups with replacement (rows of a group are not independent)."""
    if not (len(groups) == len(baseline) == len(treatment)) or not groups:
        raise ValueError("groups, baseline and treatment must be non-empty and of one length")
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    keys = list(members)
    # Per group: rows, and the summed per-row difference (treatment - baseline).
    per_group = [
        (len(members[k]), sum(int(treatment[i]) - int(baseline[i]) for i in members[k])) for k in keys
    ]
    point = sum(d for _, d in per_group) / len(groups)
    rng = random.Random(seed)
    draws = []
    for _ in range(resamples):
        rows = diff = 0
        for _ in keys:
            n, d = per_group[rng.randrange(len(keys))]
            rows += n
            diff += d
        draws.append(diff / rows)
    tail = (1.0 - level) / 2.0 * 100.0
    return {
        "difference": point,
        "ci_low": percentile(draws, tail),
        "ci_high": percentile(draws, 100.0 - tail),
        "resamples": resamples,
        "groups": len(keys),
        "seed": seed,
    }
