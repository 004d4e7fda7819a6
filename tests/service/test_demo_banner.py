"""`semif-serve demo` prints a token it made, and never one the operator gave it (not in its banner,
not in its log). The command runs for real up to the port: loading and serving are stood in for."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest

import semif_serve.app
import semif_serve.http.server
import semif_serve.service.startup
from semif_serve.tools import cli

OPERATOR_TOKEN = "operator-secret-7f3a9c"


@pytest.fixture
def demo_run(monkeypatch, checkpoint, capsys):
    """Run `semif-serve demo` up to binding its port; returns (stdout, stderr) of the run."""
    monkeypatch.setattr(logging.root, "handlers", list(logging.root.handlers))
    monkeypatch.setattr(logging.root, "level", logging.root.level)
    monkeypatch.setattr(cli, "ensure_demo_checkpoint", lambda directory: checkpoint)
    stand_in = SimpleNamespace(
        demo=True,
        worker=SimpleNamespace(shutdown=lambda: None),
        models=SimpleNamespace(resolve=lambda name: None),  # the base alone: no lev release to name
    )
    monkeypatch.setattr(semif_serve.service.startup.Service, "start", lambda settings: stand_in)
    monkeypatch.setattr(semif_serve.app, "create_app", lambda service: None)
    monkeypatch.setattr(semif_serve.http.server, "run_server", lambda *args: None)
    for name in ("SEMIF_API_TOKEN", "SEMIF_API_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)

    def run() -> tuple[str, str]:
        assert cli.main(["demo", "--port", "8099"]) == 0
        captured = capsys.readouterr()
        return captured.out, captured.err

    return run


def test_the_demo_never_prints_or_logs_a_token_the_operator_supplied(demo_run, monkeypatch):
    monkeypatch.setenv("SEMIF_API_TOKEN", OPERATOR_TOKEN)
    out, err = demo_run()
    assert "semif-serve demo (random weights) on http://127.0.0.1:8099" in out
    assert OPERATOR_TOKEN not in out + err
    assert "$SEMIF_API_TOKEN" in out  # the example reads it from the environment instead
    assert "serving" in err  # the log line was written, and holds no token either


def test_the_demo_never_prints_a_token_read_from_a_file(demo_run, monkeypatch, tmp_path):
    secret = tmp_path / "token"
    secret.write_text(OPERATOR_TOKEN + "\n")
    monkeypatch.setenv("SEMIF_API_TOKEN_FILE", str(secret))
    out, err = demo_run()
    assert OPERATOR_TOKEN not in out + err


def test_the_demo_prints_the_token_it_made(demo_run):
    out, _ = demo_run()
    (made,) = re.findall(r"^token: (demo-\S+)$", out, re.MULTILINE)
    assert f"Bearer {made}" in out
