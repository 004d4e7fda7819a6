"""run-batch against the service itself: every line's result equals what a running service
(`semif-serve serve` in a child process, uvicorn on loopback) answers for that body (images and
the demo's lev release included; numbers within 1e-6); and `semif-serve run-batch` in a child
process killed by SIGKILL, run again and interrupted by SIGINT, then run again with the same
command, ends with the output an uninterrupted run writes."""

from __future__ import annotations

import io
import json
import signal
import subprocess
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from semif_serve.batch.job import BatchFiles
from semif_serve.batch.runner import Pacing
from semif_serve.service.startup import Service
from tests.docs.test_readme import free_port, stop, wait_ready
from tests.support import TOKEN
from tests.support.batch import (
    STATES,
    UNROUTED,
    answered_lines,
    assert_close,
    assert_same_results,
    batch_file,
    comparable,
    decide,
    line,
    refused_lines,
    results,
    run_batch,
    score_file,
)
from tests.support.polling import wait_until


@pytest.fixture(scope="module")
def service_url(batch_env, tmp_path_factory):
    """The service with the batch's settings: `semif-serve serve` on a loopback port."""
    port = free_port()
    env = {**batch_env, "SEMIF_HOST": "127.0.0.1", "SEMIF_PORT": str(port)}
    log = (tmp_path_factory.mktemp("service") / "service.log").open("w")
    process = subprocess.Popen(
        ["semif-serve", "serve"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process)
        yield url
    finally:
        stop(process)
        log.close()


def body_bytes(text: str) -> bytes:
    """The body of a line as the line holds it (`line` writes it last), byte for byte."""
    return text[text.index('"body": ') + len('"body": ') : -1].encode()


def without_messages(body):
    """An error body without its prose (the batch says why a line never reached a route)."""
    if isinstance(body, dict):
        return {k: without_messages(v) for k, v in body.items() if k not in ("message", "msg")}
    if isinstance(body, list):
        return [without_messages(v) for v in body]
    return body


@pytest.fixture(scope="module")
def batch_service(batch_settings, vision_engine) -> Service:
    """The service the batch starts, started here (over the session's engine) with the same settings."""
    return Service.start(batch_settings, engine=vision_engine)


def test_every_line_is_answered_as_the_running_service_answers_its_body(service_url, batch_service, tmp_path):
    routed = answered_lines() + refused_lines()
    source = batch_file(tmp_path / "in.jsonl", routed + [text for text, _, _ in UNROUTED])
    out = tmp_path / "out.jsonl"
    stderr = io.StringIO()
    score_file(lambda: nullcontext(batch_service), BatchFiles(str(source), str(out)), Pacing(), stderr)
    got = results(out)
    assert len(got) == len(routed) + len(UNROUTED)
    assert [r["custom_id"] for r in got[: len(routed)]] == [json.loads(t)["custom_id"] for t in routed]

    answered = 0
    with httpx.Client(base_url=service_url, timeout=120) as client:
        for text, result in zip(routed, got, strict=False):
            envelope = json.loads(text)
            response = result["response"]
            reply = client.post(
                envelope["url"],
                content=body_bytes(text),
                headers={
                    "Authorization": f"Bearer {TOKEN}",
                    "Content-Type": "application/json",
                    "X-Request-ID": response["request_id"],
                },
            )
            where = envelope["custom_id"]
            assert response["status_code"] == reply.status_code, (where, response, reply.text)
            assert_close(comparable(response["body"]), comparable(reply.json()), where)
            assert result["error"] == (None if reply.status_code == 200 else response["body"]), where
            answered += reply.status_code == 200
        for (_, path, body), result in zip(UNROUTED, got[len(routed) :], strict=True):
            response = result["response"]
            headers = {"Authorization": f"Bearer {TOKEN}", "X-Request-ID": response["request_id"]}
            if body is None:
                reply = client.get(path, headers=headers)
            else:
                reply = client.post(path, content=body, headers=headers)
            assert response["status_code"] == reply.status_code, (path, response, reply.text)
            assert without_messages(response["body"]) == without_messages(reply.json()), path
            assert result["error"] == response["body"]
    assert answered == len(answered_lines())
    refused = len(got) - answered
    assert f"{answered} answered, {refused} refused" in stderr.getvalue()


# -- killed, then run again -------------------------------------------------------------------

KILL_LINES = 64


@pytest.fixture(scope="module")
def long_file(tmp_path_factory) -> Path:
    """Enough lines that a run is still going when it is killed (states repeat, in groups)."""
    lines = [
        line(f"k{i}", "/decide", decide(f"{STATES[i % 3]} Ticket {i // 4}.", f"Question {i}?", i))
        for i in range(KILL_LINES)
    ]
    return batch_file(tmp_path_factory.mktemp("kill") / "in.jsonl", lines)


@pytest.fixture(scope="module")
def uninterrupted(long_file, batch_service, tmp_path_factory) -> list[dict]:
    """The file scored in one go (in this process, over the same settings)."""
    service = batch_service
    out = tmp_path_factory.mktemp("whole") / "out.jsonl"
    score_file(lambda: nullcontext(service), BatchFiles(str(long_file), str(out)), Pacing(window=8))
    return results(out)


ARGS = ("--window", "4", "--concurrency", "2", "--progress", "plain")


def killed_midway(env: dict, source: Path, out: Path, sig: int, after: int) -> subprocess.CompletedProcess:
    """Start the batch, send `sig` once `after` lines of the output are written, wait for its end."""
    # A suite started in the background (`pytest &`) ignores SIGINT, and a child inherits that.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process = subprocess.Popen(
            ["semif-serve", "run-batch", "-i", str(source), "-o", str(out), *ARGS],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        signal.signal(signal.SIGINT, previous)

    def written() -> bool:
        assert process.poll() is None, process.communicate()
        return out.exists() and out.read_bytes().count(b"\n") >= after

    wait_until(written, timeout=180, what=f"{after} lines written", every=0.005)
    process.send_signal(sig)
    stdout, stderr = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@dataclass
class Continued:
    """One output through three runs of the same command (see `continued`)."""

    out: Path
    killed: subprocess.CompletedProcess
    kept_after_kill: int
    interrupted: subprocess.CompletedProcess
    kept_after_interrupt: int
    whole_lines_after_interrupt: bool
    finishing: subprocess.CompletedProcess
    finishing_pid: int
    second: subprocess.CompletedProcess
    lock_left: bool


@pytest.fixture(scope="module")
def continued(batch_env, long_file, tmp_path_factory) -> Continued:
    """A run killed by SIGKILL, one interrupted by SIGINT, then the run that finishes the output,
    with a second run started on the same output while that one holds its lock.

    One set of children serves both tests (each child imports torch and loads the model).
    """
    out = tmp_path_factory.mktemp("continued") / "out.jsonl"
    lock = out.with_name(out.name + ".lock")
    killed = killed_midway(batch_env, long_file, out, signal.SIGKILL, after=8)
    kept_after_kill = out.read_bytes().count(b"\n")
    interrupted = killed_midway(batch_env, long_file, out, signal.SIGINT, after=kept_after_kill + 8)
    kept_after_interrupt = out.read_bytes().count(b"\n")
    whole_lines_after_interrupt = out.read_bytes().endswith(b"\n")
    finishing = subprocess.Popen(
        ["semif-serve", "run-batch", "-i", str(long_file), "-o", str(out), *ARGS],
        env=batch_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def locked() -> bool:
            assert finishing.poll() is None, finishing.communicate()
            return lock.exists() and lock.read_text() == f"run-batch pid {finishing.pid}\n"

        wait_until(locked, timeout=60, what="the finishing run's lock")  # taken before its model loads
        second = run_batch(batch_env, "-i", str(long_file), "-o", str(out), *ARGS)
        stdout, stderr = finishing.communicate(timeout=300)
    finally:
        if finishing.poll() is None:
            finishing.kill()
    return Continued(
        out=out,
        killed=killed,
        kept_after_kill=kept_after_kill,
        interrupted=interrupted,
        kept_after_interrupt=kept_after_interrupt,
        whole_lines_after_interrupt=whole_lines_after_interrupt,
        finishing=subprocess.CompletedProcess(finishing.args, finishing.returncode, stdout, stderr),
        finishing_pid=finishing.pid,
        second=second,
        lock_left=lock.exists(),
    )


def test_a_run_killed_by_sigkill_then_by_sigint_continues_to_the_uninterrupted_output(
    continued: Continued, uninterrupted
):
    assert continued.killed.returncode == -signal.SIGKILL
    kept = continued.kept_after_kill
    assert 8 <= kept < KILL_LINES, "the kill came after the run had finished"

    interrupted = continued.interrupted
    assert interrupted.returncode == 130, interrupted.stderr
    assert f"{KILL_LINES} lines, {kept} already in the output" in interrupted.stderr
    assert "the same command continues" in interrupted.stderr
    assert continued.whole_lines_after_interrupt, "an interrupted run writes whole lines"
    kept = continued.kept_after_interrupt
    assert kept < KILL_LINES, "the interrupt came after the run had finished"

    again = continued.finishing
    assert again.returncode == 0, again.stderr
    assert f"{KILL_LINES} lines, {kept} already in the output" in again.stderr
    assert_same_results(results(continued.out), uninterrupted)


def test_a_second_run_on_the_same_output_is_refused_naming_the_first(continued: Continued, uninterrupted):
    out, lock = continued.out, continued.out.with_name(continued.out.name + ".lock")
    second = continued.second
    assert second.returncode == 2, second.stderr
    first = continued.finishing_pid
    assert f"-o {out} is being written by another run-batch (pid {first}, lock {lock})" in second.stderr
    assert continued.finishing.returncode == 0, continued.finishing.stderr
    assert out.read_bytes().count(b"\n") == KILL_LINES  # each line once, not twice
    assert_same_results(results(out), uninterrupted)
    assert not continued.lock_left
