"""System One conformance: `jevcompat test URL --key KEY --json report.json` against a live service.

The service is the real app on the demo checkpoint, served by a real uvicorn on loopback (the
session's engine: no second model load). The build fails unless jevcompat exits 0 with MUST
32/32 and SHOULD 15/15, and each requirement is asserted on its own so a failure names it.
One of the two auth MUSTs applies per run: `auth.bearer` with a key (this run);
`auth.ignored-when-off` only to a server that runs without a key, which semif-serve never
does, so a keyless run would have nothing to test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from jevcompat.spec import REQUIREMENTS

from harness.server import LoopbackServer
from semif_serve.app import create_app
from tests.support import TOKEN

JEVCOMPAT = str(Path(sys.executable).parent / "jevcompat")
MUSTS_TESTED = 32
SHOULDS_TESTED = 15
# The one requirement a keyed run cannot exercise (it is about servers that take no key).
NOT_APPLICABLE_WITH_A_KEY = {"auth.ignored-when-off"}


@pytest.fixture(scope="module")
def conformance(service, tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    report_path = tmp_path_factory.mktemp("jevcompat") / "report.json"
    with LoopbackServer(create_app(service)) as server:
        run = subprocess.run(
            [JEVCOMPAT, "test", server.url, "--key-env", "JEVCOMPAT_KEY", "--json", str(report_path)],
            env={**os.environ, "JEVCOMPAT_KEY": TOKEN, "NO_COLOR": "1"},
            capture_output=True,
            text=True,
            timeout=900,
        )
    assert report_path.exists(), run.stdout + run.stderr
    return run, json.loads(report_path.read_text(encoding="utf-8"))


def test_jevcompat_calls_the_service_conformant_with_every_must_and_should(conformance):
    run, report = conformance
    summary = report["summary"]
    assert (summary["MUST"]["passed"], summary["MUST"]["tested"]) == (MUSTS_TESTED, MUSTS_TESTED), run.stdout
    assert (summary["SHOULD"]["passed"], summary["SHOULD"]["tested"]) == (SHOULDS_TESTED, SHOULDS_TESTED)
    assert summary["conformant"] is True and summary["untested_musts"] == []
    assert report["aborted"] is None and report["case_errors"] == [] and report["inconclusive"] == []
    assert run.returncode == 0, run.stdout[-4000:]
    assert f"MUST {MUSTS_TESTED}/{MUSTS_TESTED}, SHOULD {SHOULDS_TESTED}/{SHOULDS_TESTED}" in run.stdout


def test_jevcompat_sees_the_real_limits_and_the_sdk(conformance):
    _, report = conformance
    info = report["info"]
    assert info["limits"] == {"choice options accepted up to": 255, "score levels accepted up to": 10}
    assert sorted(info["types_ok"]) == ["choice", "noul", "score"]
    assert info["typesafe_sdk"] == "0.7.5"
    assert report["model"] == "jev-latest" and info["model_reported"].startswith("Qwen/Qwen3.5-4B@")


@pytest.mark.parametrize("requirement", sorted(REQUIREMENTS))
def test_jevcompat_requirement(conformance, requirement):
    _, report = conformance
    (result,) = [r for r in report["results"] if r["id"] == requirement]
    expected = "skip" if requirement in NOT_APPLICABLE_WITH_A_KEY else "pass"
    findings = json.dumps(result.get("findings"), ensure_ascii=False)[:2000]
    assert result["status"] == expected, f"{requirement} ({result['title']}): {result['status']}: {findings}"
