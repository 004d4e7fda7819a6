"""`semif-serve presentation-checks`: how much does the order of the options sway this model on
these states? lev's label-free checks (ADR-029; the metrics in `domain.presentation`) measured
under every ordering the service offers, calibrated and raw, written as a report a person reads
and a machine compares, and turned into the cheapest ordering per question kind that passes
(docs/presentation-checks.md).

It runs the service's own app in this process over the configured model (as run-batch does), or
sends System One requests to a running service (`--url`). Exit codes: 0 measured (and, with
`--compare`, nothing moved), 1 a metric moved past its tolerance (or, with `--enforce-gate`, a
served ordering fails its gates), 2 bad input (states, kinds, model, workloads, a report whose
settings differ: refused before any forward), 3 the service cannot start or be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import secrets
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from semif_serve.domain.orderings import parse_type_map
from semif_serve.domain.presentation import (
    FIRST_SLOT_GATE,
    FIRST_SLOT_GATE_MAX,
    KINDS,
    ORDER_FREE,
    PROBE_VERSION,
    SLOT0_GATE,
    SLOT0_GATE_MAX,
    TOLERANCE,
    cheapest_passing,
    drift,
    kind_metrics,
    passes,
    settings_mismatch,
)

if TYPE_CHECKING:
    import httpx

    from semif_serve.service.methods import DecisionMethod, MethodRegistry
    from semif_serve.service.methods.probing import Probing
    from semif_serve.service.settings import Settings
    from semif_serve.service.startup import Service
    from semif_serve.tools.presentation_probe import Call, Measured

EXIT_DRIFT = 1
EXIT_INPUT = 2
EXIT_UNAVAILABLE = 3
PLAIN_EVERY_SECONDS = 5.0
REPORT_NAME = "semif-serve presentation-checks"
REPORT_FORMAT = 1
DIGITS = 6  # the report's numbers, rounded: a rerun writes the same file
# The settings a committed report must share with a run before any forward is worth making.
SETTINGS_KEYS = (
    "model",
    "method",
    "kinds",
    "orderings",
    "workloads",
    "n_states",
    "states_sha256",
    "lang",
    "probe",
    "checkpoint_source",
    "checkpoint_revision",
    "dtype",
)

# The demo's sample states: what an operator's queue might hold (tickets, deploys, requests).
DEMO_STATES = (
    "Health checks passed in all three zones.",
    "The canary failed in one zone, then recovered.",
    "Customer says they were charged twice for the March invoice and wants a refund.",
    "The login page returns a 500 error for every user since this morning's deploy.",
    "A prospect asks whether the enterprise plan includes a dedicated support contract.",
    "Reminder: the quarterly report is due next Friday.",
    "The export job has been stuck at 90% for six hours; finance cannot close the month.",
    "Can you send me a quote for 40 seats on the team plan?",
)


class Refused(Exception):
    """Bad input, said in one line (exit 2)."""


class Unavailable(Exception):
    """The service could not be started or reached, or refused the probe (exit 3)."""


# -- input -------------------------------------------------------------------------------------


def read_states(path: str | None) -> list[Any]:
    """The states to probe: a JSONL file (`.jsonl`/`.ndjson`: each line an object with `state`),
    else a text file (each non-blank line a state); the demo's samples when `path` is None."""
    if path is None:
        return list(DEMO_STATES)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise Refused(f"{path}: not UTF-8 text") from None
    except OSError as exc:
        raise Refused(f"{path}: cannot read ({exc.strerror or type(exc).__name__})") from None
    lines = [(number, line) for number, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not lines:
        raise Refused(f"{path}: holds no states (one a line: text, or JSONL with a `state` each)")
    if not path.endswith((".jsonl", ".ndjson")):
        return [line.strip() for _, line in lines]
    states = []
    for number, line in lines:
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise Refused(f"{path}: line {number}: not JSON ({exc.msg})") from None
        if not isinstance(value, dict) or "state" not in value:
            raise Refused(f'{path}: line {number}: a JSONL line is an object with a "state"')
        if not isinstance(value["state"], str | dict | list):
            raise Refused(f"{path}: line {number}: a state is a string, an object or an array")
        states.append(value["state"])
    return states


def states_digest(states: Sequence[Any]) -> str:
    """SHA-256 of the states as canonical JSON, in order: two runs over the same states agree."""
    text = json.dumps(list(states), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def parse_kinds(text: str | None) -> list[str] | None:
    """`--kinds`: a comma list of choice, score, noul (None: the method's default)."""
    if text is None:
        return None
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise Refused(f"--kinds: {', '.join(unknown) or repr(text)}: kinds are {', '.join(KINDS)}")
    return list(dict.fromkeys(kinds))


def parse_workloads(text: str | None) -> dict[str, str]:
    """`--workloads type=name,...`: the calibration workload each kind's calibrated read uses."""
    if not text:
        return {}
    try:
        return parse_type_map(text)
    except ValueError as exc:
        raise Refused(f"--workloads: {exc}") from None


def read_report(path: str) -> dict[str, Any]:
    """A report written by this command (for --compare)."""
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise Refused(f"--compare {path}: cannot read ({exc.strerror or type(exc).__name__})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise Refused(f"--compare {path}: not a JSON report") from None
    if not isinstance(report, dict) or report.get("report") != REPORT_NAME or "settings" not in report:
        raise Refused(f"--compare {path}: not a report of `semif-serve presentation-checks`")
    return report


# -- what is measured ------------------------------------------------------------------------------


@dataclass
class Target:
    """The model probed and how: its served name, its method and how that is probed, its entry's
    options (None by URL), the kinds measured, the served name per (ordering, scores), the
    workloads asked, the service's bounds, and the ordering it serves each kind in (the probe
    finds out)."""

    model: str
    method: str
    probing: Probing
    options: Mapping[str, Any] | None
    kinds: list[str]
    models: dict[tuple[str, str], str]
    workloads: dict[str, str]
    max_rows: int
    in_flight: int
    source: str
    revision: str
    dtype: str
    served: dict[str, str] = field(default_factory=dict)

    def orderings(self) -> dict[str, list[str]]:
        """Per kind, the orderings measured, cheapest first."""
        from semif_serve.tools.presentation_probe import measured_orderings

        return {kind: list(measured_orderings(self.probing, kind, self.models)) for kind in self.kinds}

    def settings(self, states: Sequence[Any]) -> dict[str, Any]:
        """The report's settings: everything a comparison needs to be meaningful."""
        return {
            "model": self.model,
            "method": self.method,
            "kinds": list(self.kinds),
            "orderings": self.orderings(),
            "workloads": {kind: self.workloads.get(kind) for kind in self.kinds},
            "n_states": len(states),
            "states_sha256": states_digest(states),
            "lang": "en",
            "probe": PROBE_VERSION,
            "checkpoint_source": self.source,
            "checkpoint_revision": self.revision,
            "dtype": self.dtype,
        }


def probing_of(registry: MethodRegistry, name: str, model: str) -> tuple[type[DecisionMethod], Probing]:
    """The method `name` that reads `model`, and how it is probed: a method this process does not
    know, or one without a `probing`, is refused naming it."""
    method = registry.named(name)
    if method is None:
        raise Refused(
            f"--model {model!r}: its method {name!r} is not one known here "
            f"({', '.join(registry.methods)}; SEMIF_METHODS adds one)"
        )
    probing: Probing | None = getattr(method, "probing", None)
    if probing is None:
        raise Refused(
            f"--model {model!r}: its method {name!r} has no probing (service/methods/probing.py): "
            "its orderings cannot be measured"
        )
    return method, probing


def refuse_workloads(
    method: type[DecisionMethod], probing: Probing, model: str, workloads: Mapping[str, str]
) -> None:
    """Refuse `--workloads` for a method that reads no calibration file's workloads."""
    if workloads and not method.workloads:
        raise Refused(f"--workloads: the {method.name} model {model!r} reads {probing.temperatures}")


# -- the report --------------------------------------------------------------------------------


def build_report(
    target: Target,
    states: Sequence[Any],
    measured: Mapping[tuple[str, str], Measured],
    run: Mapping[str, Any],
) -> dict[str, Any]:
    """The report: settings, then per kind and ordering the checks calibrated and raw, then the
    recommendation (from `recommend`)."""
    from semif_serve.service.methods.probing import ROWS_FORMULA

    checks: dict[str, dict[str, Any]] = {}
    for kind, orderings in target.orderings().items():
        checks[kind] = {}
        for ordering in orderings:
            entry: dict[str, Any] = {"rows_per_question": ROWS_FORMULA.get(ordering, "as served")}
            for scores in ("calibrated", "raw"):
                found = measured.get((ordering, scores))
                if found is None:
                    entry[scores] = None
                    continue
                entry["rows"] = found.rows.get(kind)
                if scores == "calibrated":
                    temperatures = sorted(found.temperatures.get(kind, set()), key=lambda t: (t is None, t))
                    entry["temperature"] = temperatures[0] if len(temperatures) == 1 else temperatures
                entry[scores] = kind_metrics(kind, found.states, ordering)
            checks[kind][ordering] = entry
    report: dict[str, Any] = {
        "report": REPORT_NAME,
        "format": REPORT_FORMAT,
        "settings": target.settings(states),
        "run": dict(run),
        "checks": checks,
    }
    report["recommend"] = recommend(report, target)
    report["passed"] = all(v["served_passed"] is not False for v in report["recommend"]["kinds"].values())
    return rounded(report)


def recommend(report: Mapping[str, Any], target: Target) -> dict[str, Any]:
    """Per kind, the cheapest ordering whose raw checks pass (the most even one when none does),
    its row cost, and whether the ordering served now passes; then the setting that serves them."""
    from semif_serve.service.methods.probing import ROWS_FORMULA, SERVED, rows_for

    kinds: dict[str, Any] = {}
    for kind, measured in report["checks"].items():
        by_cost = (SERVED,) if SERVED in measured else target.probing.choices(kind)
        scored = {o: _gated(entry) for o, entry in measured.items()}
        passing, evenest = cheapest_passing(scored, by_cost)
        chosen = passing or evenest
        served = target.served.get(kind)
        served_entry = scored.get(served) if served is not None else None
        kinds[kind] = {
            "ordering": chosen,
            "passed": passing is not None,
            "rows_per_question": ROWS_FORMULA.get(chosen, "as served") if chosen else None,
            "rows_for_3_options": rows_for(chosen, 3) if chosen not in (None, SERVED) else None,
            "served": served,
            "served_passed": passes(served_entry["raw"]) if served_entry and served_entry["raw"] else None,
        }
    chosen_now = {kind: pick["ordering"] for kind, pick in kinds.items()}
    return {"kinds": kinds, "setting": target.probing.setting(target.model, chosen_now, target.served)}


def _gated(entry: Mapping[str, Any]) -> dict[str, Any]:
    """An ordering's checks with the gates read on raw scores (calibrated where no raw was read)."""
    return {"raw": entry.get("raw") or entry.get("calibrated")}


def rounded(value: Any) -> Any:
    """`value` with every float rounded to DIGITS places (a rerun writes the same report)."""
    if isinstance(value, float):
        return round(value, DIGITS) + 0.0  # + 0.0: no "-0.0" in the file
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v) for v in value]
    return value


def render_table(report: Mapping[str, Any]) -> str:
    """The terminal's short table: per kind and ordering, the raw identical metric and first-slot
    rate with their leave-one-out bounds, the calibrated identical metric, consistency, gates."""
    settings = report["settings"]
    lines = [
        f"presentation-checks: {settings['model']} ({settings['method']}), {settings['n_states']} states, "
        f"{settings['checkpoint_revision']} {settings['dtype']}",
        f"{'kind':<7}{'ordering':<10}{'rows/q':<11}{'identical raw [LOO]':<27}{'calib.':<9}"
        f"{'first-slot [LOO]':<24}{'consist.':<9}gates",
    ]
    for kind, orderings in report["checks"].items():
        for ordering, entry in orderings.items():
            raw = entry.get("raw") or entry.get("calibrated") or {}
            calibrated = entry.get("calibrated") or {}
            ident, first = raw.get("identical"), raw.get("first_slot")
            ident_text = (
                f"{ident['metric']:+.3f} [{ident['leave_one_out'][0]:+.3f}, {ident['leave_one_out'][1]:+.3f}]"
                if ident
                else "-"
            )
            cal = calibrated.get("identical")
            first_text = (
                f"{first['metric']:.3f} [{first['leave_one_out'][0]:.3f}, {first['leave_one_out'][1]:.3f}]"
                if first
                else "-"
            )
            consistent = f"{first['consistent']:.3f}" if first else "-"
            verdict = "PASS" if passes(raw) else "FAIL"
            cal_text = format(cal["metric"], "+.3f") if cal else "-"
            lines.append(
                f"{kind:<7}{ordering:<10}{entry['rows_per_question']:<11}{ident_text:<27}"
                f"{cal_text:<9}{first_text:<24}{consistent:<9}{verdict}"
            )
    lines.append(
        f"gates: identical within [{SLOT0_GATE:+.2f}, {SLOT0_GATE_MAX:+.2f}] (raw), first-slot within "
        f"[{FIRST_SLOT_GATE:.3f}, {FIRST_SLOT_GATE_MAX:.3f}] (order-free {ORDER_FREE:.3f})"
    )
    return "\n".join(lines)


def render_recommendation(report: Mapping[str, Any]) -> str:
    """`--recommend`: per kind the cheapest ordering within the gates and its row cost, then the setting."""
    lines = ["recommended (the cheapest ordering whose raw position checks are within the gates):"]
    for kind, pick in report["recommend"]["kinds"].items():
        if pick["ordering"] is None:
            lines.append(f"  {kind}: nothing measured")
            continue
        status = "within the gates" if pick["passed"] else "none passes; the most even measured"
        served = f"; served now: {pick['served']}" if pick["served"] else ""
        if pick["served_passed"] is not None:
            served += " (passes)" if pick["served_passed"] else " (fails)"
        lines.append(
            f"  {kind}: {pick['ordering']} ({status}); rows per question of n options: "
            f"{pick['rows_per_question']} ({pick['rows_for_3_options']} for 3){served}"
        )
    lines.append(report["recommend"]["setting"])
    return "\n".join(lines)


# -- progress ----------------------------------------------------------------------------------


class Progress:
    """A tqdm bar on a terminal, else a line every few seconds, counting answered requests."""

    def __init__(self, total: int, stream: TextIO, bar: bool | None) -> None:
        self.total, self.stream, self.done = total, stream, 0
        self.started = self.shown = time.monotonic()
        self.bar = None
        if stream.isatty() if bar is None else bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="request", file=stream, dynamic_ncols=True, desc="probe")

    def __call__(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
            return
        now = time.monotonic()
        if now - self.shown >= PLAIN_EVERY_SECONDS:
            self.shown = now
            print(f"presentation-checks: {self.done}/{self.total} requests", file=self.stream, flush=True)

    def close(self) -> float:
        """Stop the bar; the seconds since the start."""
        if self.bar is not None:
            self.bar.close()
        return time.monotonic() - self.started


# -- running -----------------------------------------------------------------------------------


async def probe(
    client: httpx.AsyncClient,
    token: str,
    target: Target,
    states: Sequence[Any],
    bar: bool | None = False,
) -> tuple[dict[tuple[str, str], Measured], float]:
    """Find out which ordering each kind is served in now (the method's probing says, or asks the
    service), then send every probe call; the readings and the seconds taken."""
    from semif_serve.tools.presentation_probe import Prober, ProbeRefused, collect, plan_calls

    prober = Prober(client, token, target.in_flight)
    calls: list[Call] = plan_calls(
        target.probing, target.kinds, len(states), target.models, target.workloads, target.max_rows
    )
    progress = Progress(len(calls), sys.stderr, bar)
    try:
        target.served = await target.probing.served_orderings(
            prober.ask, target.model, states[0], target.options
        )
        replies = await prober.run(calls, states, progress)
        measured = collect(target.probing, calls, replies, len(states))
    except ProbeRefused as exc:
        raise Unavailable(str(exc)) from None
    finally:
        seconds = progress.close()
    return measured, seconds


def in_process_target(
    settings: Settings,
    model: str | None,
    kinds: list[str] | None,
    workloads: dict[str, str],
    concurrency: int | None,
) -> Target:
    """The target over this process's own service, checked before anything loads: the model is
    one of SEMIF_MODELS (or the base), the workloads are in the calibration file."""
    from semif_serve.domain.calibration import CalibrationFileError, load_calibration
    from semif_serve.domain.types import ConfigurationError
    from semif_serve.service.methods import MethodRegistry
    from semif_serve.service.startup import served_models

    try:
        registry = MethodRegistry.of(settings.methods)
        served = served_models(settings, registry)
        calibration = load_calibration(settings.calibration)
    except (ConfigurationError, CalibrationFileError) as exc:
        raise Refused(str(exc)) from None
    name = model or served.base
    entry = served.resolve(name)
    if entry is None:
        known = ", ".join(repr(n) for n in [*served.models, *served.aliases])
        raise Refused(f"--model: unknown model {name!r} (served: {known})")
    method, probing = probing_of(registry, entry.method, entry.name)
    chosen = probing.kinds(kinds, entry.name, entry.options)
    refuse_workloads(method, probing, entry.name, workloads)
    if method.workloads:  # the operator's defaults apply where no flag names one
        workloads = {
            k: settings.systemone_workloads[k] for k in chosen if k in settings.systemone_workloads
        } | workloads
    unknown = sorted(set(workloads.values()) - set(calibration.names()))
    if unknown:
        raise Refused(
            f"--workloads: {', '.join(unknown)} not in the calibration file ({settings.calibration})"
        )
    assert settings.dtype is not None  # Settings fills the device's default
    return Target(
        model=entry.name,
        method=entry.method,
        probing=probing,
        options=entry.options,
        kinds=chosen,
        models=probing.names(entry.name, entry.options),
        workloads=workloads,
        max_rows=settings.systemone_max_rows,
        in_flight=min(concurrency or settings.max_queue, settings.max_queue),
        source=settings.model_source,
        revision=settings.model_revision,
        dtype=settings.dtype,
    )


def run_in_process(
    service: Service, target: Target, states: Sequence[Any], bar: bool | None = False
) -> tuple[dict[tuple[str, str], Measured], float]:
    """The probe through the service's own app in this process (run-batch's in-process app:
    admission, the door, the method, the engine), each served name the probing names served
    (a copy of the model where its method reads an ordering only as its own)."""
    import httpx

    from semif_serve.batch.runner import BatchScorer
    from semif_serve.tools.presentation_probe import with_variants

    service = with_variants(service, target.probing, target.model, target.models.values())
    scorer = BatchScorer(service)
    transport = httpx.ASGITransport(app=scorer.app, raise_app_exceptions=False)

    async def go() -> tuple[dict[tuple[str, str], Measured], float]:
        async with httpx.AsyncClient(
            transport=transport, base_url="http://presentation-checks", timeout=None
        ) as client:
            return await probe(client, service.token, target, states, bar)

    return asyncio.run(go())


def url_target(
    url: str,
    token: str,
    model: str | None,
    kinds: list[str] | None,
    workloads: dict[str, str],
    concurrency: int | None,
) -> Target:
    """The target on a running service: its checkpoint from `/health`, the model from
    `/v1/models` (unknown: refused), no forward yet."""
    import httpx

    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            health = client.get("/health")
            listing = client.get("/v1/models", headers={"Authorization": f"Bearer {token}"})
    except httpx.HTTPError as exc:
        raise Unavailable(f"--url {url}: {type(exc).__name__}: {exc}") from None
    if listing.status_code == 401:
        raise Refused(f"--url {url}: the token was refused (401): pass --token or set SEMIF_API_TOKEN")
    if health.status_code != 200 or listing.status_code != 200:
        raise Unavailable(f"--url {url}: /health {health.status_code}, /v1/models {listing.status_code}")
    body, entries = health.json(), listing.json()["models"]
    by_name = {e["name"]: e for e in entries}
    name = model or entries[0]["name"]
    entry = by_name.get(name)
    if entry is not None and entry.get("x_alias_of"):
        entry = by_name.get(entry["x_alias_of"])
    if entry is None:
        raise Refused(f"--model: unknown model {name!r} (served: {', '.join(repr(n) for n in by_name)})")
    registry = url_registry()
    # A listing that names no method is read by the default one, as SEMIF_MODELS reads an entry.
    method, probing = probing_of(registry, entry.get("x_method") or registry.default.name, entry["name"])
    refuse_workloads(method, probing, entry["name"], workloads)
    chosen = probing.kinds(kinds, entry["name"], None)
    limits = body.get("limits", {})
    return Target(
        model=entry["name"],
        method=method.name,
        probing=probing,
        options=None,
        kinds=chosen,
        models=probing.names(entry["name"], None),
        workloads=workloads,
        max_rows=int(limits.get("systemone_max_rows", 256)),
        in_flight=min(concurrency or int(limits.get("max_queue", 8)), int(limits.get("max_queue", 8))),
        source=body["model"]["source"],
        revision=body["model"]["revision"],
        dtype=body["dtype"],
    )


def url_registry() -> MethodRegistry:
    """The methods this process knows by `x_method`: the built-in ones and SEMIF_METHODS'."""
    from semif_serve.domain.types import ConfigurationError
    from semif_serve.service.methods import MethodRegistry
    from semif_serve.service.settings import load_settings

    try:
        return MethodRegistry.of(load_settings().methods)
    except ConfigurationError as exc:
        raise Refused(str(exc)) from None


def run_by_url(
    url: str, token: str, target: Target, states: Sequence[Any], bar: bool | None = False
) -> tuple[dict[tuple[str, str], Measured], float]:
    """The probe as System One requests to the service at `url`."""
    import httpx

    async def go() -> tuple[dict[tuple[str, str], Measured], float]:
        limits = httpx.Limits(max_connections=target.in_flight)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
            return await probe(client, token, target, states, bar)

    return asyncio.run(go())


# -- the command -------------------------------------------------------------------------------


def add_presentation_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `semif-serve presentation-checks` (docs/presentation-checks.md)."""
    parser.add_argument(
        "--states",
        default=None,
        metavar="FILE",
        help="the states to probe: JSONL (.jsonl, a `state` a line) or text (one a line) [the demo's]",
    )
    parser.add_argument(
        "--kinds", default=None, help=f"comma list of {', '.join(KINDS)} [every kind the model reads]"
    )
    parser.add_argument("--model", default=None, help="a served model or alias [the base]")
    parser.add_argument(
        "--workloads",
        default=None,
        metavar="MAP",
        help="type=workload,... for the calibrated reads (SemIf's method) [SEMIF_SYSTEMONE_WORKLOADS]",
    )
    parser.add_argument(
        "--demo", action="store_true", help="the demo's model and lev release (as `demo` serves)"
    )
    parser.add_argument("--url", default=None, help="probe a running service by URL instead of this process")
    parser.add_argument(
        "--token", default=None, help="bearer token for --url [SEMIF_API_TOKEN, else SEMIF_API_TOKEN_FILE]"
    )
    parser.add_argument("--out", default=None, metavar="REPORT", help="write the JSON report here")
    parser.add_argument("--compare", default=None, metavar="REPORT", help="a committed report: fail on drift")
    parser.add_argument(
        "--tolerance", type=float, default=TOLERANCE, help=f"how far a metric may move [{TOLERANCE}]"
    )
    parser.add_argument(
        "--recommend", action="store_true", help="print the cheapest ordering per kind within the gates"
    )
    parser.add_argument(
        "--enforce-gate", action="store_true", help="exit 1 when an ordering served now fails its gates"
    )
    parser.add_argument("--concurrency", type=int, default=None, metavar="N", help="requests in flight")
    parser.add_argument("--progress", choices=("auto", "bar", "plain"), default="auto", help="[auto]")


def url_token(given: str | None) -> str:
    """The bearer token for --url: the flag, else SEMIF_API_TOKEN, else SEMIF_API_TOKEN_FILE's."""
    if given:
        return given
    if os.environ.get("SEMIF_API_TOKEN"):
        return os.environ["SEMIF_API_TOKEN"]
    path = os.environ.get("SEMIF_API_TOKEN_FILE")
    if path:
        try:
            return Path(path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise Refused(f"SEMIF_API_TOKEN_FILE {path}: cannot read ({exc.strerror})") from None
    raise Refused("--url needs a token: --token, SEMIF_API_TOKEN or SEMIF_API_TOKEN_FILE")


def presentation_checks(
    args: argparse.Namespace,
    demo_overrides: Callable[[], dict],
    checked_settings: Callable[[dict | None], Settings | int],
    start_service: Callable[[Settings], Service | int],
) -> int:
    """The command: input checked, settings compared with --compare's report (before any
    forward), the probe run, the report written and compared, the table and recommendation."""
    from semif_serve.service.methods.probing import NoSlots

    try:
        return _checks(args, demo_overrides, checked_settings, start_service)
    except (Refused, NoSlots) as exc:
        print(f"presentation-checks: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except Unavailable as exc:
        print(f"presentation-checks: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE


def _checks(
    args: argparse.Namespace,
    demo_overrides: Callable[[], dict],
    checked_settings: Callable[[dict | None], Settings | int],
    start_service: Callable[[Settings], Service | int],
) -> int:
    kinds = parse_kinds(args.kinds)
    workloads = parse_workloads(args.workloads)
    states = read_states(args.states)
    committed = read_report(args.compare) if args.compare else None
    if args.tolerance < 0:
        raise Refused("--tolerance must be at least 0")
    bar = {"auto": None, "bar": True, "plain": False}[args.progress]
    run: dict[str, Any] = {
        "via": "url" if args.url else "in-process",
        "states": args.states or "demo samples",
    }
    if args.url:
        token = url_token(args.token)
        target = url_target(args.url, token, args.model, kinds, workloads, args.concurrency)
        refuse_other_settings(committed, target.settings(states), args.compare)
        measured, seconds = run_by_url(args.url, token, target, states, bar)
    else:
        overrides = demo_overrides() if args.demo else {}
        if not (os.environ.get("SEMIF_API_TOKEN") or os.environ.get("SEMIF_API_TOKEN_FILE")):
            overrides["api_token"] = "presentation-" + secrets.token_urlsafe(18)  # no port is bound
        settings = checked_settings(overrides)
        if isinstance(settings, int):
            return settings
        target = in_process_target(settings, args.model, kinds, workloads, args.concurrency)
        refuse_other_settings(committed, target.settings(states), args.compare)
        service = start_service(settings)
        if isinstance(service, int):
            return service
        try:
            measured, seconds = run_in_process(service, target, states, bar)
        finally:
            service.worker.shutdown()
    report = build_report(target, states, measured, run)
    print(render_table(report))
    print(f"probe: {seconds:.1f} s", file=sys.stderr)
    if args.recommend:
        print(render_recommendation(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    failures = drift(report, committed, args.tolerance) if committed is not None else []
    if args.enforce_gate:
        failures += [
            f"{kind}: the served ordering {pick['served']} fails its gates"
            for kind, pick in report["recommend"]["kinds"].items()
            if pick["served_passed"] is False
        ]
    if failures:
        print(f"presentation-checks: {len(failures)} failed:\n  " + "\n  ".join(failures), file=sys.stderr)
        return EXIT_DRIFT
    if committed is not None:
        print(f"presentation-checks: every metric within {args.tolerance} of {args.compare}", file=sys.stderr)
    return 0


def refuse_other_settings(
    committed: Mapping[str, Any] | None, settings: Mapping[str, Any], path: str
) -> None:
    """Refuse (exit 2, before any forward) a comparison whose settings differ from the report's."""
    if committed is None:
        return
    differ = settings_mismatch(committed["settings"], settings, SETTINGS_KEYS)
    if differ:
        raise Refused(f"--compare {path}: settings differ, nothing was measured: " + "; ".join(differ))
