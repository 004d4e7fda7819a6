"""`semif-serve run-batch --ray` on a real local Ray cluster this test starts (`ray start --head`
on 127.0.0.1, two CPUs, a small object store): two actors, each with its own engine, write the
lines the local run writes (images, the lev release and refusals included)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import pytest

from semif_serve.batch.job import BatchFiles, score_file
from semif_serve.batch.runner import Pacing
from semif_serve.service.startup import Service
from tests.docs.test_readme import free_port, stop
from tests.support.batch import (
    UNROUTED,
    answered_lines,
    assert_same_results,
    batch_file,
    refused_lines,
    results,
    run_batch,
)

pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_address(batch_env):
    """A Ray head on loopback in its own session (stopped by its process group), in a short
    temporary directory (Ray's socket paths must stay short)."""
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    port = free_port()
    log = (temp / "head.log").open("w")
    command = [
        "ray",
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        "--num-cpus=2",
        "--include-dashboard=false",
        "--object-store-memory=200000000",
        f"--temp-dir={temp}",
        "--disable-usage-stats",
    ]
    process = subprocess.Popen(
        command, env=batch_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in (temp / "head.log").read_text():
            assert process.poll() is None, (temp / "head.log").read_text()
            assert time.monotonic() < deadline, "the Ray head did not start"
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        stop(process, grace=5)  # the head takes ~35 s to stop itself here; its group is killed after 5
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def test_two_ray_actors_write_the_lines_of_the_local_run(
    ray_address, batch_env, batch_settings, vision_engine, tmp_path
):
    lines = answered_lines() + refused_lines() + [text for text, _, _ in UNROUTED]
    source = batch_file(tmp_path / "in.jsonl", lines)
    local = tmp_path / "local.jsonl"
    service = Service.start(batch_settings, engine=vision_engine)
    score_file(lambda: nullcontext(service), BatchFiles(str(source), str(local)), Pacing())

    out = tmp_path / "ray.jsonl"
    args = ("--ray", "--ray-address", ray_address, "--num-actors", "2", "--ray-batch-size", "6")
    on_ray = run_batch(batch_env, "-i", str(source), "-o", str(out), *args)
    assert on_ray.returncode == 0, on_ray.stderr[-3000:]
    assert f"{len(lines)} lines, 0 already in the output" in on_ray.stderr
    assert_same_results(results(out), results(local))
