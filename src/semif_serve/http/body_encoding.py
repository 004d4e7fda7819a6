"""Request bodies sent with `Content-Encoding: gzip` or `zstd`, inflated step by step; and
whether a reply may go gzip-compressed, from the request's `Accept-Encoding` and its q-values.

Domain-free: admission feeds each received chunk to a `BodyDecoder` and takes the output in
pieces of at most `STEP_BYTES`, counting each piece against the body limit before keeping
it, so a decompression bomb is refused after inflating at most one step past the limit.
A stream may hold several gzip members or zstd frames, one after another (RFC 9112 8.4.1.3,
RFC 8878 3), up to MAX_MEMBERS: each costs a decompressor however little it holds, so a body
of a hundred thousand empty frames is refused as corrupt after MAX_MEMBERS of them.
"""

from __future__ import annotations

import re
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

from starlette.types import ASGIApp, Receive, Scope, Send

if sys.version_info >= (3, 14):
    from compression.zstd import ZstdDecompressor, ZstdError
else:
    from backports.zstd import ZstdDecompressor, ZstdError

STEP_BYTES = 64 * 1024
MAX_MEMBERS = 64  # gzip members or zstd frames (skippable ones included) per body
GZIP_WINDOW = 16 + zlib.MAX_WBITS  # a gzip header and trailer around a deflate stream


class CorruptBody(ValueError):
    """The compressed body is not valid data of its encoding, or ends before its stream does."""


class _Member(Protocol):
    """One gzip member or zstd frame being inflated."""

    @property
    def eof(self) -> bool:
        """Whether the member or frame has ended."""
        ...

    @property
    def unused_data(self) -> bytes:
        """Input past the end of the member or frame."""
        ...

    def step(self, data: bytes) -> bytes:
        """Feed `data` (b"" to go on) and return at most STEP_BYTES of output."""
        ...

    @property
    def has_more(self) -> bool:
        """Whether output may remain without more input."""
        ...


class _GzipMember:
    def __init__(self) -> None:
        self._inflater = zlib.decompressobj(GZIP_WINDOW)
        self._last = 0

    @property
    def eof(self) -> bool:
        return self._inflater.eof

    @property
    def unused_data(self) -> bytes:
        return self._inflater.unused_data

    def step(self, data: bytes) -> bytes:
        out = self._inflater.decompress(data or self._inflater.unconsumed_tail, STEP_BYTES)
        self._last = len(out)
        return out

    @property
    def has_more(self) -> bool:
        # A full step may have left output inside zlib even when all input was consumed.
        return bool(self._inflater.unconsumed_tail) or self._last == STEP_BYTES


class _ZstdMember:
    def __init__(self) -> None:
        self._inflater = ZstdDecompressor()

    @property
    def eof(self) -> bool:
        return self._inflater.eof

    @property
    def unused_data(self) -> bytes:
        return self._inflater.unused_data

    def step(self, data: bytes) -> bytes:
        return self._inflater.decompress(data, STEP_BYTES)

    @property
    def has_more(self) -> bool:
        return not self._inflater.needs_input


# The codings we inflate (RFC 9110 8.4.1: `x-gzip` is gzip), by their lower-case token.
DECODERS: dict[str, Callable[[], _Member]] = {"gzip": _GzipMember, "x-gzip": _GzipMember, "zstd": _ZstdMember}
SUPPORTED = ", ".join(name for name in DECODERS if not name.startswith("x-"))


