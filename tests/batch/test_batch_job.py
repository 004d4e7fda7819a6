"""The batch job in this process, over the real app on the demo's checkpoint: a repeated custom_id
refuses the file before the service starts, a half-written last line is cut and its line scored
again, stdin and stdout work, pacing never goes past SEMIF_MAX_QUEUE (no line is answered 429
because of the batch), a window's lines about one state are sent together, and what a person
watching sees (the bar, the plain lines, the summary)."""

from __future__ import annotations

import io
import json
import os
import pty
import subprocess
import sys
from collections import Counter
from contextlib import nullcontext
from types import SimpleNamespace

import httpx
import pytest

from semif_serve.batch.job import BatchFiles
from semif_serve.batch.lines import DuplicateCustomId, parse_line
from semif_serve.batch.progress import Progress, Summary
from semif_serve.batch.runner import MAX_RETRY_WAIT_SECONDS, Pacing, grouped, retry_after
from semif_serve.service.startup import Service
from tests.support import make_settings
from tests.support.batch import (
    LIMITS,
    STATES,
    answered_lines,
    assert_same_results,
    batch_file,
    decide,
    line,
    refused_lines,
    results,
    run_batch,
    score_file,
)


@pytest.fixture(scope="module")
def service(batch_settings, vision_engine) -> Service:
    return Service.start(batch_settings, engine=vision_engine)


def score(service: Service, source, out, pacing: Pacing | None = None, stream=None):
    stream = stream or io.StringIO()
    files = BatchFiles(str(source), str(out))
    return score_file(lambda: nullcontext(service), files, pacing or Pacing(), stream)


def never_started():
    raise AssertionError("the service was started for a file that is refused")


def test_a_repeated_custom_id_refuses_the_file_before_the_service_starts(tmp_path):
    lines = answered_lines()[:4]
    repeated = lines[1].replace('"custom_id": "s1-0"', '"custom_id": "native-0-a"')
    source = batch_file(tmp_path / "in.jsonl", [*lines, repeated])
    out = tmp_path / "out.jsonl"
    with pytest.raises(DuplicateCustomId) as refused:
        score_file(never_started, BatchFiles(str(source), str(out)), Pacing())
    assert str(refused.value) == "custom_id 'native-0-a' is on line 1 and again on line 5"
    assert not out.exists()


def test_the_command_refuses_a_repeated_custom_id_naming_both_lines(tmp_path, batch_env):
    source = batch_file(tmp_path / "in.jsonl", [answered_lines()[0], "", answered_lines()[0]])
    refused = run_batch(batch_env, "-i", str(source), "-o", str(tmp_path / "out.jsonl"))
    assert refused.returncode == 2
    assert "custom_id 'native-0-a' is on line 1 and again on line 3; nothing was scored" in refused.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_a_half_written_last_line_is_cut_and_its_line_scored_again(service, tmp_path):
    source = batch_file(tmp_path / "in.jsonl", answered_lines() + refused_lines())
    whole = tmp_path / "whole.jsonl"
    score(service, source, whole)
    data = whole.read_bytes()
    cut = [i for i, byte in enumerate(data) if byte == ord("\n")][5] + 40  # 6 lines and a part
    resumed = tmp_path / "resumed.jsonl"
    resumed.write_bytes(data[:cut])
    stream = io.StringIO()
    summary = score(service, source, resumed, stream=stream)
    assert summary.skipped == 6 and summary.done == summary.lines - 6
    assert_same_results(results(resumed), results(whole))
    assert f"{summary.lines} lines, 6 already in the output" in stream.getvalue()
    finished = score_file(never_started, BatchFiles(str(source), str(resumed)), Pacing(), io.StringIO())
    assert finished.skipped == finished.lines == summary.lines  # run again: nothing to load
    assert_same_results(results(resumed), results(whole))


def test_stdin_to_stdout(service, tmp_path, monkeypatch):
    text = "".join(f"{t}\n" for t in answered_lines()[:3])
    stdout = io.BytesIO()
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(buffer=io.BytesIO(text.encode())))
    monkeypatch.setattr(sys, "stdout", SimpleNamespace(buffer=stdout))
    score(service, "-", "-")
    monkeypatch.undo()
    file_out = tmp_path / "out.jsonl"
    score(service, batch_file(tmp_path / "in.jsonl", answered_lines()[:3]), file_out)
    got = [json.loads(t) for t in stdout.getvalue().decode().splitlines()]
    assert_same_results(got, results(file_out))


