"""What every acceptance command shares: JSONL and token files, fixture rows as request bodies, the
connection arguments, gates and the command's result file (the client, the tables and the JSON
writer are the harness's: `harness.client`, `harness.report`)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from harness.client import DEFAULT_MAX_BUSY_RETRIES, DEFAULT_TIMEOUT_S, Client, ServiceCallError
from harness.report import jsonable, log, print_table, write_result

EXIT_PASS = 0
EXIT_GATE_FAILED = 1
EXIT_ERROR = 2

HEALTH_KEYS = ("version", "semif", "model", "device", "dtype", "demo", "limits")


class CheckError(Exception):
    """The check cannot run (bad input, service unreachable or not ready): exit status 2."""


# -- files -------------------------------------------------------------------------------


def read_token(path: Path) -> str:
    """The bearer token from a file (trailing newline stripped)."""
    token = Path(path).read_text(encoding="utf-8").strip()
    if not token:
        raise ValueError(f"{path} is empty")
    return token


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file (blank lines skipped); every row must be a JSON object."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: not a JSON object")
            rows.append(row)
    return rows


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def by_id(rows: Iterable[dict[str, Any]], what: str) -> dict[str, dict[str, Any]]:
    """Rows keyed by their `id`; a repeated id is an error (the join would be ambiguous)."""
    indexed: dict[str, dict[str, Any]] = {}
    for row in rows:
        key = row.get("id")
        if not isinstance(key, str):
            raise ValueError(f"{what}: a row has no string id")
        if key in indexed:
            raise ValueError(f"{what}: id {key!r} appears more than once")
        indexed[key] = row
    return indexed


def decision_body(row: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A SemIf fixture row as a /decide body: only the fields the contract reads."""
    body = {
        "id": row["id"],
        "state": row["state"],
        "question": row["question"],
        "options": [{"id": o["id"], "description": o["description"]} for o in row["options"]],
    }
    body.update({k: v for k, v in extra.items() if v is not None})
    return body


def shared_question(row: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A fixture row as one entry of /decide/shared's `decisions` (no state)."""
    body = decision_body(row, **extra)
    del body["state"]
    return body


def score_rows(
    client: Client, rows: Sequence[dict[str, Any]], label: str = "scoring", **extra: Any
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Every fixture row through /decide, one at a time: (results by id, errors by id).

    A refused row (4xx/5xx) is recorded, not raised, so one bad row cannot hide the rest;
    the commands' "scored" gate fails on any error."""
    results: dict[str, dict[str, Any]] = {}
    errors: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    for i, row in enumerate(rows, 1):
        try:
            results[row["id"]], _ = client.decide(decision_body(row, **extra))
        except ServiceCallError as exc:
            errors[row["id"]] = exc.as_dict()
        if i % 25 == 0 or i == len(rows):
            log(f"{label}: {i}/{len(rows)} rows ({time.perf_counter() - started:.1f} s)")
    return results, errors


def state_key(state: Any) -> str:
    """Rows share a state when it renders to the same JSON (key order matters, as in the prompt)."""
    return json.dumps(state, ensure_ascii=False)


# -- output ------------------------------------------------------------------------------


def fraction(n: int, total: int) -> str:
    return f"{n}/{total}"


@dataclass
class Gate:
    """One pass/fail condition of a command."""

    name: str
    passed: bool
    detail: str


@dataclass
class Outcome:
    """What a command found: its summary, any per-row detail, and its gates."""

    command: str
    summary: dict[str, Any]
    gates: list[Gate] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates)


def results_directory() -> Path:
    """Where results go without --out: the user's state directory, never the current checkout."""
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "semif-serve" / "acceptance-results"


def default_out(command: str) -> Path:
    """`<results_directory>/<command>-<UTC time>.json`."""
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    return results_directory() / f"{command}-{stamp}.json"


def finish(outcome: Outcome, args: argparse.Namespace, service: dict[str, Any] | None) -> int:
    """Print the gates, write the JSON result file and return the exit status."""
    if outcome.gates:
        print_table(
            ["gate", "result", "detail"],
            [[g.name, "PASS" if g.passed else "FAIL", g.detail] for g in outcome.gates],
        )
    payload = {
        "command": outcome.command,
        "passed": outcome.passed,
        "finished_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "url": getattr(args, "url", None),
        "arguments": {k: jsonable(v) for k, v in vars(args).items() if k not in ("handler",)},
        "service": service,
        "summary": outcome.summary,
        "gates": [asdict(g) for g in outcome.gates],
        **outcome.details,
    }
    out = Path(args.out) if getattr(args, "out", None) else default_out(outcome.command)
    write_result(out, payload)
    verdict = "PASS" if outcome.passed else "FAIL"
    print(f"{outcome.command}: {verdict} (result written to {out})")
    return EXIT_PASS if outcome.passed else EXIT_GATE_FAILED


# -- command plumbing ---------------------------------------------------------------------


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="service base URL, e.g. http://127.0.0.1:8032")
    parser.add_argument("--token-file", required=True, type=Path, help="file holding the bearer token")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON result file (default: semif-serve/acceptance-results/<command>-<time>.json "
        "under $XDG_STATE_HOME, else ~/.local/state; never the checkout)",
    )
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per request")
    parser.add_argument(
        "--max-busy-retries",
        type=int,
        default=DEFAULT_MAX_BUSY_RETRIES,
        help="retries of 429 busy per request",
    )


def connect(args: argparse.Namespace) -> tuple[Client, dict[str, Any]]:
    """A client from the connection arguments, and the service's /health snapshot."""
    client = Client(args.url, read_token(args.token_file), args.timeout, args.max_busy_retries)
    try:
        health = client.health()
    except (httpx.HTTPError, ServiceCallError) as exc:
        client.close()
        raise CheckError(f"cannot reach {args.url}/health: {exc}") from None
    snapshot = {k: health.get(k) for k in HEALTH_KEYS if k in health}
    if not health.get("ready", False):
        client.close()
        raise CheckError(f"{args.url} is not ready (status {health.get('status')!r})")
    return client, snapshot
