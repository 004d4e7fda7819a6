"""The README stays true: its curl examples run against a live demo service, its tables match."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import TOKEN

from acceptance.server import LoopbackServer
from semif_serve.app import create_app
from semif_serve.settings import Settings, env_name

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_the_readme_starts_with_the_demo_and_test_commands():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    assert first_block.splitlines()[0].startswith("uv run semif-serve demo")
    assert first_block.splitlines()[1].startswith("uv run pytest")


def test_the_configuration_table_lists_every_setting():
    for field in Settings.model_fields:
        assert f"| `{env_name(field)}` |" in README, env_name(field)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_the_readme_curl_examples_work_against_the_demo_service(service):
    with LoopbackServer(create_app(service)) as server:
        block = next(b for b in re.findall(r"```bash\n(.*?)```", README, re.S) if "curl" in b)
        script = block.replace("http://127.0.0.1:8032", server.url)
        script = re.sub(r"^T=.*$", f"T={TOKEN}", script, flags=re.M)
        out = subprocess.run(
            ["bash", "-c", 'curl() { command curl "$@"; echo; }\n' + script],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        replies = [json.loads(line) for line in out.splitlines() if line.strip()]
        assert len(replies) == block.count("curl ")
        assert replies[0]["option_ids"] == ["yes", "no"]
        assert replies[1]["combined"]["orderings"] == 3
        assert replies[2]["ready"] is True
        assert not any("error" in r for r in replies)
