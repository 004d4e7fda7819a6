"""Startup validation: every setting, the token, the calibration file, warm-up; fail closed, offline."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TOKEN, decision, make_settings
from memory_sim import SimulatedMemory, cuda_oom

from semif_serve.domain.types import ConfigurationError, DecisionError
from semif_serve.service.settings import load_settings
from semif_serve.service.startup import Service
from semif_serve.tools.demo import DEMO_REVISION, write_checkpoint


@pytest.fixture
def clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("SEMIF_"):
            monkeypatch.delenv(key)
    return monkeypatch


@pytest.mark.parametrize(
    "variable",
    ["SEMIF_MAX_ROWS", "SEMIF_MAX_INPUT_TOKENS", "SEMIF_MAX_QUEUE", "SEMIF_MAX_BODY_BYTES", "SEMIF_PORT"],
)
@pytest.mark.parametrize("value", ["0", "-1"])
def test_every_limit_below_one_is_refused_naming_the_variable(clean_env, variable, value):
    clean_env.setenv(variable, value)
    with pytest.raises(ConfigurationError, match=variable):
        load_settings()


@pytest.mark.parametrize("value", ["0", "-2", "nan"])
def test_a_vram_cap_of_zero_never_means_uncapped(clean_env, value):
    clean_env.setenv("SEMIF_VRAM_CAP_GIB", value)
    with pytest.raises(ConfigurationError, match="SEMIF_VRAM_CAP_GIB"):
        load_settings()


@pytest.mark.parametrize("token", ["", "has space", "tök\u00e9n", "tab\there", "new\nline", "\x7fdel"])
def test_a_token_that_is_not_visible_ascii_is_refused_without_echoing_it(clean_env, token):
    clean_env.setenv("SEMIF_API_TOKEN", token)
    settings = load_settings()
    with pytest.raises(ConfigurationError, match="SEMIF_API_TOKEN") as refusal:
        settings.token()
    if token.strip():
        assert token not in str(refusal.value)


def test_a_token_file_loses_its_trailing_newline_and_a_missing_one_is_refused(clean_env, tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    clean_env.setenv("SEMIF_API_TOKEN_FILE", str(path))
    assert load_settings().token() == TOKEN
    clean_env.setenv("SEMIF_API_TOKEN_FILE", str(tmp_path / "absent"))
    with pytest.raises(ConfigurationError, match="SEMIF_API_TOKEN_FILE"):
        load_settings().token()


def test_both_token_variables_at_once_are_refused(clean_env, tmp_path):
    clean_env.setenv("SEMIF_API_TOKEN", TOKEN)
    clean_env.setenv("SEMIF_API_TOKEN_FILE", str(tmp_path / "t"))
    with pytest.raises(ConfigurationError, match="not both"):
        load_settings()


def test_no_token_at_all_is_refused(clean_env):
    with pytest.raises(ConfigurationError, match="SEMIF_API_TOKEN"):
        load_settings().token()


def test_a_failing_warm_up_stops_startup(engine, checkpoint):
    memory = SimulatedMemory()
    memory.fail_next = cuda_oom("")
    settings = make_settings(checkpoint)
    with pytest.raises(DecisionError):
        Service.start(settings, engine=engine.with_options(memory=memory))


def test_a_bad_calibration_file_stops_startup_naming_the_entry(engine, checkpoint, tmp_path):
    from semif_serve.domain.calibration import CalibrationFileError

    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"good": 1.2, "bad": 50}))
    with pytest.raises(CalibrationFileError, match="bad"):
        Service.start(make_settings(checkpoint, calibration=path), engine=engine)


def run_cli(args, env_overrides, timeout=300):  # a cold start on a busy 2-core machine
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEMIF_")}
    env.update(env_overrides)
    return subprocess.run(
        [sys.executable, "-m", "semif_serve.tools.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def base_env(checkpoint) -> dict[str, str]:
    return {
        "SEMIF_MODEL_PATH": str(checkpoint),
        "SEMIF_MODEL_REVISION": DEMO_REVISION,
        "SEMIF_DEVICE": "cpu",
        "SEMIF_API_TOKEN": TOKEN,
        "SEMIF_PORT": "1",
    }


@pytest.mark.parametrize(
    "override,named",
    [
        ({"SEMIF_MAX_ROWS": "0"}, "SEMIF_MAX_ROWS"),
        ({"SEMIF_API_TOKEN": "two words"}, "SEMIF_API_TOKEN"),
        ({"SEMIF_MODEL_REVISION": ""}, "SEMIF_MODEL_REVISION"),
        ({"SEMIF_MODEL_PATH": "/nonexistent/model"}, "SEMIF_MODEL_PATH"),
        ({"SEMIF_CALIBRATION": "/nonexistent/calibration.json"}, "calibration"),
        ({"SEMIF_DEVICE": "tpu"}, "SEMIF_DEVICE"),
    ],
)
def test_invalid_configuration_exits_2_before_binding_naming_the_variable(checkpoint, override, named):
    result = run_cli([], {**base_env(checkpoint), **override})
    assert result.returncode == 2, result.stderr
    assert named in result.stderr
    assert "Uvicorn running" not in result.stderr
    assert "two words" not in result.stderr


def test_a_warm_up_that_fails_exits_3_with_a_clear_line(checkpoint):
    result = run_cli([], {**base_env(checkpoint), "SEMIF_MAX_INPUT_TOKENS": "10"})
    assert result.returncode == 3
    assert "startup failed" in result.stderr


def test_an_incomplete_checkpoint_exits_3(checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    tensors.pop(sorted(tensors)[-1])
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    result = run_cli([], {**base_env(checkpoint), "SEMIF_MODEL_PATH": str(broken)})
    assert result.returncode == 3
    assert "missing_keys" in result.stderr


def test_the_entry_point_forces_offline_before_transformers_is_imported():
    probe = (
        "import os, sys; os.environ['HF_HUB_OFFLINE'] = '0';"
        "import semif_serve.tools.cli as cli; assert 'transformers' not in sys.modules;"
        "cli.main(['env-template']) if False else cli.force_offline();"
        "print(os.environ['HF_HUB_OFFLINE'], os.environ['TRANSFORMERS_OFFLINE'])"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1", "1"]
    source = Path(__import__("semif_serve.tools.cli").tools.cli.__file__).read_text()
    main_body = source.split("def main(", 1)[1]
    assert main_body.index("force_offline()") < main_body.index("import")


def test_the_demo_checkpoint_is_written_offline_and_deterministically(tmp_path):
    first = write_checkpoint(tmp_path / "a")
    second = write_checkpoint(tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        digest = [hashlib.sha256((d / name).read_bytes()).hexdigest() for d in (first, second)]
        assert digest[0] == digest[1], name
    marker = json.loads((first / "DEMO.json").read_text())
    assert marker["random_weights"] is True


def test_the_demo_rebuilds_a_cached_checkpoint_of_another_revision(tmp_path, monkeypatch):
    from semif_serve.tools.cli import ensure_demo_checkpoint

    built = []
    monkeypatch.setattr(
        "semif_serve.tools.demo.write_checkpoint", lambda directory, **kw: built.append((directory, kw))
    )
    (tmp_path / "DEMO.json").write_text(json.dumps({"revision": "demo-random-weights-v2"}))
    ensure_demo_checkpoint(tmp_path)
    assert built == [(tmp_path, {"multimodal": True})]  # the demo has a vision tower
    (tmp_path / "DEMO.json").write_text(json.dumps({"revision": DEMO_REVISION}))
    ensure_demo_checkpoint(tmp_path)
    assert len(built) == 1


def test_a_demo_checkpoint_is_a_demo_everywhere_whatever_the_setting_says(service, client):
    assert service.settings.demo is False and (service.settings.model_path / "DEMO.json").exists()
    assert service.demo is True
    assert client.get("/health").json()["demo"] is True
    assert "demo" in client.post("/decide", json=decision()).json()["model"]
