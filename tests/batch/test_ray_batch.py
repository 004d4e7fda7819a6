"""`semif-serve run-batch --ray` on the Ray it starts for itself (no address given): two actors,
each with its own engine, write the lines the local run writes (images, the lev release and
refusals included); every socket of every Ray process, the driver's own included, is on
127.0.0.1, whatever the machine's network address; the session lives in a fresh directory that
is gone after the run, with no process left and nothing written to the user's home."""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
import tempfile
from contextlib import nullcontext
from pathlib import Path

import psutil
import pytest

from semif_serve.batch.job import BatchFiles
from semif_serve.batch.runner import Pacing
from semif_serve.service.startup import Service
from tests.support.batch import (
    LIMITS,
    UNROUTED,
    answered_lines,
    assert_same_results,
    batch_file,
    refused_lines,
    results,
    score_file,
)
from tests.support.polling import wait_until

pytest.importorskip("ray")


def addresses_of(process: psutil.Process) -> tuple[set[str], set[str]]:
    """The addresses `process` listens on, and those it is connected to (its own side and the far one)."""
    listening, connected = set(), set()
    for connection in process.net_connections(kind="inet"):
        if connection.status == psutil.CONN_LISTEN:
            listening.add(connection.laddr.ip)
        elif connection.raddr:
            connected.update((connection.laddr.ip, connection.raddr.ip))
    return listening, connected


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def watch(process: subprocess.Popen, timeout: float) -> dict:
    """Until `process` ends: every descendant's pid, command line, listening and connected addresses."""
    seen: dict = {"pids": set(), "commands": [], "listening": set(), "connected": set()}
    root = psutil.Process(process.pid)

    def ended() -> bool:
        try:
            children = [root, *root.children(recursive=True)]
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            children = []
        for child in children:
            try:  # each on its own: one that ended between two looks must not hide the others
                # read at every look: a child caught between fork and exec still shows its parent's command
                command = " ".join(child.cmdline())
                seen["pids"].add(child.pid)
                if command not in seen["commands"]:
                    seen["commands"].append(command)
                listening, connected = addresses_of(child)
                seen["listening"] |= listening
                seen["connected"] |= connected
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue
        return process.poll() is not None

    wait_until(ended, timeout=timeout, what="the Ray batch to finish", every=0.2)
    return seen


def test_two_ray_actors_on_a_loopback_ray_of_their_own_write_the_lines_of_the_local_run(
    batch_env, batch_settings, vision_engine, tmp_path
):
    lines = answered_lines() + refused_lines() + [text for text, _, _ in UNROUTED]
    source = batch_file(tmp_path / "in.jsonl", lines)
    local = tmp_path / "local.jsonl"
    service = Service.start(batch_settings, engine=vision_engine)
    files = BatchFiles(str(source), str(local))
    score_file(lambda: nullcontext(service), files, Pacing(), max_body_bytes=LIMITS["max_body_bytes"])

    out = tmp_path / "ray.jsonl"
    temp = Path(tempfile.mkdtemp(prefix="rb-", dir="/tmp"))  # short: Ray's socket paths are capped
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in batch_env.items() if not k.startswith("RAY_")}
    env.update(TMPDIR=str(temp), HOME=str(home))
    command = ["semif-serve", "run-batch", "-i", str(source), "-o", str(out), "--ray"]
    command += ["--num-actors", "2", "--ray-batch-size", "6", "--progress", "plain"]
    log = tmp_path / "stderr.log"
    process = None
    try:
        with log.open("w") as stderr_file:
            process = subprocess.Popen(command, env=env, stderr=stderr_file, start_new_session=True)
            seen = watch(process, timeout=600)
        stderr = log.read_text()
        assert process.returncode == 0, stderr[-3000:]
        assert f"{len(lines)} lines, 0 already in the output" in stderr
        assert_same_results(results(out), results(local))

        assert any("gcs_server" in command for command in seen["commands"]), seen["commands"]
        assert seen["listening"], "no Ray socket was seen"
        assert all(is_loopback(address) for address in seen["listening"] | seen["connected"]), seen
        assert any(f"{temp}/semif-ray-" in command for command in seen["commands"])  # its own directory
        assert list(temp.iterdir()) == [], "the Ray session's directory was left behind"
        assert not (home / ".ray").exists(), "a token was written to the user's home"
        wait_until(
            lambda: not any(psutil.pid_exists(pid) for pid in seen["pids"]), 60, "every Ray process to end"
        )
    finally:
        if process is not None and process.poll() is None:
            process.kill()
        shutil.rmtree(temp, ignore_errors=True)
