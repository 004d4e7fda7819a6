"""The shipped Grafana dashboard (stacks/semif-k8s/files/grafana-dashboard.json): built by the
Grafana Foundation SDK (stacks/monitoring/build_dashboard.py), and read back through the SDK's
dashboard model unchanged (a misspelt or unknown field would be dropped, a wrong shape refused).
Its queries run against a real Prometheus in tests/deploy/test_prometheus_live.py.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

sdk = pytest.importorskip("grafana_foundation_sdk", reason="grafana-foundation-sdk (a dev dependency)")
from grafana_foundation_sdk.cog.encoder import JSONEncoder  # noqa: E402
from grafana_foundation_sdk.cog.plugins import register_default_plugins  # noqa: E402
from grafana_foundation_sdk.models.dashboard import Dashboard  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "stacks" / "semif-k8s" / "files" / "grafana-dashboard.json"
BUILDER = ROOT / "stacks" / "monitoring" / "build_dashboard.py"


def panel_queries(board: dict) -> list[tuple[str, str, str]]:
    """(panel title, expression, legend) of every query of every panel."""
    return [
        (panel["title"], target["expr"], target.get("legendFormat", ""))
        for panel in board["panels"]
        for target in panel.get("targets") or []
    ]


def through_the_sdk(board: dict) -> dict:
    """The dashboard as the SDK's model reads it and writes it back (each panel's options and each
    Prometheus query through its own plugin's model)."""
    register_default_plugins()
    return json.loads(json.dumps(Dashboard.from_json(board), cls=JSONEncoder))


def test_the_file_is_what_the_sdk_builder_writes():
    spec = importlib.util.spec_from_file_location("build_dashboard", BUILDER)
    assert spec and spec.loader
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    assert DASHBOARD.read_text() == builder.render(), (
        "rerun: uv run python stacks/monitoring/build_dashboard.py"
    )


def test_the_file_reads_back_through_the_sdk_model_unchanged():
    board = json.loads(DASHBOARD.read_text())
    assert through_the_sdk(board) == board


@pytest.mark.parametrize(
    "where, misspelt",
    [((), "refersh"), (("panels", 1), "targtes"), (("panels", 1, "targets", 0), "legendFromat")],
)
def test_the_sdk_model_drops_a_misspelt_field_so_the_round_trip_catches_it(where, misspelt):
    board = json.loads(DASHBOARD.read_text())
    changed = copy.deepcopy(board)
    node = changed
    for key in where:
        node = node[key]
    node[misspelt] = "x"
    assert through_the_sdk(changed) != changed


def test_the_dashboard_shows_what_an_operator_needs():
    board = json.loads(DASHBOARD.read_text())
    text = json.dumps(panel_queries(board))
    for series in (
        "semif_requests_total",
        "semif_busy_rejections_total",
        "semif_request_seconds_bucket",
        "semif_forward_rows_total",
        "semif_forward_padded_tokens_total",
        "semif_gathered_requests_total",
        "semif_engine_wait_seconds_bucket",
        "semif_state_cache_kind_hits_total",
        "semif_state_cache_evictions_total",
        "semif_memory_reserved_bytes",
        "semif_memory_cap_bytes",
        "semif_memory_baseline_bytes",
        "semif_model_requests_total",
        "semif_images_read_total",
        "semif_queue_depth",
        "semif_out_of_memory_total",
        "semif_build_info",
    ):
        assert series in text, series
    assert board["uid"] == "semif-serve"
    assert all(
        target["datasource"]["uid"] == "${datasource}"
        for p in board["panels"]
        for target in p.get("targets") or []
    )


def test_the_objective_panels_leave_out_requests_refused_for_their_token():
    queries = panel_queries(json.loads(DASHBOARD.read_text()))
    ratios = [expr for title, expr, _ in queries if title == "Decision error and refusal ratios"]
    latencies = [expr for title, expr, _ in queries if title == "Request seconds by route"]
    assert len(ratios) == 3 and len(latencies) == 3
    for expr in ratios[:2]:
        _, _, denominator = expr.partition(" / ")
        assert 'status!="401"' in denominator, expr
    assert all('semif_request_seconds_bucket{status!="401"}' in expr for expr in latencies)
    # The 401s still show, as their own share of all requests (SemifUnauthenticatedFlood's).
    assert ratios[2].startswith('sum (rate(semif_requests_total{status="401"}')
