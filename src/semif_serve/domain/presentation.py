"""Presentation checks: does an answer move with where an option is listed? Label-free, over any
states (lev's ADR-029 checks, `lev presentation-checks`; docs/presentation-checks.md).

Per question kind, over every state:

- **identical**: every option carries the same text, so the options differ only by position
  and code. Per configuration (text, option count 3, 4, 5; a noul's two sides: 2), slot 0's
  log-probability minus the mean over the slots; a state's value is the mean over its
  configurations, the metric the mean over states. 0 is no position effect; above 0 the first
  slot is favoured, below 0 disfavoured.
- **first_slot**: three real options in all 3! = 6 orders. Every option sits in every slot
  twice, so an order-free answer picks slot 0 in exactly 1/3 of the decisions; a tie is split
  between the tied slots. `consistent`: the share of states whose six orders all pick one option.

Each metric carries leave-one-out bounds (the mean without each state in turn: min and max) and
its gate: lev's (identical >= -0.20 on raw scores, first_slot >= 0.15) mirrored around the
order-free value, since a small model leans towards the first slot as often as away from it.
Calibration divides the identical metric by the workload's T and leaves the first-slot rate
as it is (the argmax never changes).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

KINDS = ("choice", "score", "noul")
IDENTICAL_KS = (3, 4, 5)
NOUL_SIDES = ("true", "false")
SLOT0_GATE = -0.20  # lev's gate (Laya's), set on raw scores
FIRST_SLOT_GATE = 0.15  # lev's
ORDER_FREE = 1 / 3  # three options, every order: slot 0 wins a third of the time without a position effect
SLOT0_GATE_MAX = -SLOT0_GATE
FIRST_SLOT_GATE_MAX = 2 * ORDER_FREE - FIRST_SLOT_GATE
TOLERANCE = 0.05  # lev's default drift tolerance
LOG_FLOOR = 1e-300  # a probability that underflowed to 0 still has a finite log
PROBE_VERSION = "lev-adr-029-en+noul/1"

Check = Literal["identical", "perm"]

# The probe's wording is lev's English probe (its presentation.py, after Laya's); the noul is ours.
PROBE_TEXT: dict[str, dict[str, Any]] = {
    "score": {
        "instructions": "How urgent is this request?",
        "identical": ("moderate", "a request"),
        "options": ("Not urgent", "Soon", "Work is blocked"),
    },
    "choice": {
        "instructions": "Which team should handle this message?",
        "identical": ("a team", "a request"),
        "options": {
            "Billing": "payments, refunds, invoices",
            "Technical": "bugs, outages, errors",
            "Sales": "plans, contracts, quotes",
        },
    },
    "noul": {
        "instructions": "Does this message need an answer today?",
        "identical": ("a request", "moderate"),
    },
}


@dataclass(frozen=True)
class Probe:
    """One probe question: its id, kind, check, the System One question, and what it varies
    (`config` "text|k" of an identical probe, `order` the option indices a permuted probe shows)."""

    id: str
    kind: str
    check: Check
    question: Mapping[str, Any]
    config: str | None = None
    order: tuple[int, ...] | None = None

    @property
    def size(self) -> int:
        """How many options the question lists."""
        criteria = self.question.get("criteria")
        return len(criteria) if criteria is not None else len(NOUL_SIDES)

    @property
    def names(self) -> tuple[str, ...]:
        """The option names in the order shown (a score's levels "0".."n-1", a noul's sides)."""
        criteria = self.question["criteria"]
        if self.kind == "noul":
            return NOUL_SIDES
        if self.kind == "score":
            return tuple(str(i) for i in range(len(criteria)))
        return tuple(criteria)


def probes(kind: str) -> list[Probe]:
    """Every probe of `kind` for one state: the identical configurations (text x option count),
    then the three real options in all six orders (none for a noul, whose sides are fixed)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r} (kinds: {', '.join(KINDS)})")
    spec = PROBE_TEXT[kind]
    found: list[Probe] = []
    for text in spec["identical"]:
        for k in (len(NOUL_SIDES),) if kind == "noul" else IDENTICAL_KS:
            found.append(
                Probe(
                    f"{kind}|identical|{text}|{k}",
                    kind,
                    "identical",
                    identical_question(kind, text, k, spec["instructions"]),
                    config=f"{text}|{k}",
                )
            )
    if kind == "noul":
        return found
    options = list(spec["options"])
    for order in itertools.permutations(range(len(options))):
        shown = [options[i] for i in order]
        criteria = shown if kind == "score" else {name: spec["options"][name] for name in shown}
        question = {"type": kind, "instructions": spec["instructions"], "criteria": criteria}
        found.append(Probe(f"{kind}|perm|{''.join(map(str, order))}", kind, "perm", question, order=order))
    return found


