"""Decoding a request body into a JSON object, refusing at parse time what would fail later.

Domain-free: any JSON route (native or another door) can use it. It refuses bytes that are
not UTF-8, malformed JSON, nesting deeper than MAX_DEPTH, integers longer than Python can
convert, lone UTF-16 surrogates in any string or key, and a key that appears twice in one
object (JSON would keep the last silently: a question or an option would vanish), naming the
field where it can.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from semif_serve.domain.echo import quoted

MAX_DEPTH = 64
MAX_INT_DIGITS = 4300  # Python's default limit for int <-> str conversion
INVALID_JSON = "invalid_json"
INVALID_VALUE = "validation_error"
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # paired escapes arrive already combined
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # the only way a surrogate reaches a string


class BodyError(ValueError):
    """A body refused while decoding: `code` (invalid_json / validation_error), message, field path."""

    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field


class _LongInteger(str):
    """The digits of an integer too long to convert; reported with its field after parsing."""


class _DuplicateKey(dict):
    """An object in which `key` appeared more than once; reported with its field after parsing."""

    key: str


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document = dict(pairs)
    if len(document) == len(pairs):
        return document
    seen: set[str] = set()
    twice = next(key for key, _ in pairs if key in seen or seen.add(key))  # type: ignore[func-returns-value]
    marked = _DuplicateKey(document)
    marked.key = twice
    return marked


def _parse_int(digits: str) -> int | _LongInteger:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        return _LongInteger(digits)
    return int(digits)


def _child(path: str | None, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path or ''}[{key}]"
    return f"{path}.{key}" if path else key


def _shallow_enough(document: Any) -> bool:
    """Whether no container nests MAX_DEPTH deep (a walk over containers only, no paths built)."""
    stack = [(document, 0)] if isinstance(document, (dict, list)) else []
    while stack:
        value, depth = stack.pop()
        if depth >= MAX_DEPTH:
            return False
        for item in value.values() if isinstance(value, dict) else value:
            if isinstance(item, (dict, list)):
                stack.append((item, depth + 1))
    return True


def _check(document: Any) -> None:
    """Walk the document (iteratively) for long integers, lone surrogates and excess depth."""
    stack: list[tuple[Any, str | None, int]] = [(document, None, 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, _LongInteger):
            raise BodyError(INVALID_VALUE, f"an integer has more than {MAX_INT_DIGITS} digits", path)
        if isinstance(value, str):
            if LONE_SURROGATE.search(value):
                raise BodyError(
                    INVALID_VALUE, "the string holds a lone UTF-16 surrogate (\\ud800-\\udfff)", path
                )
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_DEPTH:
            raise BodyError(INVALID_JSON, f"the JSON nests deeper than {MAX_DEPTH} levels", path)
        if isinstance(value, _DuplicateKey):
            raise BodyError(
                INVALID_VALUE,
                f"the key {quoted(value.key)} appears more than once in one object; every key must be unique",
                _child(path, value.key),
            )
        if isinstance(value, dict):
            for key in value:
                if LONE_SURROGATE.search(key):
                    raise BodyError(INVALID_VALUE, "an object key holds a lone UTF-16 surrogate", path)
            children = [(item, _child(path, key), depth + 1) for key, item in value.items()]
        else:
            children = [(item, _child(path, i), depth + 1) for i, item in enumerate(value)]
        stack.extend(reversed(children))  # report the first offender in document order


def decode_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or BodyError naming the rule (and the field where there is one)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(INVALID_JSON, f"the request body is not valid UTF-8 (byte {exc.start})") from None
    marked: list[object] = []  # long integers and objects with a duplicate key, as they are parsed

    def parse_int(digits: str) -> int | _LongInteger:
        number = _parse_int(digits)
        if isinstance(number, _LongInteger):
            marked.append(number)
        return number

    def parse_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        document = _object(pairs)
        if isinstance(document, _DuplicateKey):
            marked.append(document)
        return document

    try:
        document = json.loads(text, parse_int=parse_int, object_pairs_hook=parse_object)
    except json.JSONDecodeError as exc:
        raise BodyError(
            INVALID_JSON,
            f"the request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
        ) from None
    except RecursionError:
        raise BodyError(INVALID_JSON, f"the JSON nests deeper than {MAX_DEPTH} levels") from None
    # The full walk builds every field's path; it runs only where there is something to name.
    if marked or SURROGATE_ESCAPE.search(text) or not _shallow_enough(document):
        _check(document)
    if not isinstance(document, dict):
        raise BodyError(INVALID_VALUE, "the request body must be a JSON object")
    return document


def require_finite(value: Any, path: str, what: str) -> Any:
    """`value` unchanged if it serialises as finite JSON (no NaN or Infinity anywhere inside), else
    ValueError naming where (`state.v[1]`) and `what` must be finite."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{where} holds {quoted(str(item))}; {what} must serialise as finite JSON")
        if isinstance(item, dict):
            stack.extend((child, f"{where}.{key}") for key, child in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{i}]") for i, child in reversed(list(enumerate(item))))
    return value
