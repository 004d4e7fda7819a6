"""The batch file formats: OpenAI's Batch input lines in, one result line out per input line.

An input line is a JSON object `{"custom_id", "method", "url", "body"}`. The body is kept as the
exact text the line holds (its span in the line), so the route decodes the bytes the caller
wrote, with its own strict checks (duplicate keys, NaN, depth), as it would over HTTP. An
output line is `{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}`; `id` and `request_id` are derived from the custom_id (from the line number for a
line without one), so a resumed run writes the same lines as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

#: The routes a batch line may name (all POST), each answered by the door that serves it.
BATCH_URLS = ("/v1/systemone", "/decide", "/decide/shared")
_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\n\r"


class DuplicateCustomId(ValueError):
    """Two input lines carry one custom_id (refused before any work, naming both lines)."""

    def __init__(self, custom_id: str, first: int, second: int) -> None:
        super().__init__(f"custom_id {custom_id!r} is on line {first} and again on line {second}")
        self.custom_id = custom_id
        self.lines = (first, second)


@dataclass(frozen=True)
class BatchLine:
    """One input line, read: its 1-based number, its envelope's fields and the body's exact text.

    `problem` says why the line cannot be sent (not a JSON object, a field missing or of the
    wrong type); a line with a problem still gets its one output line, refused.
    """

    number: int
    custom_id: str | None
    method: str | None
    url: str | None
    body_text: str | None
    body: Any = None
    problem: str | None = None

    @property
    def id(self) -> str:
        """The output line's id: from the custom_id, else from the line number (stable across runs)."""
        return result_id(self.custom_id, self.number)

    @property
    def request_id(self) -> str:
        """The request id the route answers under (X-Request-ID), stable across runs."""
        return "batch-" + self.id.removeprefix("batch_req_")

    @property
    def group(self) -> tuple[str, str]:
        """What lines that may share one prefill have in common: the model and the state."""
        body = self.body if isinstance(self.body, dict) else {}
        model, state = body.get("model"), body.get("state")
        return (json.dumps(model, sort_keys=True), json.dumps(state, sort_keys=True))


def result_id(custom_id: str | None, number: int) -> str:
    """`batch_req_<24 hex>` from the custom_id (or `line:<n>` for a line without one)."""
    key = f"id:{custom_id}" if custom_id is not None else f"line:{number}"
    return "batch_req_" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def _top_level(text: str) -> dict[str, tuple[Any, str]]:
    """A JSON object's top-level keys -> (value, the value's exact text). Raises ValueError."""
    index = len(text) - len(text.lstrip(_WHITESPACE))
    if not text.startswith("{", index):
        raise ValueError("the line is not a JSON object")
    fields: dict[str, tuple[Any, str]] = {}
    index += 1
    while True:
        index = _skip(text, index)
        if text.startswith("}", index) and not fields:
            index += 1
            break
        key, index = _DECODER.raw_decode(text, index)
        if not isinstance(key, str):
            raise ValueError("a key of the line's object is not a string")
        index = _skip(text, index)
        if not text.startswith(":", index):
            raise ValueError(f"no ':' after the key {key!r}")
        start = _skip(text, index + 1)
        value, index = _DECODER.raw_decode(text, start)
        if key in fields:
            raise ValueError(f"the key {key!r} appears twice in the line's object")
        fields[key] = (value, text[start:index])
        index = _skip(text, index)
        if text.startswith(",", index):
            index += 1
            continue
        if text.startswith("}", index):
            index += 1
            break
        raise ValueError("expected ',' or '}' in the line's object")
    if text[index:].strip(_WHITESPACE):
        raise ValueError("text after the line's JSON object")
    return fields


def _skip(text: str, index: int) -> int:
    while index < len(text) and text[index] in _WHITESPACE:
        index += 1
    return index


def parse_line(number: int, raw: bytes) -> BatchLine:
    """Read one input line (its bytes without the newline) into a `BatchLine`."""
    try:
        fields = _top_level(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return BatchLine(number, None, None, None, None, problem="the line is not UTF-8")
    except (ValueError, RecursionError) as exc:
        return BatchLine(number, None, None, None, None, problem=f"the line is not valid JSON: {exc}")
    custom_id, _ = fields.get("custom_id", (None, ""))
    method, _ = fields.get("method", (None, ""))
    url, _ = fields.get("url", (None, ""))
    body, body_text = fields.get("body", (None, None))
    custom = custom_id if isinstance(custom_id, str) else None
    line = BatchLine(
        number,
        custom,
        method if isinstance(method, str) else None,
        url if isinstance(url, str) else None,
        body_text,
        body,
    )
    for name, value in (("custom_id", custom_id), ("method", method), ("url", url)):
        if not isinstance(value, str):
            return _with_problem(line, f"`{name}` must be a string")
    if body_text is None:
        return _with_problem(line, "`body` is required")
    return line


def _with_problem(line: BatchLine, problem: str) -> BatchLine:
    return BatchLine(line.number, line.custom_id, line.method, line.url, line.body_text, line.body, problem)


def read_lines(source: BinaryIO) -> Iterator[tuple[int, bytes]]:
    """Each non-blank line of `source` with its 1-based number (its newline and a CR removed)."""
    for number, raw in enumerate(source, start=1):
        stripped = raw.rstrip(b"\r\n")
        if stripped.strip():
            yield number, stripped


def scan_input(path: Path) -> list[str]:
    """The output ids of the input file's lines, in order; raises DuplicateCustomId on the first
    repeated custom_id. Lines that cannot be read count too (each gets its refusal)."""
    seen: dict[str, int] = {}
    ids = []
    with path.open("rb") as source:
        for number, raw in read_lines(source):
            line = parse_line(number, raw)
            ids.append(line.id)
            if line.custom_id is None:
                continue
            if line.custom_id in seen:
                raise DuplicateCustomId(line.custom_id, seen[line.custom_id], number)
            seen[line.custom_id] = number
    return ids


def result_line(line: BatchLine, status: int, body: Any) -> dict[str, Any]:
    """The output line of `line`: the route's status and body; `error` is that body when refused."""
    return {
        "id": line.id,
        "custom_id": line.custom_id,
        "response": {"status_code": status, "request_id": line.request_id, "body": body},
        "error": body if status >= 400 else None,
    }


def done_ids(path: Path) -> set[str]:
    """The ids already in an output file, after cutting a half-written last line off it.

    A kill can leave only the last line incomplete (each line is written whole, then flushed
    and synced), so everything after the last newline is truncated.
    """
    if not path.exists():
        return set()
    with path.open("r+b") as out:
        data = out.read()
        keep = data.rfind(b"\n") + 1
        if keep != len(data):
            out.truncate(keep)
            out.flush()
            os.fsync(out.fileno())
    return {json.loads(line)["id"] for line in data[:keep].splitlines() if line.strip()}
