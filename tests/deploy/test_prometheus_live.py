"""A real Prometheus scrapes a real service (uvicorn on loopback, the tiny checkpoint) under a short
load, with the shipped alert rules loaded: every rule's expression and every dashboard query is
evaluated through Prometheus' HTTP API, and each must return data from the series the service
exports (each series selector in it, with its label matchers, and each legend's labels).
A forced out-of-memory fires SemifOutOfMemory.

Needs Debian's `prometheus` package (.ci/run installs it); skips without it, except in CI.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml

from semif_serve.app import create_app
from semif_serve.domain.numerics import GIB, MIB
from semif_serve.service.startup import Service
from tests.deploy.test_dashboard import DASHBOARD, panel_queries
from tests.deploy.test_prometheus_rules import RULES, required_tool
from tests.support import TOKEN, decision, make_settings, open_post
from tests.support.memory_sim import SimulatedMemory, cuda_oom

AUTH = {"Authorization": f"Bearer {TOKEN}"}
JOB = "semif-serve"
STACK_CONFIG = Path(__file__).resolve().parents[2] / "stacks" / "monitoring" / "prometheus.yml"
# A series selector: a metric name (not a function or keyword) and its optional matchers.
SELECTOR = re.compile(r"(?<![\w:\"'])((?:semif_|semif:|up\b)[\w:]*)(\{[^}]*\})?(?!\s*\()")
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


@dataclass
class Prometheus:
    """A running Prometheus and a client of its HTTP API."""

    url: str
    # One client for every call: httpx.get builds a new client (and its TLS context) each time.
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=10))

    def query(self, expr: str) -> list[dict]:
        reply = self.client.get(f"{self.url}/api/v1/query", params={"query": expr})
        body = reply.json()
        assert reply.status_code == 200 and body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def get(self, path: str) -> dict:
        reply = self.client.get(f"{self.url}{path}")
        reply.raise_for_status()
        return reply.json()["data"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(check: Callable[[], object], what: str, seconds: float = 60) -> object:
    """`check()` once it is truthy, polling; fails naming `what` after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            found = check()
        except (httpx.HTTPError, AssertionError):
            found = None
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def memory() -> SimulatedMemory:
    # A capped device, so the cap's series exists as on cuda.
    return SimulatedMemory(floor=512 * MIB, growth=64 * MIB, cap=12 * GIB)


@pytest.fixture(scope="module")
def target(engine, checkpoint, memory) -> Iterator[str]:
    """The real service on the simulated device behind a real uvicorn; its host:port."""
    from tests.http.test_hardening import HardenedServer

    # A queue of two, so two held requests make the next a 429 (one alone would race the last
    # request's slot, freed just after its reply).
    service = Service.start(make_settings(checkpoint, max_queue=2), engine=engine.with_options(memory=memory))
    with HardenedServer(create_app(service)) as server:
        yield f"127.0.0.1:{server.port}"


