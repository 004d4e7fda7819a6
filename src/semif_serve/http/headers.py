"""The request headers that decide anything, read once per request.

`headers_of(scope)` parses them on first use and keeps the result in the ASGI scope's state, so
the request context (the request id), admission (authentication, the coding, the body limit,
Content-Length) and the doors (how the body is parsed) all read the same values: a body is never
bounded by one `Content-Type` and parsed by another. A header that must be single and is sent
more than once is named in `repeated`, and admission refuses the request (`duplicate_header`).
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

from semif_serve.http.errors import HTTP_ERRORS, ServiceError

# The headers that must be single, by their lower-case name, with the name as errors spell it.
SINGLE_HEADERS = {
    b"content-type": "Content-Type",
    b"content-length": "Content-Length",
    b"authorization": "Authorization",
    b"x-request-id": "X-Request-ID",
    b"x-semif-state-key": "X-SemIf-State-Key",  # the gateway routes on it: two could disagree
}
CONTENT_ENCODING = b"content-encoding"  # a list: repeated headers join into one stack of codings
STATE_KEY = "request_headers"


@dataclass(frozen=True)
class RequestHeaders:
    """What the service reads from a request's headers (raw bytes, as sent; None when absent)."""

    content_type: bytes | None = None
    content_length: bytes | None = None
    authorization: bytes | None = None
    request_id: bytes | None = None
    content_codings: tuple[str, ...] = ()  # lower case, in order, over every Content-Encoding header
    repeated: tuple[str, ...] = ()  # single headers sent more than once, as SINGLE_HEADERS names them

    @property
    def media_type(self) -> str | None:
        """The Content-Type as text (latin-1, as HTTP header bytes are)."""
        return None if self.content_type is None else self.content_type.decode("latin-1")


def parse_headers(raw: Iterable[tuple[bytes, bytes]]) -> RequestHeaders:
    """Read ASGI request headers once. Identical repeated Content-Length values collapse into one
    (RFC 9110 8.6); any other repeat of a single header is recorded in `repeated`."""
    values: dict[bytes, list[bytes]] = {name: [] for name in SINGLE_HEADERS}
    codings: list[str] = []
    for name, value in raw:
        name = name.lower()
        if name in values:
            values[name].append(value)
        elif name == CONTENT_ENCODING:
            tokens = (token.strip().lower() for token in value.decode("latin-1").split(","))
            codings.extend(token for token in tokens if token)
    values[b"content-length"] = list(dict.fromkeys(values[b"content-length"]))
    repeated = tuple(SINGLE_HEADERS[name] for name, sent in values.items() if len(sent) > 1)
    first = {name: (sent[0] if sent else None) for name, sent in values.items()}
    return RequestHeaders(
        content_type=first[b"content-type"],
        content_length=first[b"content-length"],
        authorization=first[b"authorization"],
        request_id=first[b"x-request-id"],
        content_codings=tuple(codings),
        repeated=repeated,
    )


def headers_of(scope: MutableMapping[str, Any]) -> RequestHeaders:
    """The request's headers, parsed on the first call and kept in its scope's state."""
    state = scope.setdefault("state", {})
    parsed = state.get(STATE_KEY)
    if parsed is None:
        parsed = state[STATE_KEY] = parse_headers(scope["headers"])
    return parsed


def duplicate_header(name: str) -> ServiceError:
    """The 400 for a header that must be single and was sent more than once."""
    return ServiceError(
        HTTP_ERRORS["duplicate_header"],
        "duplicate_header",
        f"send at most one {name} header: it decides how the request is read, and two could disagree",
        name,
    )
