"""System One's `multipart/form-data` bodies (RFC 7578), as the official SDK sends images: a
first part named `request` (the JSON request), then one part of raw image bytes per asset
(`asset-0`, `asset-1`, ...), each claimed by the asset whose `part` names it.

The body arrives whole and inflated (admission bounds it); python-multipart splits it. Any
malformed body is a 422 on `body`, never a 5xx.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from semif_serve.domain.echo import quoted

MULTIPART = "multipart/form-data"
REQUEST_PART = "request"


class MultipartRefused(ValueError):
    """The body is not a multipart body System One reads; the message says why."""


@dataclass
class MultipartBody:
    """The JSON of the `request` part and every other part's bytes, by name."""

    request: bytes
    parts: dict[str, bytes] = field(default_factory=dict)


def is_multipart(content_type: str | None) -> bool:
    """Whether a Content-Type header names a multipart/form-data body."""
    if not content_type:
        return False
    kind, _ = parse_options_header(content_type)
    return kind.lower() == MULTIPART.encode()


def _disposition_name(value: bytes) -> str | None:
    kind, options = parse_options_header(value)
    if kind.lower() != b"form-data":
        return None
    name = options.get(b"name")
    return None if name is None else name.decode("latin-1")


class TooManyParts(MultipartRefused):
    """More parts than a request may carry (its `request` and one per image allowed)."""


def parse_multipart(content_type: str, body: bytes, max_parts: int | None = None) -> MultipartBody:
    """Split a multipart/form-data body into its `request` JSON and its named parts.

    Raises MultipartRefused for a missing boundary, a malformed body, a part without a name, a
    name sent twice, or no `request` part; TooManyParts at the first part past `max_parts`
    (None: no limit), before the rest is parsed.
    """
    _, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if not boundary:
        raise MultipartRefused("a multipart/form-data body needs a boundary in its Content-Type")
    found: list[tuple[str | None, bytearray]] = []
    header_name = bytearray()
    header_value = bytearray()
    names: list[str | None] = []

    def on_part_begin() -> None:
        if max_parts is not None and len(found) >= max_parts:
            raise TooManyParts(f"the multipart body has more than {max_parts} parts")
        found.append((None, bytearray()))
        names.append(None)

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header_name.extend(data[start:end])

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header_value.extend(data[start:end])

    def on_header_end() -> None:
        if bytes(header_name).lower() == b"content-disposition":
            names[-1] = _disposition_name(bytes(header_value))
        header_name.clear()
        header_value.clear()

    def on_part_data(data: bytes, start: int, end: int) -> None:
        found[-1][1].extend(data[start:end])

    ended = False

    def on_end() -> None:
        nonlocal ended
        ended = True

    parser = MultipartParser(
        boundary,
        {
            "on_part_begin": on_part_begin,
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_part_data": on_part_data,
            "on_end": on_end,
        },
    )
    try:
        parser.write(body)
        parser.finalize()
    except MultipartParseError as exc:
        raise MultipartRefused(f"the multipart body is malformed ({exc})") from None
    if not ended:
        raise MultipartRefused("the multipart body ends before its closing boundary")
    parsed: dict[str, bytes] = {}
    for index, ((_, data), name) in enumerate(zip(found, names, strict=True)):
        if name is None:
            raise MultipartRefused(f"part {index} of the multipart body has no form-data name")
        if name in parsed:
            raise MultipartRefused(f"the multipart body has two parts named {quoted(name)}")
        parsed[name] = bytes(data)
    if REQUEST_PART not in parsed:
        raise MultipartRefused(
            f"a multipart body needs a part named {REQUEST_PART!r} holding the JSON request"
        )
    request = parsed.pop(REQUEST_PART)
    return MultipartBody(request, parsed)
