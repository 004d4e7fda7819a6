"""The batch file formats: OpenAI's Batch input lines in, one result line out per input line.

An input line is a JSON object `{"custom_id", "method", "url", "body"}`. The body is kept as the
exact text the line holds (its span in the line), so the route decodes the bytes the caller
wrote, with its own strict checks (duplicate keys, NaN, depth), as it would over HTTP. An
output line is `{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}`; `id` and `request_id` are derived from the custom_id (from the line number for a
line without one), so a resumed run writes the same lines as an uninterrupted one.

Lines are read in bounded pieces: a line longer than the body limit and room for its envelope
is never held, only its first bytes (for its custom_id, method and url) and its length.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, BinaryIO, NamedTuple, cast

#: The routes a batch line may name (all POST), each answered by the door that serves it.
BATCH_URLS = ("/v1/systemone", "/decide", "/decide/shared")
#: What a line may hold beside its body (custom_id, method, url, keys, spaces) before it is
#: refused from its length alone, unread.
ENVELOPE_BYTES = 64 * 1024
#: The first bytes of a line refused from its length, read for its custom_id, method and url.
HEAD_BYTES = 64 * 1024
_CHUNK = 1 << 20
_DECODER = json.JSONDecoder()
# json's own scanners (C where built), called directly: the line's members are read one by one.
_SCAN: Callable[[str, int], tuple[Any, int]] = _DECODER.scan_once  # type: ignore[attr-defined]
_SCAN_STRING: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]
_SPACES = re.compile(r"[ \t\n\r]*")
_SPACE = cast(Callable[[str, int], "re.Match[str]"], _SPACES.match)  # `*` always matches
_BRACKET_OR_QUOTE = re.compile(r'["\[\]{}]')
_STRING_REST = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


class DuplicateCustomId(ValueError):
    """Two input lines carry one custom_id (refused before any work, naming both lines)."""

    def __init__(self, custom_id: str, first: int, second: int) -> None:
        super().__init__(f"custom_id {custom_id!r} is on line {first} and again on line {second}")
        self.custom_id = custom_id
        self.lines = (first, second)


@dataclass(frozen=True)
class LongLine:
    """A line longer than the reader holds: its first HEAD_BYTES and its length in bytes; the
    rest was skipped unread. `limit` is the body limit it was read under."""

    head: bytes
    length: int
    limit: int


#: One input line as read: its bytes (without the newline), or a `LongLine`.
RawLine = bytes | LongLine


@dataclass(frozen=True)
class BatchLine:
    """One input line, read: its 1-based number, its envelope's fields and the body's exact text.

    `problem` says why the line cannot be sent (not a JSON object, a field missing or of the
    wrong type, too long to read), refused with `problem_status` and `problem_code`; a line
    with a problem still gets its one output line.
    """

    number: int
    custom_id: str | None
    method: str | None
    url: str | None
    body_text: str | None
    body: Any = None
    problem: str | None = None
    problem_status: int = 400
    problem_code: str = "invalid_json"

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
    return "batch_req_" + result_digest(custom_id, number).hex()


def result_digest(custom_id: str | None, number: int) -> bytes:
    """The 12 bytes (96 bits) of sha-256 an output line's id spells in hex."""
    key = f"id:{custom_id}" if custom_id is not None else f"line:{number}"
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()[:12]


class _Broken(ValueError):
    """The line's object breaks off; `fields` are the top-level members read before the break."""

    def __init__(self, message: str, fields: dict[str, tuple[Any, str]]) -> None:
        super().__init__(message)
        self.fields = fields


