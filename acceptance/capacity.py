"""The capacity table's parts: a time box, the row-count search, and the probe that asks the
service whether n binary decisions over one state run in ONE forward."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from harness.client import Client, ServiceCallError
from harness.workloads import binary_criteria

MEMORY_REFUSALS = {
    (503, "out_of_memory"): "out_of_memory",
    (413, "too_large_for_memory"): "too_large_for_memory",
}


@dataclass
class Deadline:
    """Seconds left of a time box that started at construction."""

    seconds: float
    started: float = field(default_factory=time.monotonic)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def allows(self, needed: float) -> bool:
        return self.left() >= needed


@dataclass
class CapacitySearch:
    """The outcome of one capacity search: the largest fitting row count and every probe."""

    fits: int
    first_failure: int | None
    capped: bool
    probes: list[tuple[int, bool]]
    complete: bool


def find_capacity(
    probe: Callable[[int], bool],
    hint: int,
    limit: int,
    keep_going: Callable[[], bool] = lambda: True,
) -> CapacitySearch:
    """The largest n in 1..limit with probe(n) true, assuming fitting is monotone in n.

    Brackets from `hint` (x1.5 up while it fits, /2 down while it fails), then bisects.
    `keep_going` is asked before each probe; when it says no, the best bracket so far is
    returned with complete=False. probe(1) failing gives fits=0."""
    probes: list[tuple[int, bool]] = []

    def ask(n: int) -> bool:
        ok = probe(n)
        probes.append((n, ok))
        return ok

    lo, hi = 0, None  # lo fits (0: nothing known to fit), hi fails
    n = max(1, min(hint, limit))
    while True:
        if not keep_going():
            return CapacitySearch(lo, hi, False, probes, False)
        if ask(n):
            lo = n
            if n >= limit:
                return CapacitySearch(lo, None, True, probes, True)
            if hi is not None:
                break
            n = min(limit, max(n + 1, int(n * 1.5)))
        else:
            hi = n
            if lo:
                break
            if n == 1:
                return CapacitySearch(0, 1, False, probes, True)
            n = max(1, n // 2)
    while hi - lo > 1:
        if not keep_going():
            return CapacitySearch(lo, hi, False, probes, False)
        mid = (lo + hi) // 2
        if ask(mid):
            lo = mid
        else:
            hi = mid
    return CapacitySearch(lo, hi, False, probes, True)


def capacity_decisions(n: int) -> list[dict[str, Any]]:
    """n binary decisions with unique ids (the criteria repeat past 50; the rows do not share)."""
    base = binary_criteria(50)
    return [{**base[i % len(base)], "id": f"d{i:04d}"} for i in range(n)]


@dataclass
class CapacityProbe:
    """probe(n) for one state: does /decide/shared with n binary decisions run in one forward?

    `split_counts` says whether a reply that ran in several forward batches (the engine's
    estimate, or the batcher's row bound, at work) counts as fitting; a 503 out_of_memory or a
    413 too_large_for_memory never does. Every outcome is kept, and the suffix width seen."""

    client: Client
    state: str
    split_counts: bool
    outcomes: list[tuple[int, str]] = field(default_factory=list)
    suffix_width: int | None = None
    prefix_tokens: int | None = None

    def __call__(self, n: int) -> bool:
        outcome = self.ask(n)
        return outcome == "ok" or (self.split_counts and outcome.startswith("split"))

    def ask(self, n: int) -> str:
        """One request of n rows: `ok` (one forward), `split into k`, or the memory refusal's code."""
        try:
            reply, _ = self.client.decide_shared(self.state, capacity_decisions(n))
        except ServiceCallError as exc:
            code = MEMORY_REFUSALS.get((exc.status, exc.code))
            if code is None:
                raise
            self.outcomes.append((n, code))
            return code
        timing = reply["timing"]
        batches = timing.get("forward_batches", 1)
        self.prefix_tokens = timing.get("prefix_tokens")
        if batches == 1:
            self.suffix_width = timing["padded_suffix_tokens"] // max(1, timing["batch_size"])
        outcome = "ok" if batches == 1 else f"split into {batches}"
        self.outcomes.append((n, outcome))
        return outcome

    def count(self, code: str) -> int:
        return sum(1 for _, outcome in self.outcomes if outcome == code)