def test_pacing_is_held_to_the_queue_cap_so_no_line_is_answered_busy(demo_models, vision_engine, tmp_path):
    checkpoint, models = demo_models
    narrow = Service.start(
        make_settings(checkpoint, models=models, dtype="float32", max_queue=2, **LIMITS), engine=vision_engine
    )
    lines = [
        line(f"c{i}", "/decide", decide(f"{STATES[i % 3]} Case {i}.", "Is it fixed?", i)) for i in range(40)
    ]
    out = tmp_path / "out.jsonl"
    summary = score(narrow, batch_file(tmp_path / "in.jsonl", lines), out, Pacing(window=40, concurrency=64))
    statuses = Counter(r["response"]["status_code"] for r in results(out))
    assert statuses == {200: 40}, statuses
    assert Pacing(concurrency=64).in_flight(2) == 2
    assert summary.answered == 40


def test_a_windows_lines_about_one_state_are_sent_together_in_order_of_first_line():
    texts = [
        line("a1", "/decide", decide("alpha", "Q1?")),
        line("b1", "/decide", decide("beta", "Q2?")),
        line("a2", "/decide", decide("alpha", "Q3?")),
        line("s1", "/v1/systemone", {"model": "m", "state": "alpha", "questions": {}}),
        line("b2", "/decide", decide("beta", "Q4?")),
        line("s2", "/v1/systemone", {"model": "m", "state": "alpha", "questions": {}}),
    ]
    window = [parse_line(n, t.encode()) for n, t in enumerate(texts, start=1)]
    assert [w.custom_id for w in grouped(window)] == ["a1", "a2", "b1", "b2", "s1", "s2"]


def result_of(status: int, body) -> dict:
    return {"response": {"status_code": status, "body": body}, "error": None if status == 200 else body}


RESULTS = [
    result_of(200, {"answers": {}}),
    result_of(422, {"detail": [{"loc": ["body"], "msg": "m", "type": "missing"}]}),
    result_of(413, {"error": {"code": "body_too_large", "message": "m"}}),
    result_of(404, {"detail": {"error_type": "not_found", "message": "m"}}),
    result_of(200, {"answers": {}}),
]


def test_off_a_terminal_a_plain_line_every_few_seconds_and_the_summary(monkeypatch):
    clock = iter([0.0, 1.0, 6.0, 7.0, 13.0, 14.0, 15.0])
    monkeypatch.setattr("semif_serve.batch.progress.time.monotonic", lambda: next(clock))
    stream = io.StringIO()
    progress = Progress(Summary(lines=7, skipped=2), stream, every=5.0, bar=False)
    for result in RESULTS:
        progress(result)
    summary = progress.close()
    shown = stream.getvalue().splitlines()
    assert shown[0] == "run-batch: 2/5 lines (40%), 0.33 lines/s, about 9 s left"
    assert shown[1] == "run-batch: 4/5 lines (80%), 0.31 lines/s, about 3 s left"
    assert shown[2] == (
        "run-batch: 7 lines, 2 already in the output, 2 answered, 3 refused "
        "(404 not_found: 1, 413 body_too_large: 1, 422 missing: 1); 15.0 s (0.33 lines/s)"
    )
    assert summary.answered == 2 and sum(summary.refused.values()) == 3


def test_on_a_terminal_a_tqdm_bar_with_lines_rate_and_time_left():
    stream = io.StringIO()
    progress = Progress(Summary(lines=5, skipped=0), stream, bar=True)
    for result in RESULTS:
        progress(result)
    progress.close()
    text = stream.getvalue()
    assert "5/5" in text and "line/s" in text and "<00:00" in text
    assert "run-batch: 5 lines, 0 already in the output, 2 answered, 3 refused" in text


def test_the_bar_is_chosen_by_whether_stderr_is_a_terminal(tmp_path):
    script = (
        "import sys; from semif_serve.batch.progress import Progress, Summary; "
        "p = Progress(Summary(lines=1, skipped=0), sys.stderr); print(p.bar is not None)"
    )
    terminal, other_end = pty.openpty()
    try:
        for stderr, bar in ((subprocess.DEVNULL, b"False"), (other_end, b"True")):
            shown = subprocess.run([sys.executable, "-c", script], stderr=stderr, stdout=subprocess.PIPE)
            assert shown.stdout.strip() == bar
    finally:
        os.close(terminal)
        os.close(other_end)


def test_a_refusal_that_asks_for_a_retry_is_retried_after_the_delay_it_names():
    assert retry_after(httpx.Response(503, headers={"Retry-After": "1"})) == 1.0  # out of memory, released
    assert retry_after(httpx.Response(429, headers={"Retry-After": "600"})) == MAX_RETRY_WAIT_SECONDS
    assert retry_after(httpx.Response(503)) is None
    assert retry_after(httpx.Response(422, headers={"Retry-After": "1"})) is None
