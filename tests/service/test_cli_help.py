"""`semif-serve --help` and every subcommand's help say what it does and where the settings are."""

from __future__ import annotations

import re

import pytest

from semif_serve.service.settings import Settings, env_name
from semif_serve.tools.cli import build_parser, main

DOCUMENTED = [
    "serve",
    "demo",
    "demo-model",
    "run-batch",
    "calibrate",
    "env-template",
    "check-model",
    "manifest",
    "presentation-checks",
]


def help_text(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    return re.sub(r"\s+", " ", capsys.readouterr().out)


def test_the_top_level_help_lists_every_command_with_what_it_does(capsys):
    text = help_text(capsys)
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    for name in DOCUMENTED:
        assert name in subparsers.choices
        (choice,) = [c for c in subparsers._choices_actions if c.dest == name]
        assert choice.help and choice.help in text, name
    assert "semif-serve env-template" in text


@pytest.mark.parametrize("command", DOCUMENTED)
def test_every_command_says_what_it_does_and_points_to_env_template(capsys, command):
    text = help_text(capsys, command)
    description = text.split(" options:")[0]
    assert len(description.split()) > 8, description
    assert "semif-serve env-template" in text


def test_serve_help_lists_every_setting_with_its_default(capsys):
    text = help_text(capsys, "serve")
    for field, info in Settings.model_fields.items():
        default = info.default
        if default in (None, ""):
            written = "unset"
        elif isinstance(default, bool):
            written = str(default).lower()
        else:
            written = str(default)
        assert re.search(rf"{env_name(field)} .*?\[{re.escape(written)}\]", text), env_name(field)


def test_demo_help_explains_port_and_the_settings_it_reads(capsys):
    text = help_text(capsys, "demo")
    assert re.search(r"--port PORT \w+", text), "--port has a help text"
    for variable in ("SEMIF_PORT", "SEMIF_API_TOKEN", "SEMIF_CALIBRATION", "SEMIF_DEMO_DIR"):
        assert variable in text, variable


def test_check_model_and_manifest_help_name_their_arguments(capsys):
    assert "--manifest FILE" in help_text(capsys, "check-model")
    assert "--write FILE" in help_text(capsys, "manifest")


def test_calibrate_help_explains_every_option_and_what_it_prints(capsys):
    text = help_text(capsys, "calibrate")
    listed = text.split(" options:")[1]
    for option in (
        "--gold FILE",
        "--predictions FILE",
        "--mode",
        "--workload NAME",
        "--json FILE",
        "--plot FILE.png",
    ):
        assert re.search(rf"{re.escape(option)}(?: \{{[a-z,]+\}})? [a-z(]", listed), option
    for promise in ("out-of-fold", "150 rows", "bound", "calibration.json"):
        assert promise in text, promise
