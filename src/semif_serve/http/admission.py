"""Admission control in front of the app (pure ASGI): literal paths, authentication, the queue cap,
body decoding, the body limit and the body deadline.

Every header that decides anything is read once (`http.headers`), before anything else: a
header that must be single and is repeated is refused (400). A request on a protected path is
then authenticated from its headers before it may take a slot,
so an unauthenticated client never holds one. Only a POST to a protected path (every POST route
is one) has its body read or takes a slot: any other request is answered without its body
(a POST elsewhere gets its 404 or 405 at once). A POST counts from then until its response is
sent or its client disconnects. Past the cap it gets 429 before a byte of its body is read; a
body is read only up to the limit (the chunk that would pass it is never kept) and only until
the body deadline, after which it gets 408 and its slot back; the deadline counts only the time
spent waiting for the client's bytes, never the server's own work. A gzip or zstd body is
inflated as it arrives, on a worker thread (the event loop stays free), and the limit applies
to what it inflates to, counted before it is kept.
Every refusal is rendered by the door that owns the path, in that door's error shape.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Collection

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from semif_serve.http.auth import Authenticator
from semif_serve.http.body_encoding import SUPPORTED, BodyDecoder, CorruptBody, requested_coding
from semif_serve.http.errors import ServiceError
from semif_serve.http.headers import RequestHeaders, duplicate_header, headers_of

#: Renders an error for the request it answers, in the shape of the door that owns the path.
ErrorRenderer = Callable[[ServiceError, Request], Response]
#: The body limit of a POST from its path and Content-Type (a door may allow more than the default).
BodyLimit = Callable[[str, str | None], int]

log = logging.getLogger("semif_serve.admission")

ASCII_DIGITS = re.compile(rb"[0-9]+")  # int() and isdigit() would accept Unicode digits
RETRY_AFTER_SECONDS = "1"


def busy(max_queue: int) -> ServiceError:
    return ServiceError(
        429,
        "busy",
        f"the service already has {max_queue} requests in progress; retry after a moment",
        headers={"Retry-After": RETRY_AFTER_SECONDS},
    )


def body_too_large(limit: int, inflated: bool = False) -> ServiceError:
    what = "the request body, decompressed," if inflated else "the request body"
    return ServiceError(413, "body_too_large", f"{what} is over the limit of {limit} bytes")


def unsupported_encoding(sent: str) -> ServiceError:
    shown = sent if len(sent) <= 64 else sent[:64] + "..."
    return ServiceError(
        415,
        "unsupported_content_encoding",
        f"Content-Encoding {shown!r} is not supported: send the body as is, or in exactly one of {SUPPORTED}",
        "Content-Encoding",
        headers={"Accept-Encoding": SUPPORTED},
    )


def corrupt_body(exc: CorruptBody) -> ServiceError:
    return ServiceError(400, "invalid_compressed_body", str(exc), "Content-Encoding")


def body_timeout(seconds: float) -> ServiceError:
    return ServiceError(
        408,
        "body_timeout",
        f"the request body did not arrive within {seconds:g} seconds",
        headers={"Connection": "close"},
    )


def draining() -> ServiceError:
    return ServiceError(503, "draining", "the service is shutting down", headers={"Retry-After": "5"})


def encoded_path(path: str) -> ServiceError:
    return ServiceError(
        404, "not_found", f"no route {path}: paths are matched as sent, percent-encoding is not decoded"
    )


class Admission:
    """Literal paths, auth on protected paths, and the queue cap, body limit and body deadline for POSTs."""

    def __init__(
        self,
        app: ASGIApp,
        max_queue: int,
        max_body_bytes: int,
        body_timeout_seconds: float,
        authenticator: Authenticator,
        protected_paths: Collection[str],
        render: ErrorRenderer,
        body_limit: BodyLimit | None = None,
    ) -> None:
        self.app = app
        self.body_limit = body_limit
        self.render = render
        self.max_queue = max_queue
        self.max_body_bytes = max_body_bytes
        self.body_timeout_seconds = body_timeout_seconds
        self.authenticator = authenticator
        self.protected_paths = frozenset(protected_paths)
        self.in_progress = 0
        self.reading_bodies = 0
        self.refused = 0
        self.draining = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._screened(scope, receive, tracked)
        except asyncio.CancelledError:
            request_id = scope.get("state", {}).get("request_id")
            log.warning("request cancelled", extra={"request_id": request_id, "route": scope["path"]})
            if not self.draining:
                raise
            # Cancelled by the server at shutdown: answered and logged as such, not as an ASGI exception.
            if not started:
                await self.refuse(scope, send, draining())

    async def refuse(self, scope: Scope, send: Send, error: ServiceError) -> None:
        """Answer `error` as a complete response, in the shape of the door that owns the path."""
        response = self.render(error, Request(scope))
        await send(
            {"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers}
        )
        await send({"type": "http.response.body", "body": response.body, "more_body": False})

    async def _screened(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw_path = (scope.get("raw_path") or b"").partition(b"?")[0].decode("latin-1")
        if raw_path and raw_path != scope["path"]:
            await self.refuse(scope, send, encoded_path(raw_path))
            return
        headers = headers_of(scope)
        if headers.repeated:
            await self.refuse(scope, send, duplicate_header(headers.repeated[0]))
            return
        if scope["path"] in self.protected_paths:
            try:
                self.authenticator.check(headers.authorization)
            except ServiceError as error:
                await self.refuse(scope, send, error)
                return
        if scope["method"] != "POST" or scope["path"] not in self.protected_paths:
            # No route here reads a body: none is read, no slot is taken (the server then closes a
            # connection whose body was left unread).
            await self.app(scope, _without_body(receive), send)
            return
        if self.draining:
            await self.refuse(scope, send, draining())
            return
        try:
            coding = requested_coding(headers.content_codings)
        except ValueError as exc:
            await self.refuse(scope, send, unsupported_encoding(str(exc)))
            return
        if self.in_progress >= self.max_queue:
            self.refused += 1
            await self.refuse(scope, send, busy(self.max_queue))
            return
        self.in_progress += 1
        try:
            await self._admitted(scope, receive, send, headers, coding)
        finally:
            self.in_progress -= 1

    def limit_for(self, path: str, headers: RequestHeaders) -> int:
        """The body limit of this POST: SEMIF_MAX_BODY_BYTES unless its door allows more for its
        one Content-Type (the value the door will parse the body by)."""
        if self.body_limit is None:
            return self.max_body_bytes
        return self.body_limit(path, headers.media_type)

    async def _admitted(
        self, scope: Scope, receive: Receive, send: Send, headers: RequestHeaders, coding: str | None
    ) -> None:
        limit = self.limit_for(scope["path"], headers)
        declared = headers.content_length
        if declared is not None:
            if not ASCII_DIGITS.fullmatch(declared):
                await self.refuse(
                    scope,
                    send,
                    ServiceError(
                        400,
                        "invalid_content_length",
                        "Content-Length must be plain ASCII digits",
                        "Content-Length",
                    ),
                )
                return
            if int(declared) > limit:
                await self.refuse(scope, send, body_too_large(limit))
                return
        decoder = BodyDecoder(coding) if coding is not None else None
        self.reading_bodies += 1
        try:
            body = await self._read_body(receive, decoder, limit)
        finally:
            self.reading_bodies -= 1
        if body is None:
            return  # the client went away; nothing to answer
        if isinstance(body, ServiceError):
            await self.refuse(scope, send, body)
            return
        if decoder is not None:
            scope = decoded_scope(scope, len(body))
        await self._run_until_disconnect(scope, body, receive, send)

    async def _read_body(
        self, receive: Receive, decoder: BodyDecoder | None, limit: int
    ) -> bytes | ServiceError | None:
        """The body (inflated when `decoder` is given), its refusal, or None if the client left.

        The limit holds for the bytes received and for what they inflate to: each piece is
        counted before it is kept, and inflating stops at the first piece past the limit.
        The deadline holds for the time spent waiting on `receive` alone.
        """
        loop = asyncio.get_running_loop()
        kept: list[bytes] = []
        received = 0
        waited = 0.0
        while True:
            started = loop.time()
            try:
                async with asyncio.timeout(self.body_timeout_seconds - waited):
                    message = await receive()
            except TimeoutError:
                return body_timeout(self.body_timeout_seconds)
            waited += loop.time() - started
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            if received + len(chunk) > limit:
                return body_too_large(limit)
            received += len(chunk)
            last = not message.get("more_body", False)
            if decoder is None:
                kept.append(chunk)
            else:
                refusal = await asyncio.to_thread(self._inflate, decoder, chunk, last, kept, limit)
                if refusal is not None:
                    return refusal
            if last:
                return b"".join(kept)

    def _inflate(
        self, decoder: BodyDecoder, chunk: bytes, last: bool, kept: list[bytes], limit: int
    ) -> ServiceError | None:
        """Inflate `chunk` onto `kept` (run off the event loop); the refusal, if any."""
        total = sum(len(piece) for piece in kept)
        try:
            for piece in decoder.decode(chunk):
                if total + len(piece) > limit:
                    return body_too_large(limit, inflated=True)
                total += len(piece)
                kept.append(piece)
            if last:
                decoder.finish()
        except CorruptBody as exc:
            return corrupt_body(exc)
        return None

    async def _run_until_disconnect(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        """Run the app on the buffered body; a client disconnect cancels it and frees the slot."""
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        app_task = asyncio.ensure_future(self.app(scope, replay, send))
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({app_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not app_task.done():
                app_task.cancel()
            await asyncio.gather(app_task, return_exceptions=True)
            failure = app_task.exception() if app_task.done() and not app_task.cancelled() else None
            if failure is not None:
                raise failure
        finally:
            watcher.cancel()
            if not app_task.done():
                app_task.cancel()


def decoded_scope(scope: Scope, length: int) -> Scope:
    """The scope the app sees for an inflated body: no Content-Encoding, the inflated Content-Length."""
    headers = [
        (k, v) for k, v in scope["headers"] if k.lower() not in (b"content-encoding", b"content-length")
    ]
    return {**scope, "headers": [*headers, (b"content-length", str(length).encode("ascii"))]}


def _without_body(receive: Receive) -> Receive:
    """`receive` for an app that is not given the request's body: an empty body at once, then
    only the client's disconnect (body bytes that arrive meanwhile are dropped)."""
    given = False

    async def empty() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await _wait_for_disconnect(receive)
        return {"type": "http.disconnect"}

    return empty


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
