"""The shipped alert rules (stacks/semif-k8s/files/prometheus-rules.yaml), checked by Prometheus'
own promtool: `promtool check rules`, and `promtool test rules` over tests/deploy/prometheus/
rules_test.yaml, in which every alert fires on the series that should fire it and stays quiet on a
healthy one; and every alert names a runbook section that docs/runbook.md has.

Needs promtool (Debian's `prometheus` package; .ci/run installs it): skips without it, except in CI.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "stacks" / "semif-k8s" / "files" / "prometheus-rules.yaml"
RULE_TESTS = Path(__file__).parent / "prometheus" / "rules_test.yaml"
RUNBOOK = ROOT / "docs" / "runbook.md"
IN_CI = bool(os.environ.get("CI"))


def required_tool(found: bool, what: str) -> None:
    """Skip where a checking tool is not installed, except in CI (.ci/run installs it)."""
    if not found:
        if IN_CI:
            pytest.fail(f"{what} is not installed; .ci/run installs it")
        pytest.skip(f"{what} is not installed (.ci/run installs it)")


def promtool(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    required_tool(binary is not None, "promtool (Debian's prometheus package)")
    return subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=120)


def alerts() -> dict[str, dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"]: rule for group in groups for rule in group["rules"] if "alert" in rule}


def test_promtool_checks_the_rules_file():
    run = promtool("check", "rules", str(RULES))
    assert run.returncode == 0, run.stdout + run.stderr
    assert (
        f"SUCCESS: {sum(len(g['rules']) for g in yaml.safe_load(RULES.read_text())['groups'])} rules"
        in run.stdout
    )


def test_promtool_check_rejects_a_broken_expression(tmp_path):
    broken = yaml.safe_load(RULES.read_text())
    broken["groups"][1]["rules"][0]["expr"] = "up{job= == 0"
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(broken))
    assert promtool("check", "rules", str(path)).returncode != 0


def test_promtool_unit_tests_pass():
    run = promtool("test", "rules", str(RULE_TESTS))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


def test_every_alert_has_a_firing_and_a_quiet_unit_test():
    cases = [
        case for test in yaml.safe_load(RULE_TESTS.read_text())["tests"] for case in test["alert_rule_test"]
    ]
    fires = {case["alertname"] for case in cases if case["exp_alerts"]}
    quiet = {case["alertname"] for case in cases if not case["exp_alerts"]}
    assert set(alerts()) <= fires, set(alerts()) - fires
    assert set(alerts()) <= quiet, set(alerts()) - quiet


def test_the_unit_tests_fail_when_an_alert_stops_firing(tmp_path):
    # The same tests over rules whose OOM alert can never fire: promtool must report it.
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "SemifOutOfMemory":
                rule["expr"] = "increase(semif_out_of_memory_total[15m]) > 100"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    tests = yaml.safe_load(RULE_TESTS.read_text()) | {"rule_files": ["rules.yaml"]}
    tests["tests"] = [  # only the OOM alert's tests, to keep this quick
        test
        for test in tests["tests"]
        if any(c["alertname"] == "SemifOutOfMemory" for c in test["alert_rule_test"])
    ]
    assert tests["tests"]
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    run = promtool("test", "rules", str(tmp_path / "tests.yaml"))
    assert run.returncode != 0 and "SemifOutOfMemory" in run.stdout + run.stderr


def test_the_401_flood_tests_fail_against_rules_that_count_401s_as_decisions(tmp_path):
    # The rules as they were before issue 49: 401s in the denominators and the latency percentiles.
    text = RULES.read_text()
    assert text.count(',status!="401"') == 7
    (tmp_path / "rules.yaml").write_text(text.replace(',status!="401"', ""))
    tests = yaml.safe_load(RULE_TESTS.read_text()) | {"rule_files": ["rules.yaml"]}
    tests["tests"] = [
        test
        for test in tests["tests"]
        if any('status="401"' in series["series"] for series in test["input_series"])
    ]
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    run = promtool("test", "rules", str(tmp_path / "tests.yaml"))
    failed = run.stdout + run.stderr
    assert run.returncode != 0
    assert "alertname: SemifErrorBudgetBurn," in failed and "alertname: SemifLatencyOverObjective," in failed


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_alert_names_a_runbook_section_that_exists_and_severity_and_summary():
    sections = {anchor(line.lstrip("#")) for line in RUNBOOK.read_text().splitlines() if line.startswith("#")}
    for name, rule in alerts().items():
        path, _, section = rule["annotations"]["runbook_url"].partition("#")
        assert path == "docs/runbook.md" and section in sections, (name, section)
        assert rule["labels"]["severity"] in {"critical", "warning"}, name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
