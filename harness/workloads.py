"""Synthetic decisions of a chosen size, shared by `latency`, `gpu_run` and the benchmarks.

States are deterministic filler text whose token count is fitted against the live service
(its `input_tokens` or `timing.prefix_tokens`), so a "~2,000-token state" means 2,000 tokens
of whatever tokenizer the service runs, not a guess from word counts.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .client import Client

_SUBJECTS = (
    "the release",
    "the billing service",
    "the on-call engineer",
    "zone two",
    "the customer",
    "the nightly backup",
    "the refund queue",
    "the load balancer",
    "the database replica",
    "the support ticket",
    "the password reset",
    "the health check",
    "the deployment",
)
_VERBS = (
    "reported",
    "recovered after",
    "mentioned",
    "failed during",
    "passed",
    "retried",
    "escalated",
    "acknowledged",
    "rolled back",
    "logged",
    "resolved",
    "delayed",
)
_OBJECTS = (
    "ten minutes of errors",
    "a refund request",
    "the invoice",
    "three zones",
    "a timeout",
    "the maintenance window",
    "an expired certificate",
    "the audit",
    "a duplicate charge",
    "the rollout plan",
    "a disk alert",
    "the status page",
)

YES_NO = [{"id": "yes", "description": "Yes."}, {"id": "no", "description": "No."}]
DEPLOYMENT_QUESTION = "Did the deployment succeed?"
DEPLOYMENT_OPTIONS = [
    {"id": "yes", "description": "It succeeded."},
    {"id": "no", "description": "It failed."},
]
QUEUE_QUESTION = "Which queue should handle this ticket?"
QUEUE_OPTIONS = [
    {"id": "billing", "description": "Billing."},
    {"id": "accounts", "description": "Accounts."},
    {"id": "support", "description": "Technical support."},
]
_TOPICS = (
    "a refund request",
    "an outage",
    "a billing error",
    "a password reset",
    "a security issue",
    "a duplicate charge",
    "a rollback",
    "a customer complaint",
    "a data loss",
    "a timeout",
    "an expired certificate",
    "a maintenance window",
    "an escalation",
    "a disk alert",
    "a failed backup",
    "a legal request",
    "a price change",
    "a cancelled order",
    "a missed deadline",
    "a hardware fault",
    "a configuration change",
    "a slow query",
    "an audit finding",
    "a new feature",
    "a translation error",
)


def filler(words: int, seed: int = 0) -> str:
    """`words` words of plausible operations prose; the first n words never depend on `words`.

    The text never ends with a period: with the demo tokenizer `."` merges across the state
    prefix's cut, which the service has to cut back (and before 1856b9f dropped the prefix
    entirely); fitted sizes should not depend on that."""
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < words:
        sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}."
        out.extend(sentence.capitalize().split())
    return " ".join(out[:words]).rstrip(".")


def binary_criteria(n: int) -> list[dict[str, Any]]:
    """n distinct binary criteria (shared-request decisions, no state)."""
    if n > len(_TOPICS) * 2:
        raise ValueError(f"at most {len(_TOPICS) * 2} distinct criteria")
    questions = []
    for i in range(n):
        topic = _TOPICS[i % len(_TOPICS)]
        verb = "mention" if i < len(_TOPICS) else "rule out"
        questions.append(
            {"id": f"c{i + 1:02d}", "question": f"Does the evidence {verb} {topic}?", "options": YES_NO}
        )
    return questions


def fit_words(
    measure: Callable[[int], int], target: int, tolerance: float = 0.03, max_probes: int = 8
) -> tuple[int, int]:
    """The word count whose measured tokens come closest to `target`, by a secant search on a
    nearly linear function; returns (words, tokens). Below the one-word floor: (1, floor)."""
    probes: dict[int, int] = {1: measure(1)}
    if target <= probes[1]:
        return 1, probes[1]
    path = [1, 50]
    probes[50] = measure(50)
    for _ in range(max_probes):
        w0, w1 = path[-2], path[-1]
        t0, t1 = probes[w0], probes[w1]
        if abs(t1 - target) <= tolerance * target:
            break
        slope = (t1 - t0) / (w1 - w0) if w1 != w0 and t1 > t0 else max(t1, 1) / w1
        words = min(max(1, round(w1 + (target - t1) / slope)), 8 * w1)
        if words in probes:
            break
        probes[words] = measure(words)
        path.append(words)
    best = min(probes, key=lambda w: (abs(probes[w] - target), w))
    return best, probes[best]


def input_tokens_probe(
    client: Client, question: str = DEPLOYMENT_QUESTION, options=DEPLOYMENT_OPTIONS, seed: int = 0
) -> Callable[[int], int]:
    """words -> the prompt tokens of a plain /decide over `filler(words)`."""

    def measure(words: int) -> int:
        result, _ = client.decide(
            {"id": "fit", "state": filler(words, seed), "question": question, "options": options}
        )
        return int(result["input_tokens"])

    return measure


def prefix_tokens_probe(client: Client, seed: int = 0) -> Callable[[int], int]:
    """words -> the state-prefix tokens /decide/shared reports for `filler(words)`."""

    def measure(words: int) -> int:
        reply, _ = client.decide_shared(
            filler(words, seed),
            [{"id": "fit", "question": DEPLOYMENT_QUESTION, "options": DEPLOYMENT_OPTIONS}],
        )
        tokens = int(reply["timing"]["prefix_tokens"])
        if tokens == 0:
            raise RuntimeError(f"the service shared no state prefix for filler({words}, seed={seed})")
        return tokens

    return measure


@dataclass(frozen=True)
class LatencyCase:
    """One row of the spec's latency table."""

    name: str
    long_state: bool
    question: str
    options: tuple[dict[str, str], ...]
    orderings: str | None

    def body(self, state: str, request_id: str) -> dict[str, Any]:
        body = {"id": request_id, "state": state, "question": self.question, "options": list(self.options)}
        if self.orderings:
            body["orderings"] = self.orderings
        return body


LATENCY_CASES = (
    LatencyCase("/decide, short", False, DEPLOYMENT_QUESTION, tuple(DEPLOYMENT_OPTIONS), None),
    LatencyCase("/decide, long state", True, DEPLOYMENT_QUESTION, tuple(DEPLOYMENT_OPTIONS), None),
    LatencyCase("3 rotations, short", False, QUEUE_QUESTION, tuple(QUEUE_OPTIONS), "rotations"),
    LatencyCase("6 orderings, short", False, QUEUE_QUESTION, tuple(QUEUE_OPTIONS), "all"),
    LatencyCase("3 rotations, long state", True, QUEUE_QUESTION, tuple(QUEUE_OPTIONS), "rotations"),
)


@dataclass(frozen=True)
class FittedStates:
    """The short and long states of the latency table, with their measured sizes."""

    short: str
    short_input_tokens: int
    long: str
    long_state_tokens: int

    def state(self, case: LatencyCase) -> str:
        return self.long if case.long_state else self.short


def fit_latency_states(
    client: Client, short_input_tokens: int = 130, long_state_tokens: int = 2000
) -> FittedStates:
    """A short state whose binary /decide prompt is ~`short_input_tokens` tokens, and a long one
    adding ~`long_state_tokens` tokens of state to it."""
    measure = input_tokens_probe(client)
    short_words, short_tokens = fit_words(measure, short_input_tokens)
    base = measure(1)
    long_words, long_tokens = fit_words(measure, base + long_state_tokens)
    return FittedStates(filler(short_words), short_tokens, filler(long_words), long_tokens - base)