def identical_question(kind: str, text: str, k: int, instructions: str) -> dict[str, Any]:
    """A question whose k options all read `text` (choice names "1".."k": names must differ)."""
    if kind == "score":
        return {"type": "score", "instructions": instructions, "criteria": [text] * k}
    if kind == "noul":
        return {"type": "noul", "instructions": instructions, "criteria": dict.fromkeys(NOUL_SIDES, text)}
    return {"type": "choice", "instructions": instructions, "criteria": {str(i + 1): text for i in range(k)}}


def slot_probabilities(probe: Probe, by_name: Mapping[str, float]) -> list[float]:
    """An answer's probabilities in the order its options were shown."""
    return [float(by_name[name]) for name in probe.names]


def log_mean(readings: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The combined answer of several reads at T = 1 (SemIf's log-mean): each option's mean
    log-probability, renormalised. Equal to the softmax of the mean logits, since each read's
    log-probabilities are its logits less one constant."""
    names = list(readings[0])
    means = [sum(math.log(max(r[name], LOG_FLOOR)) for r in readings) / len(readings) for name in names]
    peak = max(means)
    exps = [math.exp(m - peak) for m in means]
    total = math.fsum(exps)
    return {name: e / total for name, e in zip(names, exps, strict=True)}


def slot0_lean(p: Sequence[float]) -> float:
    """Slot 0's log-probability minus the mean log-probability over the slots."""
    logs = [math.log(max(x, LOG_FLOOR)) for x in p]
    return logs[0] - sum(logs) / len(logs)


def top_slots(p: Sequence[float]) -> list[int]:
    """Every slot holding the largest probability (a tie names them all)."""
    best = max(p)
    return [i for i, x in enumerate(p) if x == best]


def leave_one_out(per_state: Sequence[float]) -> list[float]:
    """[min, max] of the mean without each state in turn (one state: its own value twice)."""
    n, total = len(per_state), math.fsum(per_state)
    means = [(total - x) / (n - 1) for x in per_state] if n > 1 else list(per_state)
    return [min(means), max(means)]


def mean(values: Sequence[float]) -> float:
    """The arithmetic mean (fsum)."""
    return math.fsum(values) / len(values)


def within(value: float, low: float, high: float) -> bool:
    """Whether `value` passes a gate [low, high]."""
    return low <= value <= high


def identical_metric(states: Sequence[Mapping[str, Sequence[float]]], read: str) -> dict[str, Any] | None:
    """The identical-option control from each state's identical probes (config -> slot
    probabilities); None when no configuration was read."""
    per_state: list[float] = []
    by_config: dict[str, list[float]] = {}
    for answers in states:
        if not answers:
            return None
        values = {config: slot0_lean(p) for config, p in answers.items()}
        per_state.append(mean(list(values.values())))
        for config, value in values.items():
            by_config.setdefault(config, []).append(value)
    if not per_state:
        return None
    metric = mean(per_state)
    return {
        "metric": metric,
        "leave_one_out": leave_one_out(per_state),
        "gate": SLOT0_GATE,
        "gate_max": SLOT0_GATE_MAX,
        "passed": within(metric, SLOT0_GATE, SLOT0_GATE_MAX),
        "read": read,
        "by_config": {config: mean(values) for config, values in by_config.items()},
    }


def first_slot_metric(
    states: Sequence[Sequence[tuple[tuple[int, ...], Sequence[float]]]],
) -> dict[str, Any] | None:
    """The first-slot rate from each state's permuted probes ((order shown, slot probabilities)
    each); None for a kind without them (a noul)."""
    if not states or not states[0]:
        return None
    per_state: list[float] = []
    by_slot = [0.0] * len(states[0][0][0])
    consistent = 0
    for permuted in states:
        firsts: list[float] = []
        picks: set[frozenset[int]] = set()
        for order, p in permuted:
            top = top_slots(p)
            for slot in top:
                by_slot[slot] += 1 / len(top)
            firsts.append(1 / len(top) if 0 in top else 0.0)
            picks.add(frozenset(order[slot] for slot in top))
        per_state.append(mean(firsts))
        consistent += len(picks) == 1
    metric = mean(per_state)
    return {
        "metric": metric,
        "leave_one_out": leave_one_out(per_state),
        "gate": FIRST_SLOT_GATE,
        "gate_max": FIRST_SLOT_GATE_MAX,
        "passed": within(metric, FIRST_SLOT_GATE, FIRST_SLOT_GATE_MAX),
        "decisions": sum(len(permuted) for permuted in states),
        "argmax_by_slot": by_slot,
        "consistent": consistent / len(states),
    }


def kind_metrics(
    kind: str, states: Sequence[Mapping[str, Mapping[str, float]]], read: str
) -> dict[str, dict[str, Any] | None]:
    """Both checks of `kind` from each state's answers (probe id -> probabilities by option name);
    a probe missing from a state's answers (not asked under this ordering) is left out."""
    identical: list[dict[str, list[float]]] = []
    permuted: list[list[tuple[tuple[int, ...], list[float]]]] = []
    kind_probes = probes(kind)
    for answers in states:
        identical.append(
            {
                probe.config: slot_probabilities(probe, answers[probe.id])
                for probe in kind_probes
                if probe.check == "identical" and probe.config is not None and probe.id in answers
            }
        )
        permuted.append(
            [
                (probe.order, slot_probabilities(probe, answers[probe.id]))
                for probe in kind_probes
                if probe.check == "perm" and probe.order is not None and probe.id in answers
            ]
        )
    return {"identical": identical_metric(identical, read), "first_slot": first_slot_metric(permuted)}


def passes(checks: Mapping[str, Mapping[str, Any] | None]) -> bool:
    """Whether every check that was measured passes its gate."""
    return all(check["passed"] for check in checks.values() if check is not None)


# -- comparing two reports -----------------------------------------------------------------------


def metric_values(report: Mapping[str, Any]) -> dict[str, float]:
    """Every compared number of a report's `checks`, by dotted name
    (`choice.none.raw.first_slot`, `...first_slot.consistent`)."""
    values: dict[str, float] = {}
    for kind, orderings in report.get("checks", {}).items():
        for ordering, entry in orderings.items():
            for scores in ("calibrated", "raw"):
                block = entry.get(scores)
                if not block:
                    continue
                for check, result in block.items():
                    if result is None:
                        continue
                    name = f"{kind}.{ordering}.{scores}.{check}"
                    values[name] = result["metric"]
                    if "consistent" in result:
                        values[f"{name}.consistent"] = result["consistent"]
    return values


def drift(report: Mapping[str, Any], committed: Mapping[str, Any], tolerance: float) -> list[str]:
    """Every metric of `committed` that this run lacks or that moved by more than `tolerance`."""
    now = metric_values(report)
    moved = []
    for name, before in metric_values(committed).items():
        if name not in now:
            moved.append(f"{name}: missing from this run")
        elif abs(now[name] - before) > tolerance:
            moved.append(f"{name}: {before:+.4f} -> {now[name]:+.4f} (tolerance {tolerance})")
    return moved


def settings_mismatch(saved: Mapping[str, Any], run: Mapping[str, Any], keys: Sequence[str]) -> list[str]:
    """Each of `keys` the saved settings hold with another value than this run's."""
    return [
        f"{key} (report: {saved[key]!r}, run: {run.get(key)!r})"
        for key in keys
        if key in saved and saved[key] != run.get(key)
    ]


# -- from measurement to setting -------------------------------------------------------------------


def cheapest_passing(
    measured: Mapping[str, Mapping[str, Any]], by_cost: Sequence[str]
) -> tuple[str | None, str | None]:
    """(the first ordering of `by_cost` whose raw checks all pass, the most even one measured):
    the most even has its raw first-slot rate nearest the order-free value, then the smallest
    identical lean (the cheaper on a tie), for when none passes."""
    candidates = [o for o in by_cost if o in measured and measured[o].get("raw")]
    passing = next((o for o in candidates if passes(measured[o]["raw"])), None)

    def unevenness(ordering: str) -> tuple[float, float]:
        raw = measured[ordering]["raw"]
        first = abs(raw["first_slot"]["metric"] - ORDER_FREE) if raw.get("first_slot") else 0.0
        lean = abs(raw["identical"]["metric"]) if raw.get("identical") else math.inf
        return first, lean

    evenest = min(candidates, key=unevenness) if candidates else None
    return passing, evenest