def _top_level(text: str) -> dict[str, tuple[Any, str]]:
    """A JSON object's top-level keys -> (value, the value's exact text). Raises _Broken."""
    fields: dict[str, tuple[Any, str]] = {}
    space = _SPACE
    index = space(text, 0).end()
    if text[index : index + 1] != "{":
        raise _Broken("the line is not a JSON object", fields)
    index = space(text, index + 1).end()
    try:
        if text[index : index + 1] == "}":
            index += 1
        else:
            while True:
                if text[index : index + 1] != '"':
                    raise ValueError("a key of the line's object is not a string")
                key, index = _SCAN_STRING(text, index + 1)
                index = space(text, index).end()
                if text[index : index + 1] != ":":
                    raise ValueError(f"no ':' after the key {key!r}")
                start = space(text, index + 1).end()
                value, index = _value(text, start)
                if key in fields:
                    raise ValueError(f"the key {key!r} appears twice in the line's object")
                fields[key] = (value, text[start:index])
                index = space(text, index).end()
                after = text[index : index + 1]
                if after == ",":
                    index = space(text, index + 1).end()
                    continue
                if after == "}":
                    index += 1
                    break
                raise ValueError("expected ',' or '}' in the line's object")
    except ValueError as exc:
        raise _Broken(str(exc), fields) from None
    if space(text, index).end() != len(text):
        raise _Broken("text after the line's JSON object", fields)
    return fields


def _value(text: str, start: int) -> tuple[Any, int]:
    """The JSON value at `start` and where it ends. One nested too deep to decode here (Python's
    decoder recurses) is only delimited, left for the route's own depth check: None."""
    try:
        return _SCAN(text, start)
    except StopIteration as stop:
        raise ValueError(f"no JSON value at character {stop.value}") from None
    except RecursionError:
        return None, _end_of_nested(text, start)


def _end_of_nested(text: str, start: int) -> int:
    """Where the array or object at `start` closes, found without recursion (strings skipped)."""
    closing: list[str] = []
    index = start
    while True:
        found = _BRACKET_OR_QUOTE.search(text, index)
        if found is None:
            raise ValueError("a nested value is not closed")
        char, index = found.group(), found.end()
        if char == '"':
            rest = _STRING_REST.match(text, index)
            if rest is None:
                raise ValueError("a string is not closed")
            index = rest.end()
            continue
        if char in "[{":
            closing.append("]" if char == "[" else "}")
        elif not closing or closing.pop() != char:
            raise ValueError(f"an unmatched {char!r}")
        if not closing:
            return index


def parse_line(number: int, raw: RawLine) -> BatchLine:
    """Read one input line (its bytes without the newline, or a `LongLine`) into a `BatchLine`.

    A custom_id (and method, url) read before the line breaks off is kept: a line that is not
    valid JSON, or one too long to read, keeps what its first members say."""
    if isinstance(raw, LongLine):
        too_long = (
            f"the line is {raw.length} bytes, more than the body limit ({raw.limit} bytes) and "
            f"{ENVELOPE_BYTES} bytes for the rest of the line: refused from its length, unread"
        )
        line = _envelope(number, {k: v for k, v in _head_fields(raw).items() if k != "body"})
        return replace(line, problem=too_long, problem_status=413, problem_code="body_too_large")
    fields, problem = _read(raw)
    line = _envelope(number, fields)
    if problem is not None:
        return _with_problem(line, problem)
    for name in ("custom_id", "method", "url"):
        if not isinstance(fields.get(name, (None, ""))[0], str):
            return _with_problem(line, f"`{name}` must be a string")
    if line.body_text is None:
        return _with_problem(line, "`body` is required")
    return line


def line_digest(number: int, raw: RawLine) -> bytes:
    """`result_digest` of the line `parse_line` reads (without building it: the input scan reads
    every line)."""
    fields = _head_fields(raw) if isinstance(raw, LongLine) else _read(raw)[0]
    return result_digest(_string(fields, "custom_id"), number)


def _read(raw: bytes) -> tuple[dict[str, tuple[Any, str]], str | None]:
    """The line's top-level members (those read before it breaks off) and why it is not a JSON
    object (None: it is one)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return {}, "the line is not UTF-8"
    try:
        return _top_level(text), None
    except _Broken as exc:
        return exc.fields, f"the line is not valid JSON: {exc}"


def _head_fields(raw: LongLine) -> dict[str, tuple[Any, str]]:
    """The members a long line's first bytes hold whole."""
    head = raw.head
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        # The head may end inside a character; only a break before its last 3 bytes is bad UTF-8.
        text = head[: exc.start].decode("utf-8") if exc.start >= len(head) - 3 else ""
    try:
        return _top_level(text)
    except _Broken as exc:
        return exc.fields


