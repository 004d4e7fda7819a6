"""The one home of the small numerics every layer shares: softmax, argmax, ECE, byte units."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MIB = 1024**2
GIB = 1024**3
ECE_BINS = 10


def softmax(values: Sequence[float], temperature: float = 1.0) -> list[float]:
    """softmax(values / temperature), computed stably in float64."""
    scaled = [float(v) / temperature for v in values]
    if not all(math.isfinite(s) for s in scaled):  # v / T overflowed: shift by the largest v first
        top = max(float(v) for v in values)
        scaled = [(float(v) - top) / temperature for v in values]
    peak = max(scaled)
    exps = [math.exp(s - peak) for s in scaled]
    total = math.fsum(exps)
    return [e / total for e in exps]


def argmax(values: Sequence[float]) -> int:
    """The index of the largest value; the first of equal maxima, as torch and SemIf take it."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


@dataclass(frozen=True)
class ConfidenceBin:
    """One equal-width confidence bin: [lower, upper), its row count, mean confidence and accuracy."""

    lower: float
    upper: float
    count: int
    confidence: float
    accuracy: float


def confidence_bins(
    confidences: Sequence[float], correct: Sequence[bool], bins: int = ECE_BINS
) -> list[ConfidenceBin]:
    """Rows grouped into `bins` equal-width confidence bins (empty bins have count 0).

    Bin i holds [i/bins, (i+1)/bins); a confidence of 1.0 goes in the last bin.
    """
    if len(confidences) != len(correct) or not confidences:
        raise ValueError("need the same non-zero number of confidences and correctness flags")
    count, conf_sum, hits = [0] * bins, [0.0] * bins, [0] * bins
    for confidence, ok in zip(confidences, correct, strict=True):
        b = min(int(confidence * bins), bins - 1)
        count[b] += 1
        conf_sum[b] += confidence
        hits[b] += bool(ok)
    return [
        ConfidenceBin(
            lower=b / bins,
            upper=(b + 1) / bins,
            count=count[b],
            confidence=conf_sum[b] / count[b] if count[b] else 0.0,
            accuracy=hits[b] / count[b] if count[b] else 0.0,
        )
        for b in range(bins)
    ]


def binned_ece(per_bin: Sequence[ConfidenceBin]) -> float:
    """ECE from bins: sum of |accuracy - confidence| weighted by each bin's share of the rows."""
    total = sum(b.count for b in per_bin)
    return math.fsum(abs(b.accuracy - b.confidence) * b.count for b in per_bin) / total


def expected_calibration_error(
    confidences: Sequence[float], correct: Sequence[bool], bins: int = ECE_BINS
) -> float:
    """Upstream's top-label ECE: sum over equal-width confidence bins of |accuracy - confidence| * n_b / N."""
    return binned_ece(confidence_bins(confidences, correct, bins))


def top_label_bins(
    probs_rows: Sequence[Sequence[float]], golds: Sequence[int], bins: int = ECE_BINS
) -> list[ConfidenceBin]:
    """`confidence_bins` of probability rows: confidence is each row's top probability."""
    if len(probs_rows) != len(golds):
        raise ValueError("need the same non-zero number of probability rows and golds")
    tops = [argmax(p) for p in probs_rows]
    return confidence_bins(
        [p[t] for p, t in zip(probs_rows, tops, strict=True)],
        [t == g for t, g in zip(tops, golds, strict=True)],
        bins,
    )


def top_label_ece(probs_rows: Sequence[Sequence[float]], golds: Sequence[int], bins: int = ECE_BINS) -> float:
    """ECE of probability rows against gold indices: confidence is each row's top probability."""
    return binned_ece(top_label_bins(probs_rows, golds, bins))
