"""stacks/monitoring: the single-GPU stack included as it is, plus Prometheus (the shipped rules)
and Grafana (Prometheus and the shipped dashboard provisioned). Checked as tests/deploy/
test_stacks.py checks the other stacks (parsed, variables known and documented, paths inside the
checkout, read-only mounts), and Prometheus' config by the real `promtool check config`;
`docker compose config` runs over it in test_stacks.py where docker compose is installed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from tests.deploy.test_dashboard import DASHBOARD
from tests.deploy.test_prometheus_rules import RULES, required_tool
from tests.deploy.test_stacks import (
    INTERPOLATION,
    ROOT,
    SINGLE,
    STACK_VARS,
    check_logging,
    load_compose,
    mounts,
    with_defaults,
)

STACK = ROOT / "stacks" / "monitoring"
COMPOSE = STACK / "compose.yaml"
MONITORING_VARS = {"PROMETHEUS_PORT", "GRAFANA_PORT", "GRAFANA_ADMIN_PASSWORD_FILE"}


def source_of(service: dict, target: str) -> Path:
    """The checkout path a service's read-only bind mount at `target` comes from."""
    volume = mounts(service)[target]
    assert volume["read_only"], f"{target} is mounted read-write"
    return (STACK / with_defaults(volume["source"])).resolve()


def test_the_stack_includes_the_single_gpu_stack_and_adds_prometheus_and_grafana():
    compose = load_compose(COMPOSE)
    assert [(STACK / path).resolve() for path in compose["include"]] == [SINGLE]
    assert set(compose["services"]) == {"prometheus", "grafana"}
    semif = load_compose(SINGLE)["services"]["semif"]
    assert semif["environment"]["SEMIF_METRICS_PUBLIC"] == "true", "Prometheus scrapes without the token"
    for name, service in compose["services"].items():
        image, _, tag = service["image"].rpartition(":")
        assert image and tag.lstrip("v")[:1].isdigit(), f"{name}: pin the image's version"
        assert service["restart"] == "unless-stopped"
        assert service["cap_drop"] == ["ALL"] and "no-new-privileges:true" in service["security_opt"]
        for port in service["ports"]:
            assert with_defaults(port).startswith("127.0.0.1:"), f"{name} publishes on loopback only"
        check_logging(service)


def test_prometheus_loads_the_shipped_rules_and_scrapes_the_semif_service():
    compose = load_compose(COMPOSE)
    prometheus = compose["services"]["prometheus"]
    config_path = source_of(prometheus, "/etc/prometheus/prometheus.yml")
    assert config_path == STACK / "prometheus.yml"
    config = yaml.safe_load(config_path.read_text())
    (rules_target,) = config["rule_files"]
    assert source_of(prometheus, rules_target) == RULES
    (job,) = config["scrape_configs"]
    assert "semif-serve" in job["job_name"], "the rules select jobs named *semif-serve*"
    semif = load_compose(SINGLE)["services"]["semif"]
    assert job["static_configs"] == [{"targets": [f"semif:{semif['environment']['SEMIF_PORT']}"]}]
    assert job.get("metrics_path", "/metrics") == "/metrics"


def test_promtool_checks_the_stack_s_prometheus_config(tmp_path):
    binary = shutil.which("promtool")
    required_tool(binary is not None, "promtool (Debian's prometheus package)")
    config = yaml.safe_load((STACK / "prometheus.yml").read_text())
    config["rule_files"] = [str(RULES)]  # where the compose file mounts it from
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    run = subprocess.run(
        [str(binary), "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout + run.stderr


def test_grafana_is_provisioned_with_prometheus_and_the_shipped_dashboard():
    grafana = load_compose(COMPOSE)["services"]["grafana"]
    provisioning = source_of(grafana, "/etc/grafana/provisioning")
    assert provisioning == STACK / "grafana" / "provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "semif-serve.yaml").read_text())["providers"]
    folder = provider["options"]["path"]
    dashboards = {t: s for t, s in mounts(grafana).items() if t.startswith(folder + "/")}
    assert [source_of(grafana, target) for target in dashboards] == [DASHBOARD]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home in dashboards
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin"


def test_every_variable_has_a_default_is_documented_and_paths_stay_in_the_checkout():
    text = COMPOSE.read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    readme = (STACK / "README.md").read_text()
    for match in INTERPOLATION.finditer(text):
        assert match["name"] in MONITORING_VARS | STACK_VARS, match["name"]
        assert match["default"], f"${{{match['name']}}} has no default"
        assert match["name"] in header and f"`{match['name']}`" in readme, match["name"]
    compose = load_compose(COMPOSE)
    for service in compose["services"].values():
        for volume in mounts(service).values():
            if volume["source"] in compose.get("volumes", {}):
                continue  # a named volume
            source = (STACK / with_defaults(volume["source"])).resolve()
            assert source.is_relative_to(ROOT) and source.exists(), source
    for secret in compose["secrets"].values():
        assert not with_defaults(secret["file"]).startswith("/")


def test_the_runbook_and_the_readme_start_this_stack_with_one_command():
    command = "docker compose -f stacks/monitoring/compose.yaml up -d"
    assert command in (ROOT / "docs" / "runbook.md").read_text()
    assert command in (STACK / "README.md").read_text()
    assert command in COMPOSE.read_text()
