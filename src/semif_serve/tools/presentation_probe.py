"""The probe of `semif-serve presentation-checks` on the wire: which System One requests it sends
(every state, every ordering, every kind's probes), how they travel (the service's own app in this
process, as run-batch drives it, or a running service by URL), and what is read from each reply.

What a method's models are asked and how their replies read is the method's `probing`
(`service.methods.probing`): the orderings a kind is measured under, a question's fields for each,
the served name that reads each (ordering, scores) (one name for both: one reply reads both), and
the reading of an answer. Nothing here names a method.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from semif_serve.batch.runner import retry_after
from semif_serve.domain.presentation import probes
from semif_serve.service.methods.probing import BY_COST, SCORES, SERVED, Probing, Scores, rows_for
from semif_serve.service.served import ServedModels
from semif_serve.service.startup import Service

RETRIES = 3
PROBE_PATH = "/v1/systemone"


class ProbeRefused(Exception):
    """A probe request the service did not answer with 200 (its status and error, one line)."""


@dataclass(frozen=True)
class Call:
    """One System One request of the probe: a state, an ordering, the scores its reply reads (one
    or both), the served model it names, and its questions."""

    state: int
    ordering: str
    scores: tuple[Scores, ...]
    model: str
    questions: Mapping[str, Mapping[str, Any]]

    def body(self, states: Sequence[Any]) -> dict[str, Any]:
        """The request's JSON body."""
        return {"model": self.model, "state": states[self.state], "questions": dict(self.questions)}


def plan_calls(
    probing: Probing,
    kinds: Sequence[str],
    n_states: int,
    models: Mapping[tuple[str, Scores], str],
    workloads: Mapping[str, str],
    max_rows: int,
) -> list[Call]:
    """Every request of the probe, state by state: per ordering and served name in `models` (with
    the scores its replies read), the kinds it applies to, split where the rows would pass
    `max_rows`."""
    calls: list[Call] = []
    orderings = sorted(
        {o for kind in kinds for o in measured_orderings(probing, kind, models)}, key=BY_COST.index
    )
    for state in range(n_states):
        for ordering in orderings:
            for model, scores in readers(models, ordering).items():
                questions: dict[str, dict[str, Any]] = {}
                for kind in kinds:
                    if ordering not in measured_orderings(probing, kind, models):
                        continue
                    for probe in probes(kind):
                        question = probing.question(probe, ordering, workloads.get(kind))
                        if question is not None:
                            questions[probe.id] = question
                for part in _split(questions, ordering, max_rows):
                    calls.append(Call(state, ordering, scores, model, part))
    return calls


def readers(models: Mapping[tuple[str, Scores], str], ordering: str) -> dict[str, tuple[Scores, ...]]:
    """The served names that read `ordering`, each with the scores its replies give."""
    found: dict[str, tuple[Scores, ...]] = {}
    for scores in SCORES:
        model = models.get((ordering, scores))
        if model is not None:
            found[model] = (*found.get(model, ()), scores)
    return found


def measured_orderings(
    probing: Probing, kind: str, models: Mapping[tuple[str, Scores], str]
) -> tuple[str, ...]:
    """The orderings of `kind` this run measures: those the served names cover."""
    if (SERVED, "calibrated") in models:
        return (SERVED,)
    return tuple(o for o in probing.orderings(kind) if (o, "calibrated") in models)


def _split(
    questions: dict[str, dict[str, Any]], ordering: str, max_rows: int
) -> list[dict[str, dict[str, Any]]]:
    parts: list[dict[str, dict[str, Any]]] = []
    current: dict[str, dict[str, Any]] = {}
    rows = 0
    for qid, question in questions.items():
        n = len(question.get("criteria") or ()) or 2
        need = rows_for(ordering, n)
        if current and rows + need > max_rows:
            parts.append(current)
            current, rows = {}, 0
        current[qid] = question
        rows += need
    if current:
        parts.append(current)
    return parts


# -- a method's orderings as served copies of a model ------------------------------------------


