"""Builds semif-serve's Grafana dashboard with the Grafana Foundation SDK and writes its JSON.

    uv run python stacks/monitoring/build_dashboard.py

rewrites stacks/semif-k8s/files/grafana-dashboard.json.

The JSON is the artefact (a file for the compose stack's Grafana, a labelled ConfigMap in the
chart); tests/deploy/test_dashboard.py checks that it is what this script builds, that it reads
back through the SDK's dashboard model unchanged, and (with a real Prometheus) that every query
returns data from a running service. Every query names only series the service exports.
"""

from __future__ import annotations

import json
from pathlib import Path

from grafana_foundation_sdk.builders import common, dashboard, prometheus, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    LegendDisplayMode,
    LegendPlacement,
    SortOrder,
    TooltipDisplayMode,
)
from grafana_foundation_sdk.models.dashboard import DataSourceRef
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

OUTPUT = Path(__file__).resolve().parents[1] / "semif-k8s" / "files" / "grafana-dashboard.json"
UID = "semif-serve"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "5m"  # every rate's window: at least four scrapes at the chart's 15 s interval
DECISIONS = 'route=~"/decide|/decide/shared|/v1/systemone"'
# What the service was asked to do: a 401 asked nothing, and a flood of them would hide the rest.
ASKED = 'status!="401"'
REFUSED_TOKEN = 'status="401"'


def query(expr: str, legend: str) -> prometheus.Dataquery:
    """One Prometheus query of a panel, with its legend."""
    return prometheus.Dataquery().expr(expr).legend_format(legend).datasource(DATASOURCE)


def graph(title: str, unit: str, *queries: tuple[str, str], description: str = "") -> timeseries.Panel:
    """A time series panel of `queries` (expression, legend), half the dashboard wide."""
    panel = (
        timeseries.Panel()
        .title(title)
        .unit(unit)
        .datasource(DATASOURCE)
        .height(8)
        .span(12)
        .line_width(1)
        .fill_opacity(10)
        .legend(
            common.VizLegendOptions()
            .display_mode(LegendDisplayMode.LIST)
            .placement(LegendPlacement.BOTTOM)
            .show_legend(True)
        )
        .tooltip(common.VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING))
    )
    if description:
        panel = panel.description(description)
    for ref, (expr, legend) in zip("ABCDEFGH", queries, strict=False):
        panel = panel.with_target(query(expr, legend).ref_id(ref))
    return panel


def quantiles(series: str, by: str, selector: str = "") -> list[tuple[str, str]]:
    """p50, p90 and p99 of the histogram `series` (its buckets matching `selector`), by the label
    `by` (or over all)."""
    grouping = f"{by}, le" if by else "le"
    legend = f"{{{{{by}}}}} " if by else ""
    matchers = f"{{{selector}}}" if selector else ""
    return [
        (
            f"histogram_quantile({q}, sum by ({grouping}) (rate({series}_bucket{matchers}[{RATE}])))",
            f"{legend}p{round(q * 100)}",
        )
        for q in (0.5, 0.9, 0.99)
    ]


def rate(series: str, by: str = "", selector: str = "") -> str:
    """The per-second rate of a counter, summed (by `by`)."""
    grouping = f" by ({by})" if by else ""
    matchers = f"{{{selector}}}" if selector else ""
    return f"sum{grouping} (rate({series}{matchers}[{RATE}]))"


def decision_ratio(status: str) -> str:
    """The share of decision requests (401s left out) answered with `status` (a label matcher)."""
    answered = rate("semif_requests_total", "", f"{DECISIONS},{status}")
    return f"{answered} / {rate('semif_requests_total', '', f'{DECISIONS},{ASKED}')}"


