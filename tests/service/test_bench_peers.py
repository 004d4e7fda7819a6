"""bench/peers.py's pure parts for the `lev-release` peer: the SEMIF_MODELS file it gives
semif-serve reads back as the release with lev's flags, lev's flags are spelled as `lev serve`
takes them, and the requests name the model the peer serves."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import peers
from semif_serve.service.models import LEV, load_models


def test_release_models_file_reads_back_as_the_release_with_levs_options(tmp_path):
    release = tmp_path / "ckpt-lev-release"
    release.mkdir()
    (release / "lev_release.json").write_text(json.dumps({"name": "lev-bench"}))
    models = tmp_path / "models.toml"
    models.write_text(peers.release_models_toml(release, "/models/ckpt"))
    loaded = load_models(models, "Qwen/Qwen3.5-4B@bench")
    entry = loaded.models[peers.LEV_RELEASE]
    assert entry.method == LEV and entry.release == release
    assert dict(entry.lev_options) == peers.LEV_RELEASE_OPTIONS
    assert entry.lev_options["noul_readout"] == "rating"  # lev's reading of a noul with a checkpoint
    assert entry.base_model == "/models/ckpt"
    assert loaded.resolve("local") is entry
    assert loaded.resolve("jev-latest").is_base  # the base is still the base


def test_lev_flags_spell_levs_cli():
    assert peers.lev_flags({"noul_readout": "rating", "prompt_style": "plain"}) == [
        "--noul-readout",
        "rating",
        "--prompt-style",
        "plain",
    ]
    flags = peers.lev_flags(peers.LEV_RELEASE_OPTIONS)
    assert flags[flags.index("--score-order-average") + 1] == "off"


def test_release_sits_beside_the_checkpoint():
    assert peers.release_directory(Path("/work/peers/ckpt")) == Path("/work/peers/ckpt-lev-release")
    recipe = peers.release_recipe(Path("/work/peers/ckpt"))
    assert recipe["rank"] == 32 and recipe["adapter_scale"] == 0.25
    assert {"q_proj", "o_proj", "gate_proj", "down_proj", "in_proj_qkv"} <= set(recipe["target_modules"])


def test_requests_name_the_served_model():
    assert peers.Workload("noul", 5).next()["model"] == "jev-latest"
    body = peers.Workload("eight", 5, peers.LEV_RELEASE).next()
    assert body["model"] == "lev-bench" and len(body["questions"]) == 8
    args = argparse.Namespace(semif_api_dir=None, jev_dir=None, lev_dir=Path("/x"))
    served = {peer.name: peer.served for peer in peers.peers_from(args)}
    assert served == {
        "semif_api": "jev-latest",
        "jev": "jev-latest",
        "lev": "jev-latest",
        "lev-release": "lev-bench",
    }


def test_no_two_workloads_of_one_run_ask_about_the_same_state():
    first = [peers.Workload(name, 5).next()["state"] for name in ("eight", "noul") for _ in range(3)]
    again = [peers.Workload(name, 5).next()["state"] for name in ("eight", "noul") for _ in range(3)]
    assert len(set(first + again)) == 12


def test_the_defaults_setting_pins_no_thread_count_and_a_number_pins_every_server(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the caller's own pin never reaches a server
    assert peers.parse_settings("defaults, 1,2") == [None, 1, 2]
    defaults = peers._peer_env({}, None)
    assert "OMP_NUM_THREADS" not in defaults and "MKL_NUM_THREADS" not in defaults
    assert peers._peer_env({}, 1)["OMP_NUM_THREADS"] == peers._peer_env({}, 1)["MKL_NUM_THREADS"] == "1"
    assert peers.thread_env(None) == {}
