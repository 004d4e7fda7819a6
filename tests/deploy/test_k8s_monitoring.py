"""The chart's alert rules (PrometheusRule) and dashboard (a ConfigMap for Grafana's sidecar),
rendered by Helm's own engine with `--set`-style values and validated: the rule against the
Prometheus Operator's CRD schema (tests/k8s_crds), the ConfigMap strictly against Kubernetes'
schemas; both carry the shipped files unchanged. Off by default.
"""

from __future__ import annotations

import copy
import json

import kubernetes_validate
import pytest
import yaml

from tests.deploy.test_dashboard import DASHBOARD
from tests.deploy.test_k8s_chart import KUBERNETES, NAMESPACE, RELEASE, one, render, validate_custom
from tests.deploy.test_prometheus_rules import RULES

ON = {
    "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "grafanaDashboard": {"enabled": True},
}


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return render(ON)


def test_both_are_off_by_default():
    kinds = {(o["kind"], o["metadata"]["name"]) for o in render({})}
    assert ("PrometheusRule", f"{RELEASE}-semif-serve") not in kinds
    assert ("ConfigMap", f"{RELEASE}-semif-serve-dashboard") not in kinds


def test_the_prometheus_rule_carries_the_rules_file_and_validates_against_its_crd(objects):
    rule = one(objects, "PrometheusRule")
    assert rule["metadata"]["namespace"] == NAMESPACE
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    ((result,),) = [validate_custom([rule])]
    assert result["errors"] == [], result
    broken = copy.deepcopy(rule)
    broken["spec"]["groups"][0]["rules"][0]["for"] = ["5m"]
    broken["spec"]["groups"][0]["interval"] = 30
    (result,) = validate_custom([broken])
    assert result["errors"], "the CRD schema accepted a broken PrometheusRule"


def test_the_dashboard_config_map_carries_the_sidecar_label_and_the_file(objects):
    config_map = one(objects, "ConfigMap", f"{RELEASE}-semif-serve-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == NAMESPACE
    assert json.loads(config_map["data"]["semif-serve.json"]) == json.loads(DASHBOARD.read_text())
    for version in KUBERNETES:
        kubernetes_validate.validate(copy.deepcopy(config_map), version, strict=True)


def test_the_dashboard_goes_to_the_sidecar_s_namespace_with_its_annotations():
    values = {
        "grafanaDashboard": {
            "enabled": True,
            "namespace": "monitoring",
            "annotations": {"grafana_folder": "AI"},
        }
    }
    config_map = one(render(values), "ConfigMap", f"{RELEASE}-semif-serve-dashboard")
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "AI"}
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"


@pytest.mark.parametrize(
    "broken, named",
    [
        ({"prometheusRule": {"enabled": "yes"}}, "/prometheusRule/enabled"),
        ({"prometheusRule": {"enabled": True, "lables": {}}}, "lables"),
        ({"grafanaDashboard": {"enabled": True, "labels": {"grafana_dashboard": 1}}}, "grafana_dashboard"),
    ],
)
def test_a_broken_monitoring_value_fails_to_render_naming_it(broken, named):
    with pytest.raises(Exception, match=named):
        render(broken)


def container_env(objects) -> dict[str, str]:
    deployment = one(objects, "Deployment", f"{RELEASE}-semif-serve")
    (container,) = [
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "semif-serve"
    ]
    return {e["name"]: e.get("value") for e in container["env"]}


def test_traces_are_off_by_default_and_on_by_one_value_with_the_standard_otel_variables():
    assert not any(name.startswith("OTEL_") for name in container_env(render({})))
    env = container_env(
        render({"tracing": {"enabled": True, "endpoint": "http://collector.monitoring:4318"}})
    )
    assert env["OTEL_TRACES_EXPORTER"] == "otlp"  # what http.tracing turns traces on by
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector.monitoring:4318"
    assert (env["OTEL_SERVICE_NAME"], env["OTEL_TRACES_SAMPLER"]) == ("semif-serve", "parentbased_always_on")


@pytest.mark.parametrize(
    ("broken", "named"),
    [
        ({"tracing": {"enabled": True}}, "endpoint"),
        ({"tracing": {"enabled": True, "endpoint": "collector:4318"}}, "endpoint"),
        ({"tracing": {"enabled": True, "endpoint": "http://c:4318", "sampler": "sometimes"}}, "sampler"),
    ],
)
def test_a_broken_tracing_value_fails_to_render_naming_it(broken, named):
    with pytest.raises(Exception, match=named):
        render(broken)
