"""A lev release of SEMIF_MODELS is read at startup over the loaded base; one the service cannot
read exactly stops startup, naming the SEMIF_MODELS file and key and the release's file and key."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from semif_serve.domain.types import ConfigurationError
from semif_serve.service.startup import Service
from semif_serve.tools.lev_builder import write_lev_release
from tests.support import make_settings


@pytest.fixture(scope="module")
def release(checkpoint, tmp_path_factory):
    return write_lev_release(tmp_path_factory.mktemp("lev-startup") / "release", checkpoint, seed=5)


def start(engine, checkpoint, tmp_path, entry: str):
    models = tmp_path / "models.toml"
    models.write_text(f'[models.lev-tiny]\n{entry}\n[aliases]\nlocal = "lev-tiny"\n')
    return Service.start(make_settings(checkpoint, models=models), engine=engine), models


def copy_of(release, tmp_path):
    target = tmp_path / "broken"
    shutil.copytree(release, target)
    return target


def edit_json(path, **updates):
    path.write_text(json.dumps({**json.loads(path.read_text()), **updates}))


def test_a_release_is_served_by_its_name_with_the_manifests_options(engine, checkpoint, tmp_path, release):
    service, _ = start(engine, checkpoint, tmp_path, f'release = "{release}"')
    served = service.methods["lev"].releases["lev-tiny"]
    assert served.options.prompt_style == "plain" and served.adapter_scale == 0.25
    assert service.models.resolve("local").method is service.methods["lev"]


def test_a_releases_adapter_is_held_once_by_the_engines_bank_and_counted_there(
    engine, checkpoint, tmp_path, release
):
    from safetensors import safe_open

    service, _ = start(engine, checkpoint, tmp_path, f'release = "{release}"')
    served = service.methods["lev"].releases["lev-tiny"]
    assert served.adapter == service.engine.adapters.index("lev-tiny")  # the release is an entry of the bank
    assert service.models.resolve("lev-tiny").adapter == served.adapter  # a request reads that entry
    with safe_open(str(release / "adapter_model.safetensors"), framework="pt") as saved:
        saved_bytes = sum(saved.get_tensor(k).numel() for k in saved.keys()) * 4  # float32 on the CPU
    assert service.engine.adapters.nbytes == saved_bytes
    assert service.engine.adapters.index("lev-tiny") >= 0


def test_a_release_for_another_base_stops_startup_naming_both_files_and_keys(
    engine, checkpoint, tmp_path, release
):
    broken = copy_of(release, tmp_path)
    edit_json(broken / "lev_release.json", base_model="Qwen/Qwen3-8B")
    edit_json(broken / "adapter_config.json", base_model_name_or_path="Qwen/Qwen3-8B")
    with pytest.raises(ConfigurationError) as caught:
        start(engine, checkpoint, tmp_path, f'release = "{broken}"')
    models = tmp_path / "models.toml"
    assert str(caught.value).startswith(
        f"SEMIF_MODELS: {models}: models.lev-tiny.release: {broken / 'lev_release.json'}: base_model: "
        "the release is for 'Qwen/Qwen3-8B'"
    )


def test_a_base_the_operator_vouches_for_is_accepted(engine, checkpoint, tmp_path, release):
    other = copy_of(release, tmp_path)
    edit_json(other / "lev_release.json", base_model="my-org/qwen35-4b-mirror")
    edit_json(other / "adapter_config.json", base_model_name_or_path="my-org/qwen35-4b-mirror")
    service, _ = start(
        engine, checkpoint, tmp_path, f'release = "{other}"\nbase_model = "my-org/qwen35-4b-mirror"'
    )
    assert "lev-tiny" in service.methods["lev"].releases


def test_an_adapter_tensor_the_base_cannot_take_names_the_tensor(engine, checkpoint, tmp_path, release):
    from safetensors.torch import load_file, save_file

    broken = copy_of(release, tmp_path)
    weights = broken / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    key = next(k for k in sorted(tensors) if k.endswith("q_proj.lora_A.weight"))
    tensors[key] = torch.zeros(4, 7)
    save_file(tensors, str(weights))
    with pytest.raises(
        ConfigurationError, match=rf"models\.lev-tiny\.release: {re.escape(str(weights))}: {key}: shape"
    ):
        start(engine, checkpoint, tmp_path, f'release = "{broken}"')


def test_an_entry_option_contradicting_the_manifest_names_the_entrys_key(
    engine, checkpoint, tmp_path, release
):
    with pytest.raises(ConfigurationError) as caught:
        start(engine, checkpoint, tmp_path, f'release = "{release}"\nprompt_style = "chat"')
    assert str(caught.value) == (
        f"SEMIF_MODELS: {tmp_path / 'models.toml'}: models.lev-tiny.prompt_style: 'chat' contradicts "
        "lev_release.json prompt_style 'plain'"
    )


def test_a_missing_calibration_the_manifest_promises_names_the_manifest_key(
    engine, checkpoint, tmp_path, release
):
    broken = copy_of(release, tmp_path)
    (broken / "calibration.json").unlink()
    manifest = json.loads((broken / "lev_release.json").read_text())
    edit_json(broken / "lev_release.json", files=[f for f in manifest["files"] if f != "calibration.json"])
    with pytest.raises(
        ConfigurationError, match=r"models\.lev-tiny\.release: .*lev_release\.json: calibrated: is true"
    ):
        start(engine, checkpoint, tmp_path, f'release = "{broken}"')


def test_the_demo_serves_a_lev_release_beside_the_base_built_once(engine, checkpoint, tmp_path):
    from semif_serve.tools.cli import demo_banner
    from semif_serve.tools.demo import ensure_demo_models

    base = tmp_path / "demo-model"
    shutil.copytree(checkpoint, base)
    models = ensure_demo_models(base)
    assert models.parent == tmp_path / "demo-model-lev" and not (base / "lev-demo").exists()
    built = (models.parent / "lev-demo" / "lev_release.json").stat().st_mtime_ns
    assert ensure_demo_models(base) == models
    assert (models.parent / "lev-demo" / "lev_release.json").stat().st_mtime_ns == built  # not rebuilt
    service = Service.start(make_settings(base, models=models), engine=engine)
    assert list(service.methods["lev"].releases) == ["lev-demo"]
    assert service.models.resolve("local").name == "lev-demo"
    assert "'lev-demo' (a random lev-format release, alias 'local')" in demo_banner("h", 1, None, "lev-demo")


@pytest.mark.parametrize("cap", ["0", "true", '"2"'])
def test_a_label_cap_that_is_not_a_positive_integer_names_its_key(engine, checkpoint, tmp_path, release, cap):
    with pytest.raises(
        ConfigurationError, match=r"models\.lev-tiny\.max_label_options: must be an integer >= 1"
    ):
        start(engine, checkpoint, tmp_path, f'release = "{release}"\nmax_label_options = {cap}')
