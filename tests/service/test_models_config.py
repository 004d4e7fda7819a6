"""SEMIF_MODELS: the TOML file of models over the base and their aliases, validated at startup
with errors that name the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from semif_serve.domain.types import ConfigurationError
from semif_serve.service.methods import MethodRegistry
from semif_serve.service.models import JEV_ALIASES, base_only, load_models
from semif_serve.service.settings import load_settings

BASE = "Qwen/Qwen3.5-4B@main"
METHODS = MethodRegistry.of()  # the built-in methods: SemIf's and lev's


@pytest.fixture
def dirs(tmp_path) -> dict[str, Path]:
    release = tmp_path / "lev"
    release.mkdir()
    (release / "lev_release.json").write_text("{}")
    adapter = tmp_path / "triage-lora"
    adapter.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (adapter / name).write_text("")
    return {"release": release, "adapter": adapter, "root": tmp_path}


def write(dirs, text: str) -> Path:
    path = dirs["root"] / "models.toml"
    path.write_text(text.format(release=dirs["release"], adapter=dirs["adapter"]))
    return path


ISSUE_SHAPE = """
[models.lev-4b]
release = "{release}"
noul_readout = "binary"
prompt_style = "plain"
score_order_average = "reversed"  # lev's own name, read as the one vocabulary's
[models.triage]
adapter = "{adapter}"
scale = 0.5
[aliases]
local = "lev-4b"
"""


def test_the_issue_shape(dirs):
    models = load_models(write(dirs, ISSUE_SHAPE), BASE, METHODS)
    assert list(models.models) == [BASE, "lev-4b", "triage"]
    lev = models.resolve("local")
    assert lev is models.models["lev-4b"] and lev.method == "lev" and lev.directory == dirs["release"]
    assert dict(lev.options) == {
        "noul_readout": "binary",
        "prompt_style": "plain",
        "score_order_average": "reversal",
    }
    triage = models.resolve("triage")
    assert triage is not None and triage.method == "semif" and triage.directory == dirs["adapter"]
    assert triage.scale == 0.5 and not models.is_base(triage)
    assert models.models[BASE].method == "semif" and models.is_base(models.models[BASE])
    for jev in JEV_ALIASES:  # still the base, unless configured
        assert models.resolve(jev) is models.models[BASE]
    assert models.resolve("nope") is None
    assert [e.name for e in models.over_base] == ["lev-4b", "triage"]
    assert dict(models.aliases) == {"jev-latest": BASE, "jev-preview": BASE, "local": "lev-4b"}


@pytest.mark.parametrize(
    ("written", "read"),
    [("off", "none"), ("reversed", "reversal"), ("cyclic", "rotations")]
    + [(name, name) for name in ("none", "reversal", "rotations")],
)
def test_levs_score_orders_are_read_in_the_one_vocabulary_of_orderings(dirs, written, read):
    text = f'[models.lev-4b]\nrelease = "{{release}}"\nscore_order_average = "{written}"\n'
    entry = load_models(write(dirs, text), BASE, METHODS).models["lev-4b"]
    assert entry.options == {"score_order_average": read}


def test_an_entry_names_its_method_or_is_read_by_the_one_that_claims_its_keys(dirs):
    text = '[models.r]\nrelease = "{release}"\n[models.a]\nadapter = "{adapter}"\n'
    text += '[models.lev-base]\nmethod = "lev"\n'
    models = load_models(write(dirs, text), BASE, METHODS)
    assert [(e.name, e.method) for e in models.over_base] == [
        ("r", "lev"),
        ("a", "semif"),
        ("lev-base", "lev"),
    ]
    # The base read with lev's method: no weights of its own, lev's frozen-base noul readout.
    assert models.models["lev-base"].directory is None
    assert models.models["lev-base"].options == {"noul_readout": "binary"}


def test_jev_aliases_may_be_repointed_and_turned_off(dirs):
    text = ISSUE_SHAPE + 'jev-latest = "triage"\n'
    models = load_models(write(dirs, text), BASE, METHODS)
    assert models.resolve("jev-latest").name == "triage"
    assert models.resolve("jev-preview").name == BASE
    # SEMIF_SYSTEMONE_ALLOW_ALIASES=false: the default Jev names go, the declared one stays.
    assert models.resolve("jev-preview", jev_aliases=False) is None
    assert models.resolve("jev-latest", jev_aliases=False).name == "triage"
    assert base_only(BASE).resolve("jev-latest").name == BASE
    assert base_only(BASE).models[BASE].method == "semif"


def test_relative_paths_are_read_from_the_file_directory(dirs):
    path = write(dirs, '[models.t]\nadapter = "triage-lora"\n')
    assert load_models(path, BASE, METHODS).models["t"].directory == dirs["adapter"]


def test_settings_field(tmp_path, monkeypatch):
    monkeypatch.setenv("SEMIF_MODELS", str(tmp_path / "models.toml"))
    assert load_settings().models == tmp_path / "models.toml"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[models.a\n", "not valid TOML"),
        ("[other]\n", "other: unknown table"),
        (
            '[models.a]\nrelease = "{release}"\nadapter = "{adapter}"\n',
            "models.a: sets both release and adapter",
        ),
        ("[models.a]\nscale = 1.0\n", "models.a: sets neither release nor adapter"),
        ('[models.a]\nadapter = "{adapter}"\nprompt_style = "chat"\n', "models.a.prompt_style: unknown key"),
        ('[models.a]\nrelease = "{release}"\ncolour = "red"\n', "models.a.colour: unknown key for a release"),
        (
            '[models.a]\nrelease = "{release}"\nprompt_style = "fancy"\n',
            "models.a.prompt_style: 'fancy' is not",
        ),
        ('[models.a]\nadapter = "/nowhere/at/all"\n', "models.a.adapter: /nowhere/at/all is not a directory"),
        ('[models.a]\nrelease = "{adapter}"\n', "models.a.release: {adapter} has no lev_release.json"),
        ('[models.a]\nadapter = "{release}"\n', "models.a.adapter: {release} has no adapter_config.json"),
        ('[models.a]\nadapter = "{adapter}"\nscale = 0\n', "models.a.scale: must be a positive number"),
        ('[models.a]\nadapter = "{adapter}"\nscale = true\n', "models.a.scale: must be a positive number"),
        ("[models.a]\nadapter = 3\n", "models.a.adapter: must be a directory path"),
        (
            '[models.jev-latest]\nadapter = "{adapter}"\n',
            "models.jev-latest: 'jev-latest' is the base model's name",
        ),
        (
            f'[models."{BASE}"]\nadapter = "{{adapter}}"\n',
            f"models.{BASE}: '{BASE}' is the base model's name",
        ),
        ('[models."a b"]\nadapter = "{adapter}"\n', "models.a b: a model name is"),
        ('[models.a]\nadapter = "{adapter}"\n[aliases]\nlocal = "b"\n', "aliases.local: 'b' is not a model"),
        ('[models.a]\nadapter = "{adapter}"\n[aliases]\na = "a"\n', "aliases.a: shadows the model 'a'"),
        ('[models.a]\nadapter = "{adapter}"\n[aliases]\nlocal = 1\n', "aliases.local: must be a model name"),
        ("models = 3\n", "models: must be a table"),
        (
            '[models.a]\nmethod = "nope"\n',
            "models.a.method: 'nope' is not a method (methods: 'semif', 'lev')",
        ),
        ('[models.a]\nmethod = "semif"\n', "models.a.method: 'semif' needs an adapter"),
        (
            '[models.a]\nmethod = "lev"\nadapter = "{adapter}"\n',
            "models.a.adapter: unknown key for the base read with lev's method",
        ),
        (
            '[models.a]\nrelease = "{release}"\nscore_order_average = "sideways"\n',
            "models.a.score_order_average: 'sideways' is not",
        ),
    ],
)
def test_refusals_name_the_file_and_the_key(dirs, text, message):
    path = write(dirs, text)
    with pytest.raises(ConfigurationError) as refused:
        load_models(path, BASE, METHODS)
    assert f"SEMIF_MODELS: {path}: " in str(refused.value)
    assert message.format(**dirs) in str(refused.value)


def test_an_alias_may_name_the_base(dirs):
    models = load_models(write(dirs, f'[aliases]\nlocal = "{BASE}"\n'), BASE, METHODS)
    assert models.is_base(models.resolve("local"))


def test_unreadable_file(tmp_path):
    with pytest.raises(ConfigurationError, match="cannot read"):
        load_models(tmp_path / "absent.toml", BASE, METHODS)


def test_a_service_answers_an_operators_alias_of_the_base_and_lists_it(engine, checkpoint, tmp_path):
    from semif_serve.app import create_app
    from semif_serve.service.startup import Service
    from semif_serve.tools.demo import DEMO_REVISION
    from tests.support import in_process_client, make_settings

    base = f"Qwen/Qwen3.5-4B@{DEMO_REVISION}"
    models = tmp_path / "models.toml"
    models.write_text(f'[aliases]\nlocal = "{base}"\n')
    client = in_process_client(
        create_app(Service.start(make_settings(checkpoint, models=models), engine=engine))
    )
    listed = [(m["name"], m.get("x_alias_of")) for m in client.get("/v1/models").json()["models"]]
    assert listed == [(base, None), ("jev-latest", base), ("jev-preview", base), ("local", base)]
    body = {
        "model": "local",
        "state": "All zones are healthy.",
        "questions": {"ok": {"type": "noul", "name": "ok"}},
    }
    assert client.post("/v1/systemone", json=body).status_code == 200
    unknown = client.post("/v1/systemone", json={**body, "model": "lev-4b"})
    assert unknown.status_code == 400 and "aliases: jev-latest, jev-preview, local" in unknown.text


def test_a_service_refuses_to_start_on_a_release_it_cannot_read(engine, checkpoint, dirs):
    from semif_serve.service.startup import Service
    from tests.support import make_settings

    with pytest.raises(
        ConfigurationError, match=r"models\.lev-4b\.release: .*lev_release\.json: base_model: required"
    ):
        Service.start(
            make_settings(
                checkpoint, models=write(dirs, f'[models.lev-4b]\nrelease = "{dirs["release"]}"\n')
            ),
            engine=engine,
        )