def build() -> dict:
    """The dashboard, as the JSON Grafana imports."""
    rows: list[tuple[str, list]] = [
        (
            "Traffic and refusals",
            [
                graph(
                    "Requests by route and status",
                    "reqps",
                    (rate("semif_requests_total", "route, status"), "{{route}} {{status}}"),
                ),
                graph(
                    "Refusals and errors by route and status",
                    "reqps",
                    (
                        rate("semif_requests_total", "route, status", 'status=~"4..|5.."'),
                        "{{route}} {{status}}",
                    ),
                    (rate("semif_busy_rejections_total"), "refused busy (429)"),
                ),
                graph(
                    "Decision error and refusal ratios",
                    "percentunit",
                    (decision_ratio('status=~"5.."'), "5xx (budget 0.5%)"),
                    (decision_ratio('status="429"'), "429 (budget 1%)"),
                    (
                        f"{rate('semif_requests_total', '', REFUSED_TOKEN)} / {rate('semif_requests_total')}",
                        "401 of all requests (flood over 50%)",
                    ),
                    description=(
                        "The SLO ratios the burn-rate alerts watch, over decision requests less those"
                        " refused for their token; and the 401s' share of all requests"
                        " (SemifUnauthenticatedFlood; docs/runbook.md)."
                    ),
                ),
                graph(
                    "Queue",
                    "short",
                    ("sum by (instance) (semif_requests_in_progress)", "{{instance}} in progress"),
                    ("sum by (instance) (semif_queue_depth)", "{{instance}} engine jobs"),
                    ("sum by (instance) (semif_ready)", "{{instance}} ready"),
                ),
            ],
        ),
        (
            "Latency",
            [
                graph(
                    "Request seconds by route",
                    "s",
                    *quantiles("semif_request_seconds", "route", ASKED),
                    description="Requests refused for their token (401) left out, as in the latency alert.",
                ),
                graph("Engine forward seconds per request", "s", *quantiles("semif_forward_seconds", "")),
                graph(
                    "Engine waits before the first forward",
                    "s",
                    *quantiles("semif_engine_wait_seconds", ""),
                    description="Behind other requests' work; a tiny request waits one engine step at most.",
                ),
                graph(
                    "Shared state prefix tokens per request", "short", *quantiles("semif_prefix_tokens", "")
                ),
            ],
        ),
        (
            "Batching",
            [
                graph(
                    "Rows per forward",
                    "short",
                    (
                        f"{rate('semif_forward_rows_total')} / {rate('semif_forwards_total')}",
                        "rows per forward",
                    ),
                    (
                        f"{rate('semif_merged_forwards_total')} / {rate('semif_forwards_total')}",
                        "merged share",
                    ),
                ),
                graph(
                    "Padding share of the forwards' suffix tokens",
                    "percentunit",
                    (
                        f"1 - {rate('semif_forward_true_tokens_total')}"
                        f" / {rate('semif_forward_padded_tokens_total')}",
                        "padding",
                    ),
                ),
                graph(
                    "Rows and forwards",
                    "ops",
                    (rate("semif_rows_scored_total"), "rows scored"),
                    (rate("semif_forwards_total"), "forwards"),
                    (rate("semif_isolated_retries_total"), "isolated retries"),
                    (rate("semif_cancelled_dropped_total"), "dropped (caller gone)"),
                    (rate("semif_gathers_total"), "turns that waited for answered clients"),
                    (rate("semif_gathered_requests_total"), "requests gathered"),
                ),
            ],
        ),
        (
            "State cache",
            [
                graph(
                    "Lookups by tier, and evictions",
                    "ops",
                    (rate("semif_state_cache_kind_hits_total", "kind"), "{{kind}} hits"),
                    (rate("semif_state_cache_kind_misses_total", "kind"), "{{kind}} misses"),
                    (rate("semif_state_cache_evictions_total"), "evictions"),
                    (rate("semif_state_cache_refused_total"), "refused (over the budget)"),
                ),
                graph(
                    "Stored bytes against the budget",
                    "bytes",
                    ("sum by (instance) (semif_state_cache_bytes)", "{{instance}} stored"),
                    ("sum by (instance) (semif_state_cache_budget_bytes)", "{{instance}} budget"),
                ),
                graph(
                    "Stored prefixes by tier",
                    "short",
                    ("sum by (kind) (semif_state_cache_kind_entries)", "{{kind}}"),
                ),
            ],
        ),
        (
            "Memory",
            [
                graph(
                    "Reserved memory against the cap and the baseline",
                    "bytes",
                    ("sum by (instance) (semif_memory_reserved_bytes)", "{{instance}} reserved"),
                    ("sum by (instance) (semif_memory_baseline_bytes)", "{{instance}} baseline"),
                    (
                        "sum by (instance) (semif_memory_baseline_bytes + semif_memory_release_margin_bytes)",
                        "{{instance}} release above",
                    ),
                    ("sum by (instance) (semif_memory_cap_bytes)", "{{instance}} cap"),
                ),
                graph(
                    "Out-of-memory events and releases",
                    "short",
                    (f"sum by (instance) (increase(semif_out_of_memory_total[{RATE}]))", "{{instance}} OOM"),
                    (
                        f"sum by (instance) (increase(semif_memory_releases_total[{RATE}]))",
                        "{{instance}} releases",
                    ),
                ),
            ],
        ),
        (
            "Models and images",
            [
                graph(
                    "Answered requests by model",
                    "reqps",
                    (rate("semif_model_requests_total", "model"), "{{model}}"),
                ),
                graph("Images shown to the model", "ops", (rate("semif_images_read_total"), "images")),
                table.Panel()
                .title("What each replica serves")
                .datasource(DATASOURCE)
                .height(6)
                .span(24)
                .show_header(True)
                .with_target(
                    query("semif_build_info", "{{instance}}")
                    .ref_id("A")
                    .instant()
                    .format(PromQueryFormat.TABLE)
                ),
            ],
        ),
    ]
    board = (
        dashboard.Dashboard("semif-serve")
        .uid(UID)
        .description(
            "semif-serve: traffic, latency, batching, the state cache, memory, models (docs/runbook.md)"
        )
        .tags(["semif-serve"])
        .refresh("30s")
        .time("now-1h", "now")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
    )
    for title, panels in rows:
        board = board.with_row(dashboard.Row(title))
        for panel in panels:
            board = board.with_panel(panel)
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def render() -> str:
    """The dashboard file's text (sorted keys, two-space indent, one newline at the end)."""
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT}")
