"""The committed env template matches Settings, field for field."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from semif_serve.service.settings import Settings, env_name
from semif_serve.tools.env_template import DEPLOYMENT_VALUES, REGENERATE, render_env_template

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "conf" / "semif.env.example"
ASSIGNMENT = re.compile(r"^(?P<comment># )?(?P<name>SEMIF_[A-Z0-9_]+)=(?P<value>.*)$")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No SEMIF_* variable from the caller's shell leaks into Settings()."""
    for name in list(os.environ):
        if name.startswith("SEMIF_"):
            monkeypatch.delenv(name)


def assignments(text: str) -> list[tuple[bool, str, str]]:
    """(live, name, value) for every `SEMIF_X=` line, commented or not."""
    found = []
    for line in text.splitlines():
        match = ASSIGNMENT.match(line)
        if match:
            found.append((match["comment"] is None, match["name"], match["value"]))
    return found


def test_committed_example_matches_settings():
    assert EXAMPLE.is_file(), f"conf/semif.env.example is missing; create it with:\n  {REGENERATE}"
    committed = EXAMPLE.read_text(encoding="utf-8")
    assert committed == render_env_template(), (
        "conf/semif.env.example is out of date with semif_serve.service.settings.Settings; "
        f"regenerate it from the repository root with:\n  {REGENERATE}"
    )


def test_every_field_appears_exactly_once():
    names = [name for _, name, _ in assignments(render_env_template())]
    expected = [env_name(field) for field in Settings.model_fields]
    assert sorted(names) == sorted(expected)
    assert len(names) == len(set(names))
    assert names == expected, "blocks follow the field order of Settings"


def test_every_block_has_a_description_and_a_default():
    text = render_env_template()
    for field, info in Settings.model_fields.items():
        block = text.split(f"SEMIF_{field.upper()}=")[0].rsplit("\n\n", 1)[-1]
        assert block.startswith(f"# {info.description}"), field
        assert "Default:" in block or "Required" in block, field


def test_secrets_never_get_a_value():
    secrets = [
        env_name(field)
        for field, info in Settings.model_fields.items()
        if "SecretStr" in str(info.annotation)
    ]
    assert "SEMIF_API_TOKEN" in secrets
    for is_live, name, value in assignments(render_env_template()):
        if name in secrets:
            assert (is_live, value) == (False, ""), name
    assert "api_token" not in DEPLOYMENT_VALUES


def test_live_values_are_valid_settings(tmp_path):
    env_file = tmp_path / "semif.env"
    env_file.write_text(render_env_template(), encoding="utf-8")
    settings = Settings(_env_file=env_file)
    live = {name: value for is_live, name, value in assignments(render_env_template()) if is_live}
    assert live, "the template sets the deployment values"
    for field in Settings.model_fields:
        if env_name(field) in live:
            assert str(getattr(settings, field)) == live[env_name(field)], field
    assert settings.api_token is None


@pytest.mark.parametrize("field", sorted(Settings.model_fields))
def test_commented_defaults_parse_back(field, monkeypatch):
    """A commented default, uncommented, gives the field its default again."""
    info = Settings.model_fields[field]
    for is_live, name, value in assignments(render_env_template()):
        if name != env_name(field) or is_live or value == "":
            continue
        monkeypatch.setenv(name, value)
        # The default as the settings parse it (a map default arrives as its dict).
        assert getattr(Settings(), field) == getattr(Settings(**{field: info.default}), field)