class BodyDecoder:
    """Inflates one request body of one coding, chunk by chunk, a step at a time."""

    def __init__(self, coding: str) -> None:
        self.coding = coding
        self._new_member = DECODERS[coding]
        self._member: _Member | None = None
        self._members_ended = 0

    def decode(self, data: bytes) -> Iterator[bytes]:
        """The output of `data`, in pieces of at most STEP_BYTES; each is inflated only when asked for."""
        try:
            while True:
                if self._member is None:
                    if not data:
                        return
                    if self._members_ended == MAX_MEMBERS:
                        kind = "frames" if self.coding == "zstd" else "members"
                        raise CorruptBody(f"the {self.coding} body holds more than {MAX_MEMBERS} {kind}")
                    self._member = self._new_member()
                piece = self._member.step(data)
                data = b""
                if piece:
                    yield piece
                if self._member.eof:
                    data = self._member.unused_data  # the next member or frame starts here
                    self._member = None
                    self._members_ended += 1
                elif not self._member.has_more:
                    return
        except (zlib.error, ZstdError, EOFError) as exc:
            raise CorruptBody(f"the body is not valid {self.coding} data ({exc})") from None

    def finish(self) -> None:
        """Raise CorruptBody unless the body ended exactly at the end of a member or frame."""
        if self._member is not None or self._members_ended == 0:
            raise CorruptBody(f"the {self.coding} body ends before its compressed stream does")


def requested_coding(codings: Sequence[str]) -> str | None:
    """The one coding the body is sent in (None for none or a lone `identity`), from the codings
    of every Content-Encoding header in order, lower case (`http.headers` reads them).

    Raises ValueError naming what was sent when it is a coding we do not inflate or a stack
    of several codings (`identity` in a stack is a stack like any other).
    """
    if list(codings) in ([], ["identity"]):
        return None
    if len(codings) > 1 or codings[0] not in DECODERS:
        raise ValueError(", ".join(codings))
    return codings[0]


# RFC 9110 12.4.2: a qvalue is 0 to 1 with at most three decimals.
QVALUE = re.compile(r"0(\.\d{0,3})?|1(\.0{0,3})?")
GZIP_NAMES = ("gzip", "x-gzip")
ACCEPT_ENCODING = b"accept-encoding"


def accepted_codings(values: Iterable[str]) -> dict[str, float]:
    """Each coding of the Accept-Encoding values (every header's, in order) with its q-value,
    by lower-case name. A coding named twice keeps its lowest q (a refusal stands); an entry
    whose weight is not a valid qvalue is left out, so it accepts nothing."""
    accepted: dict[str, float] = {}
    for value in values:
        for entry in value.split(","):
            coding, *params = (part.strip() for part in entry.split(";"))
            if not coding:
                continue
            weight = 1.0
            for param in params:
                name, _, sent = param.partition("=")
                if name.strip().lower() == "q":
                    weight = float(sent.strip()) if QVALUE.fullmatch(sent.strip()) else -1.0
            if weight >= 0:
                coding = coding.lower()
                accepted[coding] = min(weight, accepted.get(coding, weight))
    return accepted


def reply_gzip_accepted(values: Sequence[str]) -> bool:
    """Whether a reply may go gzip-compressed (RFC 9110 12.5.3): gzip (or x-gzip, or `*` when
    neither is named) has a q above 0 and at least identity's (named, or `*`'s). No header
    asks for no compression; identity not named is acceptable but preferred to nothing."""
    accepted = accepted_codings(values)
    star = accepted.get("*")
    named = [accepted[name] for name in GZIP_NAMES if name in accepted]
    gzip = min(named) if named else (star or 0.0)
    identity = accepted.get("identity", star)
    return gzip > 0 and (identity is None or gzip >= identity)


class ReplyCoding:
    """In front of Starlette's GZipMiddleware, which compresses for any Accept-Encoding that
    contains "gzip" (`gzip;q=0` included): the app below sees `Accept-Encoding: gzip` when
    `reply_gzip_accepted` says so, and no Accept-Encoding otherwise."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = scope["headers"]
            sent = [value.decode("latin-1") for name, value in headers if name.lower() == ACCEPT_ENCODING]
            kept = [(name, value) for name, value in headers if name.lower() != ACCEPT_ENCODING]
            if reply_gzip_accepted(sent):
                kept.append((ACCEPT_ENCODING, b"gzip"))
            scope = {**scope, "headers": kept}
        await self.app(scope, receive, send)