def with_variants(service: Service, probing: Probing, model: str, names: Iterable[str]) -> Service:
    """`service` also serving each of `names` it does not serve yet: a copy of `model`'s entry
    over the same adapter, read by its method as `probing.variants` widens it."""
    served = service.models.served[model]
    copies = [name for name in dict.fromkeys(names) if name not in service.models.served]
    if not copies:
        return service
    method = probing.variants(served.method, model)
    entries = dict(service.models.models.models)
    entries |= {copy: dataclasses.replace(served.entry, name=copy) for copy in copies}
    models = dataclasses.replace(service.models.models, models=entries)
    methods = {**service.methods, method.name: method}
    adapters = {s.name: s.adapter for s in service.models.served.values()}
    adapters |= dict.fromkeys(copies, served.adapter)
    return dataclasses.replace(service, methods=methods, models=ServedModels.over(models, methods, adapters))


# -- sending -----------------------------------------------------------------------------------


class Prober:
    """Sends the probe's calls through `client` (the app in process, or a service by URL), at most
    `in_flight` at once so admission never refuses them for their own pace; a refusal that asks
    to be retried (429, 503 with Retry-After) is sent again after its delay, as run-batch does."""

    def __init__(self, client: httpx.AsyncClient, token: str, in_flight: int) -> None:
        self.client = client
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self.in_flight = max(1, in_flight)

    async def ask(self, body: dict[str, Any]) -> dict[str, Any]:
        """One request's answers by question id; ProbeRefused names a refusal."""
        for attempt in range(RETRIES + 1):
            try:
                reply = await self.client.post(PROBE_PATH, json=body, headers=self.headers)
            except httpx.HTTPError as exc:
                raise ProbeRefused(f"{PROBE_PATH}: {type(exc).__name__}: {exc}") from None
            wait = retry_after(reply)
            if wait is None or attempt == RETRIES:
                break
            await asyncio.sleep(wait)
        if reply.status_code != 200:
            raise ProbeRefused(f"{PROBE_PATH} answered {reply.status_code}: {reply.text[:300]}")
        return reply.json()["answers"]

    async def run(
        self, calls: Sequence[Call], states: Sequence[Any], on_done: Callable[[], None] = lambda: None
    ) -> list[dict[str, Any]]:
        """Every call's answers, in the calls' order; a state's calls fly together (one prefill)."""
        gate = asyncio.Semaphore(self.in_flight)

        async def one(call: Call) -> dict[str, Any]:
            async with gate:
                answers = await self.ask(call.body(states))
            on_done()
            return answers

        tasks = [asyncio.ensure_future(one(call)) for call in calls]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()


@dataclass
class Measured:
    """What the replies of one (ordering, scores) hold: per state, probe id -> probabilities by
    option name; per kind, the temperatures applied and the rows the first state's probes cost."""

    states: list[dict[str, dict[str, float]]]
    temperatures: dict[str, set[float | None]] = dataclasses.field(default_factory=dict)
    rows: dict[str, int] = dataclasses.field(default_factory=dict)


def collect(
    probing: Probing, calls: Sequence[Call], replies: Sequence[Mapping[str, Any]], n_states: int
) -> dict[tuple[str, Scores], Measured]:
    """The replies by (ordering, scores). A reply read for both scores gives the answer as
    calibrated and its raw reading; one read for one scores gives its answer as served."""
    out: dict[tuple[str, Scores], Measured] = {}
    for call, answers in zip(calls, replies, strict=True):
        both = len(call.scores) > 1
        for scores in call.scores:
            measured = out.setdefault((call.ordering, scores), Measured([{} for _ in range(n_states)]))
            for qid, answer in answers.items():
                reading = probing.read(answer)
                raw = both and scores == "raw"
                probabilities = reading.raw if raw else reading.calibrated
                assert probabilities is not None  # a reply read for both scores carries its raw reading
                measured.states[call.state][qid] = probabilities
                kind = qid.split("|", 1)[0]
                measured.temperatures.setdefault(kind, set()).add(None if raw else reading.temperature)
                if call.state == 0:
                    measured.rows[kind] = measured.rows.get(kind, 0) + reading.rows
    return out