@pytest.fixture(scope="module")
def prometheus(target, tmp_path_factory) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    required_tool(binary is not None, "prometheus (Debian's prometheus package)")
    assert binary is not None
    home = tmp_path_factory.mktemp("prometheus")
    # The compose stack's own config, scraping and evaluating every second, the rules where it mounts
    # them from, and the service on loopback for the stack's `semif:8032`.
    config = yaml.safe_load(STACK_CONFIG.read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(RULES)]
    (job,) = config["scrape_configs"]
    assert job["job_name"] == JOB
    job["static_configs"] = [{"targets": [target]}]
    (home / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (home / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={home / 'prometheus.yml'}",
            f"--storage.tsdb.path={home / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        running = Prometheus(f"http://127.0.0.1:{port}")
        wait_for(
            lambda: running.client.get(f"{running.url}/-/ready", timeout=2).status_code == 200,
            "Prometheus ready",
        )
        yield running
    finally:
        running.client.close()
        process.terminate()
        process.wait(timeout=30)
        log.close()


def scraped(prometheus: Prometheus, expr: str, value: float) -> bool:
    """Whether the last scrape has `expr` at `value` or more."""
    result = prometheus.query(expr)
    return bool(result) and float(result[0]["value"][1]) >= value


@pytest.fixture(scope="module")
def loaded(prometheus, target, memory) -> Prometheus:
    """Prometheus after a short load on the service: answers on every decision route, refusals,
    and one forced out-of-memory once the counter's zero has been scraped."""
    wait_for(lambda: scraped(prometheus, f'up{{job="{JOB}"}}', 1), "the first scrape")
    wait_for(lambda: prometheus.query("semif_out_of_memory_total == 0"), "the OOM counter at 0")
    base = f"http://{target}"
    sent = {"/decide": 0}
    with httpx.Client(base_url=base, headers=AUTH, timeout=60) as client:

        def post(path: str, body: dict, expect: int, **kw) -> None:
            reply = client.post(path, json=body, **kw)
            assert reply.status_code == expect, (path, reply.status_code, reply.text)
            if path == "/decide":
                sent["/decide"] += 1

        for i in range(6):
            post("/decide", decision(id=f"q{i}", state=f"Zone {i} is healthy."), 200)
        shared = {
            "state": "Two of three zones are healthy.",
            "decisions": [decision(id="a"), decision(id="b")],
        }
        for _ in range(3):
            post("/decide/shared", shared, 200)
        systemone = {
            "model": "jev-latest",
            "state": "Health checks passed in all three zones.",
            "questions": {"ok": {"type": "noul", "instructions": "Did the deployment succeed?"}},
        }
        post("/v1/systemone", systemone, 200)
        post("/decide", {"id": "bad"}, 422)
        post("/decide", decision(), 401, headers={"Authorization": "Bearer wrong"})
        memory.fail_next = cuda_oom("CUDA out of memory. Tried to allocate 2.00 GiB")
        post("/decide", decision(id="oom"), 503)
        port = int(target.rsplit(":", 1)[1])
        held = [open_post(port, json.dumps(decision()).encode(), send=10) for _ in range(2)]
        wait_for(lambda: client.get("/health").json()["queue"]["in_progress"] == 2, "the held requests")
        post("/decide", decision(id="busy"), 429)
        for sock in held:
            sock.close()
        wait_for(lambda: client.get("/health").json()["queue"]["in_progress"] == 0, "the held requests' end")
        post("/decide", decision(id="after"), 200)
    wait_for(
        lambda: scraped(prometheus, 'sum(semif_requests_total{route="/decide"})', sent["/decide"]),
        "the load's requests in a scrape",
    )
    wait_for(lambda: scraped(prometheus, "semif_out_of_memory_total", 1), "the OOM in a scrape")
    for _ in range(2):  # two more evaluation rounds of every rule group over the scraped load
        before = last_evaluations(prometheus)
        wait_for(
            lambda before=before: all(last_evaluations(prometheus)[g] != t for g, t in before.items()),
            "an evaluation round of every rule group",
        )
    return prometheus


def last_evaluations(prometheus: Prometheus) -> dict[str, str]:
    """When each rule group was last evaluated, as Prometheus reports it."""
    return {g["name"]: g["lastEvaluation"] for g in prometheus.get("/api/v1/rules")["groups"]}


def selectors(expr: str) -> list[str]:
    """The series selectors of a PromQL expression (name and matchers), recorded rules included."""
    return [name + (matchers or "") for name, matchers in SELECTOR.findall(expr)]


def test_the_selector_reader_finds_every_series_of_an_expression():
    expr = (
        'sum by (job) (rate(semif_requests_total{route=~"/decide",status="429"}[5m])) '
        "/ semif:decision_requests:rate5m > 14.4 and up{job=~'x'} == 0 and histogram_quantile(0.9, x)"
    )
    assert selectors(expr) == [
        'semif_requests_total{route=~"/decide",status="429"}',
        "semif:decision_requests:rate5m",
        "up{job=~'x'}",
    ]


def rule_expressions() -> list[tuple[str, str]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [
        (rule.get("alert") or rule["record"], rule["expr"]) for group in groups for rule in group["rules"]
    ]


def test_every_rule_evaluates_without_error_and_every_series_it_names_has_data(loaded):
    rules = {rule["name"]: rule for g in loaded.get("/api/v1/rules")["groups"] for rule in g["rules"]}
    expressions = rule_expressions()
    assert set(rules) == {name for name, _ in expressions}
    for name, expr in expressions:
        assert rules[name]["health"] == "ok", (name, rules[name].get("lastError"))
        loaded.query(expr)  # no error
        for selector in selectors(expr):
            assert loaded.query(selector), f"{name}: {selector} returns no data"
        if name.startswith("semif:"):  # a recording rule returns data itself
            assert loaded.query(expr), f"{name} returns no data"


def test_every_dashboard_query_returns_data_with_the_labels_its_legend_names(loaded):
    queries = panel_queries(json.loads(DASHBOARD.read_text()))
    assert len(queries) > 30
    for title, expr, legend in queries:
        result = loaded.query(expr)
        assert result, f"{title!r}: {expr} returns no data"
        for label in LEGEND_LABEL.findall(legend):
            assert all(label in series["metric"] for series in result), f"{title!r}: no {label} in {expr}"
        for selector in selectors(expr):
            assert loaded.query(selector), f"{title!r}: {selector} returns no data"


def test_a_forced_out_of_memory_fires_its_alert_and_the_healthy_service_fires_no_other(loaded):
    def firing() -> list[dict]:
        alerts = loaded.get("/api/v1/alerts")["alerts"]
        return [a for a in alerts if a["state"] == "firing"]

    alerts = wait_for(firing, "SemifOutOfMemory firing", seconds=30)
    assert [a["labels"]["alertname"] for a in alerts] == ["SemifOutOfMemory"], alerts
    (alert,) = alerts
    assert alert["labels"]["job"] == JOB and alert["labels"]["severity"] == "warning"
    assert alert["annotations"]["runbook_url"] == "docs/runbook.md#semifoutofmemory"


def test_the_data_check_fails_on_a_series_or_label_the_service_never_produces(loaded):
    for wrong in (
        'semif_engine_wait_seconds_bucket{behind="idel"}',
        'semif_requests_total{route="/decid"}',
        "semif_request_second_bucket",
    ):
        assert selectors(wrong) == [wrong]
        assert not loaded.query(wrong), wrong
