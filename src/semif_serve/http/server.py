"""Running the app under uvicorn: envelope answers from the HTTP layer, a header deadline, and a drain.

The HTTP/1.1 protocol is uvicorn's h11 protocol with four changes: the parser is strict where
h11 is lenient (a bare LF in the request head, a header folded onto a continuation line, or
`Content-Length` together with `Transfer-Encoding`, is a protocol error: each lets a front proxy
and this server disagree on where a request ends or what a header says); a request the parser
refuses (those, a malformed request line or headers, a bad `Content-Length`, a header block
over h11's 16 KiB) is answered with the error envelope (`400 invalid_http_request`) instead of
uvicorn's plain text, and the connection is closed; headers that do not complete within
SEMIF_HEADER_TIMEOUT_SECONDS of the connection opening (or of the previous response) get
`408 header_timeout` and the connection is closed; and a response sent before the request's
body was read whole (a refusal, a GET with a body) says `Connection: close` and ends the
connection: the server's side is closed after the response (the client reads it, then the end
of the stream), and what the client still sends is read and dropped for at most LINGER_SECONDS
and LINGER_BYTES before the socket closes (nginx's lingering close: closing with unread bytes
sends a reset, which may destroy the response before the client has read it), so no byte keeps
the connection open.

The first SIGTERM/SIGINT stops admitting (new POSTs get 503 draining, /health says
draining so a load balancer takes the replica out) while the socket stays open; in-flight
requests finish within SEMIF_SHUTDOWN_GRACE_SECONDS, which bounds the whole shutdown
(whatever is still running at the deadline is cancelled and logged as cancelled). A second
signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from http import HTTPStatus
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from semif_serve.http.errors import ServiceError, error_response

log = logging.getLogger("semif_serve.server")

MAX_HEAD_BYTES = 16 * 1024  # request line + headers, however they arrive (h11 alone checks only pieces)
# How long, and how many bytes, an unread body is drained after the response ended its connection.
LINGER_SECONDS = 2.0
LINGER_BYTES = 1024 * 1024


def raw_error(error: ServiceError) -> bytes:
    """A complete HTTP/1.1 response carrying the envelope, for answers sent outside any ASGI cycle."""
    request_id = uuid.uuid4().hex
    response = error_response(error, request_id)
    log.warning("refused by the HTTP layer", extra={"request_id": request_id, "code": error.code})
    head = [f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}".encode()]
    head += [name + b": " + value for name, value in response.raw_headers]
    head.append(b"connection: close")
    return b"\r\n".join(head) + b"\r\n\r\n" + response.body


class StrictConnection(h11.Connection):
    """h11's server connection, refusing the request heads that h11 itself lets through.

    `refusal` says why the last protocol error was raised (None: h11's own reason).
    """

    refusal: str | None = None

    def next_event(self):
        if self.their_state is h11.IDLE:
            self._refuse_loose_head()
        event = super().next_event()
        if isinstance(event, h11.Request):
            names = {name for name, _ in event.headers}
            if b"content-length" in names and b"transfer-encoding" in names:
                self._refuse("the request has both Content-Length and Transfer-Encoding")
        return event

    def send(self, event):
        """h11's bytes for `event`; a response head sent while the request's body is still owed
        says `Connection: close`, so a keep-alive client does not send its next request on a
        connection that ends after this response. (h11 is not told: it would have uvicorn close
        the socket at once, where the body's bytes still in flight would reset it.)"""
        data = super().send(event)
        if isinstance(event, h11.Response) and self.their_state is h11.SEND_BODY and data:
            if b"connection" not in {name for name, _ in event.headers}:
                data = data[:-2] + b"connection: close\r\n\r\n"
        return data

    def _refuse_loose_head(self) -> None:
        buffered = self.trailing_data[0][: MAX_HEAD_BYTES + 4]
        end = buffered.find(b"\r\n\r\n")
        head = buffered if end < 0 else buffered[:end]
        if b"\n" in head.replace(b"\r\n", b""):
            self._refuse("a line of the request head ends with a bare LF (lines end with CRLF)")
        if b"\r\n " in head or b"\r\n\t" in head:
            self._refuse("a header line is folded onto the next (obs-fold): send each header on one line")

    def _refuse(self, why: str) -> None:
        self.refusal = why
        # h11 moves to ERROR on its own protocol errors; ours must leave it unusable the same way.
        self._process_error(self.their_role)
        raise h11.RemoteProtocolError(why, 400)


class EnvelopeProtocol(H11Protocol):
    """uvicorn's h11 protocol that answers its own refusals in the envelope and bounds header time."""

    header_timeout_seconds = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = StrictConnection(
            h11.SERVER, max_incomplete_event_size=self.conn._max_incomplete_event_size
        )
        self.header_deadline: asyncio.TimerHandle | None = None
        self.linger_left: int | None = None  # bytes still dropped while lingering (None: not lingering)
        self.linger_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_arrived()
        if self.linger_deadline is not None:
            self.linger_deadline.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.linger_left is not None:  # the response was the last: drop what is still sent
            self.linger_left -= len(data)
            if self.linger_left < 0:
                self.transport.close()
            return
        if self.conn.their_state is h11.IDLE and self._head_size(data) > MAX_HEAD_BYTES:
            self.send_400_response("header block too large")
            return
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._headers_arrived()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.SEND_BODY:
            # A body nobody reads (a refusal, a GET's): bytes of it would stop uvicorn's keep-alive timer.
            self._linger()
        elif self.conn.their_state is h11.IDLE:
            self._await_headers()

    def _linger(self) -> None:
        """End the connection after its response: our side closed at once, the client's drained
        for at most LINGER_SECONDS and LINGER_BYTES, then the socket closed."""
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self.linger_left = LINGER_BYTES
        self.linger_deadline = self.loop.call_later(LINGER_SECONDS, self.transport.close)
        self.flow.resume_reading()

    def send_400_response(self, msg: str) -> None:
        self._headers_arrived()
        why = getattr(self.conn, "refusal", None)
        error = ServiceError(
            400,
            "invalid_http_request",
            f"the request line or headers are not valid HTTP/1.1: {why}"
            if why
            else "the request line or headers are not valid HTTP/1.1 (for example a Content-Length that is "
            "not plain ASCII digits, or a header block over 16 KiB)",
        )
        self.transport.write(raw_error(error))
        self.transport.close()

    def _head_size(self, data: bytes) -> int:
        """Bytes of the request line and headers received so far."""
        buffered = self.conn.trailing_data[0] + data
        end = buffered.find(b"\r\n\r\n")
        return end if end >= 0 else len(buffered)

    def _await_headers(self) -> None:
        self._headers_arrived()
        self.header_deadline = self.loop.call_later(self.header_timeout_seconds, self._headers_timed_out)

    def _headers_arrived(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def _headers_timed_out(self) -> None:
        self.header_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if not self.conn.trailing_data[0]:
            self.transport.close()  # nothing was sent: close without an answer, like an idle keep-alive
            return
        error = ServiceError(
            408,
            "header_timeout",
            f"the request headers did not arrive within {self.header_timeout_seconds:g} seconds",
        )
        self.transport.write(raw_error(error))
        self.transport.close()


def server_config(
    app: Any, host: str, port: int, header_timeout_seconds: float, **options: Any
) -> uvicorn.Config:
    """The uvicorn config the service runs under (also used by the tests' loopback servers)."""
    protocol = type(
        "EnvelopeProtocol", (EnvelopeProtocol,), {"header_timeout_seconds": header_timeout_seconds}
    )
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        log_config=None,
        access_log=False,
        **options,
    )


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that drains before it stops listening, within one grace period in total."""

    def __init__(self, config: uvicorn.Config, admission, grace_seconds: float) -> None:
        super().__init__(config)
        self.admission = admission
        self.grace_seconds = grace_seconds
        self.drain_deadline: float | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.drain_deadline is not None:
            log.warning("second signal: exiting now", extra={"in_progress": self.admission.in_progress})
            self.should_exit = True
            self.force_exit = True
            return
        self.admission.draining = True
        self.drain_deadline = time.monotonic() + self.grace_seconds
        log.info(
            "draining: refusing new requests",
            extra={"in_progress": self.admission.in_progress, "grace_seconds": self.grace_seconds},
        )

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            left = self.drain_deadline - time.monotonic()
            if self.admission.in_progress == 0 or left <= 0:
                log.info("drained", extra={"left_in_progress": self.admission.in_progress})
                self.config.timeout_graceful_shutdown = max(0.0, left)  # type: ignore[assignment]  # a float works
                self.should_exit = True
        return await super().on_tick(counter)


def run_server(app, host: str, port: int, grace_seconds: float, header_timeout_seconds: float = 10.0) -> None:
    """Serve `app` (from create_app) until drained."""
    config = server_config(
        app, host, port, header_timeout_seconds, timeout_graceful_shutdown=grace_seconds, lifespan="off"
    )
    DrainingServer(config, app.admission, grace_seconds).run()
