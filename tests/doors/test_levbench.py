"""lev's own benchmark harness, `levbench eval --backend lev` (its built-in 24-item fixture),
against a live semif-serve through an operator alias: it sends the model name `local`, which
SEMIF_MODELS maps to a lev release, and must run clean. levbench is lev's (Apache-2.0), not on
PyPI: built from its source in a scratch environment (bench/README.md, Peers) and found through
SEMIF_LEVBENCH or PATH; without it the test skips, saying so."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from harness.server import ServiceProcess
from semif_serve.tools.demo import DEMO_REVISION, ensure_demo_models

LEVBENCH = os.environ.get("SEMIF_LEVBENCH") or shutil.which("levbench")


@pytest.mark.skipif(
    LEVBENCH is None, reason="levbench is not installed (SEMIF_LEVBENCH names its executable)"
)
def test_levbench_runs_clean_against_the_service_through_the_local_alias(checkpoint, tmp_path):
    models = ensure_demo_models(checkpoint)  # [models.lev-demo] and `local = "lev-demo"`
    with ServiceProcess(checkpoint, DEMO_REVISION, {"models": models, "device": "cpu"}, tmp_path) as service:
        env = {**os.environ, "LEVBENCH_LOCAL_API_KEY": service.token}
        ran = subprocess.run(
            [str(LEVBENCH), "eval", "--backend", "lev", "--base-url", service.url],
            env=env,
            cwd=tmp_path,  # levbench reads a .env from its working directory: none here
            capture_output=True,
            text=True,
            timeout=600,
        )
        log = service.log_path.read_text(encoding="utf-8")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "=== lev / lev-demo ===" in ran.stdout  # the reply names the release the alias reads
    assert re.search(r"calls\s+24\b", ran.stdout) and re.search(r"schema retries\s+0\b", ran.stdout)
    statuses = re.findall(r'"status": (\d+)', log)
    assert statuses and set(statuses) == {"200"}
