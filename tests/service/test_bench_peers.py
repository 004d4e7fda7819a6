"""bench/peers.py's own parts: the SEMIF_MODELS files it gives semif-serve for `lev-release`
and `lev-base` read back as the entries they mean, with lev's flags; lev's flags are spelled
as `lev serve` takes them; the requests name the model the peer serves; the concurrent
clients keep exactly N requests in flight, each sending its next one only after its answer;
servers taking turns on the CPU are never continued between two others' turns."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from bench import peers
from harness.server import LoopbackServer
from semif_serve.service.methods import MethodRegistry
from semif_serve.service.methods.lev import LevMethod
from semif_serve.service.models import load_models

# lev's `off` is the one vocabulary's `none`: the entry keeps the normalised name.
NORMALISED = {"score_order_average": "none"}


def test_release_models_file_reads_back_as_the_release_with_levs_options(tmp_path):
    release = tmp_path / "ckpt-lev-release"
    release.mkdir()
    (release / "lev_release.json").write_text(json.dumps({"name": "lev-bench"}))
    models = tmp_path / "models.toml"
    models.write_text(peers.release_models_toml(release, "/models/ckpt"))
    loaded = load_models(models, "Qwen/Qwen3.5-4B@bench", MethodRegistry.of())
    entry = loaded.models[peers.LEV_RELEASE]
    assert entry.method == LevMethod.name and entry.directory == release
    assert dict(entry.options) == {**peers.LEV_RELEASE_OPTIONS, **NORMALISED}
    assert entry.options["noul_readout"] == "rating"  # lev's reading of a noul with a checkpoint
    assert entry.base_model == "/models/ckpt"
    assert loaded.resolve("local") is entry
    assert loaded.is_base(loaded.resolve("jev-latest"))  # the base is still the base


def test_lev_base_models_file_reads_back_as_the_base_with_levs_method_and_frozen_flags(tmp_path):
    models = tmp_path / "models.toml"
    models.write_text(peers.lev_base_models_toml())
    loaded = load_models(models, "Qwen/Qwen3.5-4B@bench", MethodRegistry.of())
    entry = loaded.resolve(peers.LEV_BASE)
    assert entry.method == LevMethod.name and not loaded.is_base(entry)
    assert entry.directory is None  # no release, no adapter: the frozen base's weights alone
    assert dict(entry.options) == {**peers.LEV_BASE_OPTIONS, **NORMALISED}
    assert entry.options["noul_readout"] == "binary"  # lev's reading of a noul without a checkpoint
    assert loaded.is_base(loaded.resolve("jev-latest"))


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
        "lev-base": "lev-base",
        "lev-release": "lev-bench",
    }
    concurrent = [peer.name for peer in peers.peers_from(args) if peer.concurrent]
    assert concurrent == ["lev-release"]


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


class _InFlight:
    """An ASGI app answering /v1/systemone after a short sleep, counting requests in flight."""

    def __init__(self) -> None:
        self.now = self.most = self.answered = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        self.now += 1
        self.most = max(self.most, self.now)
        await asyncio.sleep(0.01)
        self.now -= 1
        self.answered += 1
        body = json.dumps({"usage": {"input_tokens": 7}}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})


def test_concurrent_clients_keep_n_in_flight_and_send_exactly_the_requests_asked():
    app = _InFlight()
    with LoopbackServer(app) as server:
        cell = peers.measure_clients(server.url, {}, peers.Workload("noul", 0), 16, 80, budget=60.0)
    assert cell["requests"] == app.answered == 80
    assert app.most == 16  # 16 clients, never a 17th request before an answer
    assert cell["clients"] == 16 and cell["input_tokens"] == 7 and len(cell["latencies"]) == 80


def process_state(pid: int) -> str:
    """R, S, T...: the state letter /proc gives the process."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def wait_for_state(pid: int, state: str, deadline_s: float = 10.0) -> str:
    """The process's state once it is `state`, or whatever it is at the deadline."""
    deadline = time.monotonic() + deadline_s
    while process_state(pid) != state and time.monotonic() < deadline:
        time.sleep(0.01)
    return process_state(pid)


def test_servers_taking_turns_stay_stopped_between_others_turns_and_all_run_after(monkeypatch):
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    a, b, c = (p.pid for p in sleepers)
    continued: list[int] = []
    real_kill = os.kill

    def kill(pid: int, sig: int) -> None:
        if sig == signal.SIGCONT:
            continued.append(pid)
        real_kill(pid, sig)

    monkeypatch.setattr(peers.os, "kill", kill)
    try:
        with peers.TakingTurns([a, b, c]) as turns:
            turns.turn(a)
            assert [wait_for_state(pid, "T") for pid in (b, c)] == ["T", "T"]
            assert wait_for_state(a, "S") == "S"
            turns.turn(b)
            assert [wait_for_state(pid, "T") for pid in (a, c)] == ["T", "T"]
            assert wait_for_state(b, "S") == "S"
            assert continued == [a, b]  # c was never continued for a moment between the two turns
        assert [wait_for_state(pid, "S") for pid in (a, b, c)] == ["S", "S", "S"]
    finally:
        for p in sleepers:
            p.kill()
            p.wait()
