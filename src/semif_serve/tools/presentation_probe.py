"""The probe of `semif-serve presentation-checks` on the wire: which System One requests it sends
(every state, every ordering, every kind's probes), how they travel (the service's own app in this
process, as run-batch drives it, or a running service by URL), and what is read from each reply.

SemIf's method (the base, a PEFT adapter) takes each ordering as the question's `x_orderings` and
a workload as `x_workload`; one reply holds both readings: the answer's final probabilities
(calibrated where a workload applies) and the raw ones, the log-mean of `x_semif.readings` at
T = 1. lev's method reads its release's own orders and temperatures and refuses both fields, so
in this process each lev ordering is a copy of the release under its own served name, with lev's
`order_average` and `score_order_average` set and, for the raw reading, no calibration (lev's
`--raw`); by URL a lev model is measured as it is served.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from semif_serve.batch.runner import retry_after
from semif_serve.domain.lev.calibration import UNCALIBRATED
from semif_serve.domain.orderings import ALLOWED_ORDERINGS, CORE_ORDERINGS, order_count
from semif_serve.domain.presentation import Probe, log_mean, probes
from semif_serve.service.served import ServedModels
from semif_serve.service.startup import Service

LEV = "lev"
Scores = str  # "calibrated" (the answer as served) or "raw" (T = 1)
SCORES: tuple[Scores, ...] = ("calibrated", "raw")
# Each method's orderings from the cheapest up (rows per question never fall along this order).
SEMIF_BY_COST = ("none", "reversal", "shifts", "rotations", "all")
LEV_BY_COST = ("none", "reversal", "rotations")  # lev's score orders (`none` also reads choice and noul once)
SERVED = "served"  # a lev model by URL: its orders as the release serves them
LEV_KIND_ORDERINGS = {"choice": ("none", "reversal"), "score": LEV_BY_COST, "noul": ("none", "reversal")}
ROWS_FORMULA = {
    "none": "1",
    "reversal": "2",
    "shifts": "min(n, 4)",
    "rotations": "n",
    "all": "n!",
}
RETRIES = 3
PROBE_PATH = "/v1/systemone"
VARIANT_MARK = ":presentation:"  # a lev ordering's copy is served as <model>:presentation:<ordering>:<scores>


class ProbeRefused(Exception):
    """A probe request the service did not answer with 200 (its status and error, one line)."""


class NoSlots(ProbeRefused):
    """A lev model that reads nouls as a rating: nine levels, no option slots to compare."""


def kind_orderings(method: str, kind: str) -> tuple[str, ...]:
    """The orderings `kind` is measured under, cheapest first: SemIf's allowed ones, lev's own."""
    if method == LEV:
        return LEV_KIND_ORDERINGS[kind]
    return tuple(o for o in SEMIF_BY_COST if o in ALLOWED_ORDERINGS[kind])


def rows_for(method: str, ordering: str, n: int) -> int:
    """Rows one question of n options costs under `ordering`."""
    if method == LEV:
        return {"none": 1, "reversal": 2, "rotations": n, SERVED: n}[ordering]  # served: at most n
    return order_count(n, CORE_ORDERINGS[ordering])


def asks(method: str, ordering: str, probe: Probe) -> bool:
    """Whether `probe` is asked under `ordering` (SemIf's `all` reads at most 4 options)."""
    if method != LEV and ordering == "all":
        return probe.size <= 4
    return True


@dataclass(frozen=True)
class Call:
    """One System One request of the probe: a state, an ordering, the scores it reads (SemIf's
    replies carry both), the served model it names, and its questions."""

    state: int
    ordering: str
    scores: tuple[Scores, ...]
    model: str
    questions: Mapping[str, Mapping[str, Any]]

    def body(self, states: Sequence[Any]) -> dict[str, Any]:
        """The request's JSON body."""
        return {"model": self.model, "state": states[self.state], "questions": dict(self.questions)}


def plan_calls(
    method: str,
    kinds: Sequence[str],
    n_states: int,
    models: Mapping[tuple[str, Scores], str],
    workloads: Mapping[str, str],
    max_rows: int,
) -> list[Call]:
    """Every request of the probe, state by state: per ordering (and, for lev, per scores: the
    served name in `models`), the kinds it applies to, split where the rows would pass `max_rows`."""
    calls: list[Call] = []
    orderings = sorted({o for kind in kinds for o in measured_orderings(method, kind, models)}, key=_cost)
    for state in range(n_states):
        for ordering in orderings:
            for scores in (SCORES,) if method != LEV else tuple((s,) for s in SCORES):
                model = models.get((ordering, scores[0]))
                if model is None:
                    continue
                questions: dict[str, dict[str, Any]] = {}
                for kind in kinds:
                    if ordering not in measured_orderings(method, kind, models):
                        continue
                    for probe in probes(kind):
                        if not asks(method, ordering, probe):
                            continue
                        question = dict(probe.question)
                        if method != LEV:
                            question["x_orderings"] = ordering
                            if kind in workloads:
                                question["x_workload"] = workloads[kind]
                        questions[probe.id] = question
                for part in _split(questions, method, ordering, max_rows):
                    calls.append(Call(state, ordering, scores, model, part))
    return calls


def measured_orderings(method: str, kind: str, models: Mapping[tuple[str, Scores], str]) -> tuple[str, ...]:
    """The orderings of `kind` this run measures: those the served names cover."""
    if (SERVED, "calibrated") in models:
        return (SERVED,)
    return tuple(o for o in kind_orderings(method, kind) if (o, "calibrated") in models)


def _cost(ordering: str) -> int:
    order = (*SEMIF_BY_COST, *LEV_BY_COST, SERVED)
    return order.index(ordering)


def _split(
    questions: dict[str, dict[str, Any]], method: str, ordering: str, max_rows: int
) -> list[dict[str, dict[str, Any]]]:
    parts: list[dict[str, dict[str, Any]]] = []
    current: dict[str, dict[str, Any]] = {}
    rows = 0
    for qid, question in questions.items():
        n = len(question.get("criteria") or ()) or 2
        need = rows_for(method, ordering, n)
        if current and rows + need > max_rows:
            parts.append(current)
            current, rows = {}, 0
        current[qid] = question
        rows += need
    if current:
        parts.append(current)
    return parts


# -- what a reply says -------------------------------------------------------------------------


@dataclass(frozen=True)
class Reading:
    """One probe's answer: probabilities by option name, calibrated (as answered) and raw (None
    where the reply cannot give them), the temperature applied and the rows it cost."""

    calibrated: dict[str, float]
    raw: dict[str, float] | None
    temperature: float | None
    rows: int


def read_answer(answer: Mapping[str, Any]) -> Reading:
    """A System One answer as probabilities by option name (a noul's `true`/`false`)."""
    if answer["type"] == "noul":
        final = {"true": float(answer["noul"]), "false": 1.0 - float(answer["noul"])}
    else:
        final = {name: float(p) for name, p in answer["probabilities"].items()}
    semif = answer.get("x_semif")
    if semif is not None:
        readings = [reading["probabilities"] for reading in semif["readings"]]
        return Reading(final, log_mean(readings), semif.get("temperature"), int(semif["rows"]))
    lev = answer["x_lev"]
    if answer["type"] == "noul" and answer.get("probabilities") is not None:
        raise NoSlots(
            "the lev model reads nouls as a rating (nine levels, no option slots); the noul check "
            'needs noul_readout = "binary" (or leave noul out of --kinds)'
        )
    return Reading(final, None, float(lev["temperature"]), int(lev["orders"]))


# -- lev's orderings as served copies of the release ---------------------------------------------


def lev_variants(service: Service, name: str) -> tuple[Service, dict[tuple[str, Scores], str]]:
    """`service` with a copy of the lev model `name` per ordering and scores, each served under
    a name of its own over the same engine, adapter and head: `none` reads every question once
    (lev's single order), `reversal` as given and reversed (a score too), `rotations` a score in
    every rotation; `raw` drops the release's temperatures (T = 1)."""
    served = service.models.served[name]
    method = served.method
    release = method.releases[name]  # type: ignore[attr-defined]
    copies = {}
    entries = dict(service.models.models.models)
    names: dict[tuple[str, Scores], str] = {}
    for ordering in LEV_BY_COST:
        options = dataclasses.replace(
            release.options,
            order_average=ordering != "none",
            score_order_average=ordering,
        )
        for scores in SCORES:
            copy = f"{name}{VARIANT_MARK}{ordering}:{scores}"
            calibration = release.calibration if scores == "calibrated" else UNCALIBRATED
            copies[copy] = dataclasses.replace(release, options=options, calibration=calibration)
            entries[copy] = dataclasses.replace(served.entry, name=copy)
            names[(ordering, scores)] = copy
    widened = method.with_releases(copies)  # type: ignore[attr-defined]
    models = dataclasses.replace(service.models.models, models=entries)
    methods = {**service.methods, method.name: widened}
    adapters = {s.name: s.adapter for s in service.models.served.values()}
    adapters |= dict.fromkeys(copies, served.adapter)
    return dataclasses.replace(
        service, methods=methods, models=ServedModels.over(models, methods, adapters)
    ), names


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
    calls: Sequence[Call], replies: Sequence[Mapping[str, Any]], n_states: int
) -> dict[tuple[str, Scores], Measured]:
    """The replies by (ordering, scores). A SemIf reply gives both scores (its answer and the
    log-mean of its readings); a lev copy's reply gives the scores it was served for."""
    out: dict[tuple[str, Scores], Measured] = {}
    for call, answers in zip(calls, replies, strict=True):
        for scores in call.scores:
            measured = out.setdefault((call.ordering, scores), Measured([{} for _ in range(n_states)]))
            for qid, answer in answers.items():
                reading = read_answer(answer)
                both = len(call.scores) > 1
                probabilities = reading.raw if both and scores == "raw" else reading.calibrated
                assert probabilities is not None  # a SemIf reply always carries its readings
                measured.states[call.state][qid] = probabilities
                kind = qid.split("|", 1)[0]
                temperature = None if both and scores == "raw" else reading.temperature
                measured.temperatures.setdefault(kind, set()).add(temperature)
                if call.state == 0:
                    measured.rows[kind] = measured.rows.get(kind, 0) + reading.rows
    return out
