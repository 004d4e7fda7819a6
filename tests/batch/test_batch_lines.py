"""Hostile lines through the batch in this process, over the real app on the demo's checkpoint: a
line nested too deep for Python's decoder keeps its custom_id and gets the route's own depth
refusal, a line past the body limit is refused 413 from its length with its custom_id, a broken
line keeps the custom_id read before the break, and a custom_id that is not valid Unicode is
written escaped, so every output byte is UTF-8. Then the pieces: a long line is read in bounded
chunks, and the id ledger answers alike in memory and spilled to disk."""

from __future__ import annotations

import io
import json
import random
from contextlib import nullcontext

import pytest

from semif_serve.batch import ledger as ledger_module
from semif_serve.batch.job import BatchFiles
from semif_serve.batch.ledger import Ledger, OutputMismatch, id_key
from semif_serve.batch.lines import ENVELOPE_BYTES, HEAD_BYTES, LongLine, pieces, result_digest
from semif_serve.batch.runner import Pacing
from semif_serve.service.startup import Service
from tests.support.batch import BASE, LIMITS, STATES, batch_file, decide, line, results, score_file


@pytest.fixture(scope="module")
def service(batch_settings, vision_engine) -> Service:
    return Service.start(batch_settings, engine=vision_engine)


def score(service: Service, source, out, stream=None):
    files = BatchFiles(str(source), str(out))
    return score_file(
        lambda: nullcontext(service),
        files,
        Pacing(),
        stream or io.StringIO(),
        max_body_bytes=LIMITS["max_body_bytes"],
    )


@pytest.mark.parametrize("depth", [990, 5000])
def test_a_line_nested_too_deep_keeps_its_custom_id_and_gets_the_routes_depth_refusal(
    service, tmp_path, depth
):
    nested = "[" * depth + "]" * depth
    texts = [
        '{"custom_id": "deep-native", "method": "POST", "url": "/decide", "body": ' + nested + "}",
        '{"custom_id": "deep-s1", "method": "POST", "url": "/v1/systemone", "body": {"state": '
        + nested
        + "}}",
    ]
    out = tmp_path / "out.jsonl"
    score(service, batch_file(tmp_path / "in.jsonl", texts), out)
    native, systemone = results(out)
    assert native["custom_id"] == "deep-native"
    assert native["response"]["status_code"] == 400
    assert native["error"]["error"]["code"] == "invalid_json"
    assert native["error"]["error"]["message"] == "the JSON nests deeper than 64 levels"
    assert systemone["custom_id"] == "deep-s1"
    assert systemone["response"]["status_code"] == 422
    assert systemone["error"]["detail"][0]["msg"] == "the JSON nests deeper than 64 levels"


def test_a_line_past_the_body_limit_is_refused_413_from_its_length_with_its_custom_id(service, tmp_path):
    long_state = "x" * (LIMITS["max_body_bytes"] + ENVELOPE_BYTES)
    texts = [
        line("long-native", "/decide", decide(long_state, "Is it long?")),
        line("long-s1", "/v1/systemone", {"model": BASE, "state": long_state, "questions": {}}),
        line("short", "/decide", decide(STATES[0], "Is it short?")),
    ]
    out = tmp_path / "out.jsonl"
    score(service, batch_file(tmp_path / "in.jsonl", texts), out)
    native, systemone, short = results(out)
    length = len(texts[0].encode())
    assert native["custom_id"] == "long-native"
    assert native["response"]["status_code"] == 413
    assert native["error"]["error"]["code"] == "body_too_large"
    assert (
        f"line 1: the line is {length} bytes, more than the body limit (12000 bytes)"
        in (native["error"]["error"]["message"])
    )
    assert systemone["custom_id"] == "long-s1"
    assert systemone["response"]["status_code"] == 413
    assert systemone["error"]["detail"]["error_type"] == "request_too_large"  # System One's word for it
    assert short["response"]["status_code"] == 200


def test_a_broken_line_keeps_the_custom_id_read_before_the_break(service, tmp_path):
    texts = ['{"custom_id": "half", "method": "POST", "url": "/decide", "body": {"id": "q", oops', "not JSON"]
    out = tmp_path / "out.jsonl"
    score(service, batch_file(tmp_path / "in.jsonl", texts), out)
    half, unreadable = results(out)
    assert half["custom_id"] == "half"
    assert half["response"]["status_code"] == 400
    assert half["error"]["error"]["code"] == "invalid_json"
    assert unreadable["custom_id"] is None