def _string(fields: dict[str, tuple[Any, str]], name: str) -> str | None:
    value = fields.get(name, (None, ""))[0]
    return value if isinstance(value, str) else None


def _envelope(number: int, fields: dict[str, tuple[Any, str]]) -> BatchLine:
    """The line's custom_id, method, url and body, from the members read (each None if absent)."""
    body, body_text = fields.get("body", (None, None))
    return BatchLine(
        number,
        _string(fields, "custom_id"),
        _string(fields, "method"),
        _string(fields, "url"),
        body_text,
        body,
    )


def _with_problem(line: BatchLine, problem: str) -> BatchLine:
    return replace(line, problem=problem)


def line_limit(max_body_bytes: int) -> int:
    """The longest input line held in memory: the body limit and room for the envelope."""
    return max_body_bytes + ENVELOPE_BYTES


class Piece(NamedTuple):
    """One physical line of a file: its bytes without the newline (or a `LongLine`), whether it is
    blank, whether a newline ended it, and the bytes it took in the file (newline included)."""

    line: RawLine
    blank: bool
    ended: bool
    size: int


def pieces(source: BinaryIO, hold: int, limit: int | None = None) -> Iterator[Piece]:
    """Each physical line of `source` (seekable), holding at most `hold` bytes of it: a longer one
    is read in chunks to its newline and kept as a `LongLine` (its first HEAD_BYTES, its length).
    `limit` is the body limit a `LongLine` records (default: `hold`)."""
    while True:
        raw = source.readline(hold + 2)
        if not raw:
            return
        ended = raw.endswith(b"\n")
        if ended or len(raw) <= hold + 1:
            content = raw.rstrip(b"\r\n")
            blank = not content or content.isspace()
            if len(content) <= hold:
                yield Piece(content, blank, ended, len(raw))
            else:
                yield Piece(
                    LongLine(content[:HEAD_BYTES], len(content), limit or hold), blank, ended, len(raw)
                )
            continue
        head, size, blank = raw[:HEAD_BYTES], len(raw), raw.isspace()
        chunk = raw
        while not ended:
            chunk = source.read(_CHUNK)  # read, not readline: a long readline copies 8 KiB at a time
            if not chunk:
                break
            newline = chunk.find(b"\n")
            if newline >= 0:
                source.seek(newline + 1 - len(chunk), os.SEEK_CUR)  # the next line starts after it
                chunk = chunk[: newline + 1]
            size += len(chunk)
            blank = blank and chunk.isspace()
            if len(head) < HEAD_BYTES:  # a hold shorter than the head (a test's) reads on for it
                head += chunk[: HEAD_BYTES - len(head)]
            ended = chunk.endswith(b"\n")
        length = size - (len(chunk) - len(chunk.rstrip(b"\r\n")))
        yield Piece(LongLine(head[:length], length, limit or hold), blank, ended, size)


def read_lines(source: BinaryIO, max_body_bytes: int) -> Iterator[tuple[int, RawLine]]:
    """Each non-blank line of `source` with its 1-based number (its newline and a CR removed);
    a line longer than `line_limit(max_body_bytes)` comes as a `LongLine`, never held whole."""
    for number, piece in enumerate(pieces(source, line_limit(max_body_bytes), max_body_bytes), start=1):
        if not piece.blank:
            yield number, piece.line


def result_line(line: BatchLine, status: int, body: Any) -> dict[str, Any]:
    """The output line of `line`: the route's status and body; `error` is that body when refused."""
    return {
        "id": line.id,
        "custom_id": line.custom_id,
        "response": {"status_code": status, "request_id": line.request_id, "body": body},
        "error": body if status >= 400 else None,
    }
