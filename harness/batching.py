"""Issue 12's three measurements through a started service's `Service.decide` (no HTTP), for
`bench/batching.py` on the CPU and `gpu_run`'s batching phase on a lent GPU:

1. 16 concurrent clients of short distinct decisions vs 1 client: requests/s ratio, p50/p99;
2. the second question about a ~2,000-token state vs the first: engine time ratio;
3. 8 concurrent clients asking about the same state: prefills run (state cache misses);
4. (issue 50) 16 clients vs 1, every request a 4-option choice in rotations about a new
   ~150-word state of its own: requests/s, and the forwards the 16 clients' requests ran in.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from typing import Any

from harness.workloads import filler
from semif_serve.domain.requests import Limits
from semif_serve.domain.types import DecisionOutcome, Option, Question
from semif_serve.doors.native.api import asked_question, readouts_of
from semif_serve.service.methods import Ask
from semif_serve.service.startup import Service

LIMITS = dict(max_input_tokens=8192, max_options=16, max_rows=64)


def question(n: int) -> Question:
    options = (Option("yes", "It succeeded."), Option("no", "It failed."))
    return Question(f"q{n}", f"Did deployment number {n} succeed?", options)


async def decide(
    service: Service, state: Any, questions: Sequence[Question], shared: bool = False
) -> DecisionOutcome:
    """The readouts of `questions` over `state`, read by the base through `Service.decide`, asked
    as the native door asks them (below its HTTP)."""
    asked = tuple(asked_question(k, q) for k, q in enumerate(questions))
    ask = Ask(service.models.base, state, asked, Limits(**LIMITS), shared=shared)
    return readouts_of(await service.decide(ask))


def long_state(words: int) -> str:
    return " ".join(f"event{i % 97} zone{i % 7} ok" for i in range(words // 3))


async def clients(service: Service, n_clients: int, each: int) -> tuple[float, list[float]]:
    """Requests/s and latencies of `n_clients` callers each asking `each` distinct decisions."""
    latencies: list[float] = []

    async def client(c: int) -> None:
        for k in range(each):
            t0 = time.perf_counter()
            state = f"Client {c} request {k}: health checks passed in zone {k % 3}."
            await decide(service, state, [question(k)])
            latencies.append(time.perf_counter() - t0)

    started = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(n_clients)))
    return n_clients * each / (time.perf_counter() - started), latencies


async def clients_on_new_states(service: Service, n_clients: int, each: int) -> float:
    """Requests/s of `n_clients` callers each asking `each` 4-option choices in rotations (4 rows),
    every request about a new ~150-word state of its own (issue 50: rows of different requests
    over different states share one packed forward)."""
    options = tuple(Option(f"o{i}", f"Team {i} handles it.") for i in range(4))

    async def client(c: int) -> None:
        for k in range(each):
            state = f"Client {c} request {k}: " + filler(150, seed=1000 * c + k)
            q = Question(f"q{k}", "Which team handles this ticket?", options, orderings="rotations")
            await decide(service, state, [q], shared=True)

    started = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(n_clients)))
    return n_clients * each / (time.perf_counter() - started)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(service: Service, quick: bool) -> dict[str, float]:
    """The three measurements over a started `service` (`quick`: fewer requests and one state run)."""
    out: dict[str, float] = {}
    each = 2 if quick else 8
    rps1, lat1 = await clients(service, 1, 16 * each)
    rps16, lat16 = await clients(service, 16, each)
    out.update(
        rps_1=rps1,
        rps_16=rps16,
        throughput_ratio=rps16 / rps1,
        p50_1_ms=pct(lat1, 0.5),
        p99_1_ms=pct(lat1, 0.99),
        p50_16_ms=pct(lat16, 0.5),
        p99_16_ms=pct(lat16, 0.99),
    )
    new_1 = await clients_on_new_states(service, 1, 16 if quick else 32)
    forwards = service.worker.batcher.stats().forwards
    new_16 = await clients_on_new_states(service, 16, 1 if quick else 2)
    out.update(
        rps_1_new_states=new_1,
        rps_16_new_states=new_16,
        gain_new_states=new_16 / new_1,
        forwards_16_new_states=service.worker.batcher.stats().forwards - forwards,
    )
    ratios = []
    for run in range(1 if quick else 3):
        state = long_state(2000) + f" run {run}"
        first = await decide(service, state, [question(0)], shared=True)
        second = await decide(service, state, [question(1)], shared=True)
        assert second.timing is not None and second.timing.prefill == "cached"
        ratios.append(first.total_seconds / second.total_seconds)
        out["state_prefix_tokens"] = first.timing.prefix_tokens if first.timing else 0
    out["second_question_ratio"] = statistics.median(ratios)
    misses = service.engine.cache.stats().misses
    state = long_state(600) + " shared"
    await asyncio.gather(*(decide(service, state, [question(i)], shared=True) for i in range(8)))
    out["prefills_for_8_clients"] = service.engine.cache.stats().misses - misses
    return out