def test_a_custom_id_that_is_not_unicode_is_written_escaped_and_the_output_is_strict_utf8(service, tmp_path):
    body = json.dumps(decide(STATES[0], "Did it work?"))
    texts = [
        '{"custom_id": "\\ud800-lone", "method": "POST", "url": "/decide", "body": ' + body + "}",
        '{"custom_id": "caf\\u00e9", "method": "POST", "url": "/decide", "body": ' + body + "}",
    ]
    source, out = batch_file(tmp_path / "in.jsonl", texts), tmp_path / "out.jsonl"
    score(service, source, out)
    data = out.read_bytes()
    text = data.decode("utf-8")  # strict: raises on any byte that is not UTF-8
    lone, accented = (json.loads(row) for row in text.splitlines())
    assert lone["custom_id"] == "\ud800-lone"
    assert "\\ud800-lone" in text.splitlines()[0]  # the six characters of the escape, on disk
    assert accented["custom_id"] == "café"
    assert "café".encode() in data  # a line without a lone surrogate keeps its characters as they are
    assert lone["response"]["status_code"] == accented["response"]["status_code"] == 200
    again = score(service, source, out)
    assert again.skipped == again.lines == 2  # the escaped id reads back as the id of its line
    assert out.read_bytes() == data


class ReadRecorder(io.BytesIO):
    """A file that notes the most bytes asked for in one read."""

    largest = 0

    def readline(self, size: int | None = -1) -> bytes:  # type: ignore[override]
        assert size is not None and size > 0, "a whole line was asked for"
        self.largest = max(self.largest, size)
        return super().readline(size)

    def read(self, size: int | None = -1) -> bytes:  # type: ignore[override]
        assert size is not None and size > 0, "the whole file was asked for"
        self.largest = max(self.largest, size)
        return super().read(size)


def test_a_long_line_is_read_in_bounded_chunks_and_kept_as_its_head_and_length():
    head = b'{"custom_id": "huge", "url": "/decide", "body": "'
    long = head + b"y" * (5 << 20) + b'"}'
    source = ReadRecorder(b'{"custom_id": "a"}\n' + long + b"\r\n\n  \n" + b'{"custom_id": "b"}')
    got = list(pieces(source, hold=1000))
    assert source.largest <= 1 << 20
    assert [p.line for p in got if not isinstance(p.line, LongLine)] == [
        b'{"custom_id": "a"}',
        b"",
        b"  ",
        b'{"custom_id": "b"}',
    ]
    kept = got[1].line
    assert isinstance(kept, LongLine)
    assert kept.length == len(long) and kept.head == long[:HEAD_BYTES]
    assert [p.blank for p in got] == [False, False, True, True, False]
    assert [p.ended for p in got] == [True, True, True, True, False]
    assert sum(p.size for p in got) == len(source.getvalue())


def ids(names: list[str]) -> list[bytes]:
    return [result_digest(name, 0) for name in names]


@pytest.mark.parametrize("spill_rows", [8, ledger_module.SPILL_ROWS])
def test_the_ledger_finds_repeats_and_finished_lines_alike_in_memory_and_spilled(monkeypatch, spill_rows):
    monkeypatch.setattr(ledger_module, "SPILL_ROWS", spill_rows)
    rng = random.Random(49)
    names = [f"c{i}" for i in range(500)]
    repeated = names[:300] + ["c17"] + names[300:] + ["c17", "c42"]  # lines 301 and 501 repeat
    with Ledger() as ledger:
        for number, digest in enumerate(ids(repeated), start=1):
            ledger.add_input(digest, number)
        first_seen: dict[str, int] = {}
        expected = None
        for number, name in enumerate(repeated, start=1):
            if name in first_seen and expected is None:
                expected = (first_seen[name], number)
            first_seen.setdefault(name, number)
        assert ledger.first_repeat() == expected == (18, 301)

    done = rng.sample(names, 200)
    with Ledger() as ledger:
        for number, digest in enumerate(ids(names), start=1):
            ledger.add_input(digest, number)
        for number, digest in enumerate(ids(done), start=1):
            ledger.outputs.add(*id_key(digest), number)
        finished = ledger.finished()
        assert finished.count == 200
        assert {n for n in range(0, 510) if n in finished} == {names.index(name) + 1 for name in done}


@pytest.mark.parametrize("spill_rows", [8, ledger_module.SPILL_ROWS])
def test_the_ledger_names_the_first_foreign_or_repeated_output_line(monkeypatch, spill_rows):
    monkeypatch.setattr(ledger_module, "SPILL_ROWS", spill_rows)
    names = [f"c{i}" for i in range(100)]
    outputs = names[:40] + ["stranger"] + names[40:50] + [names[3]]  # line 41 is foreign, 52 repeats 4
    with Ledger() as ledger:
        for number, digest in enumerate(ids(names), start=1):
            ledger.add_input(digest, number)
        for number, digest in enumerate(ids(outputs), start=1):
            ledger.outputs.add(*id_key(digest), number)
        with pytest.raises(OutputMismatch) as first:
            ledger.finished()
    assert str(first.value) == "its line 41 holds an id that no line of the input has"
    with Ledger() as ledger:
        for number, digest in enumerate(ids(names), start=1):
            ledger.add_input(digest, number)
        for number, digest in enumerate(ids(outputs[:40] + outputs[41:]), start=1):
            ledger.outputs.add(*id_key(digest), number)
        with pytest.raises(OutputMismatch) as again:
            ledger.finished()
    assert str(again.value) == "its line 51 repeats the id of its line 4"
