"""Admission control in front of the app (pure ASGI): the queue cap and the body limit.

A request counts from the moment its headers arrive until its response is sent or its
client disconnects. Past the cap it gets 429 before a byte of its body is read; a body is
read only up to the limit, and the chunk that would pass it is never kept.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

from .errors import ServiceError

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ASCII_DIGITS = re.compile(rb"[0-9]+")  # int() and isdigit() would accept Unicode digits
RETRY_AFTER_SECONDS = "1"


async def send_error(send: Send, error: ServiceError, request_id: str | None = None) -> None:
    """Send the error envelope as a complete response."""
    body = json.dumps(error.envelope(request_id)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    if request_id is not None:
        headers.append((b"x-request-id", request_id.encode()))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def busy(max_queue: int) -> ServiceError:
    return ServiceError(
        429,
        "busy",
        f"the service already has {max_queue} requests in progress; retry after a moment",
        headers={"Retry-After": RETRY_AFTER_SECONDS},
    )


def body_too_large(limit: int) -> ServiceError:
    return ServiceError(413, "body_too_large", f"the request body is over the limit of {limit} bytes")


class Admission:
    """The queue cap and the body limit for POST requests; everything else passes straight through."""

    def __init__(self, app: ASGIApp, max_queue: int, max_body_bytes: int) -> None:
        self.app = app
        self.max_queue = max_queue
        self.max_body_bytes = max_body_bytes
        self.in_progress = 0
        self.refused = 0
        self.draining = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        request_id = scope.get("state", {}).get("request_id")
        if self.draining:
            await send_error(
                send,
                ServiceError(503, "draining", "the service is shutting down", headers={"Retry-After": "5"}),
                request_id,
            )
            return
        if self.in_progress >= self.max_queue:
            self.refused += 1
            await send_error(send, busy(self.max_queue), request_id)
            return
        self.in_progress += 1
        try:
            await self._admitted(scope, receive, send, request_id)
        finally:
            self.in_progress -= 1

    async def _admitted(self, scope: Scope, receive: Receive, send: Send, request_id: str | None) -> None:
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not ASCII_DIGITS.fullmatch(declared):
                await send_error(
                    send,
                    ServiceError(
                        400,
                        "invalid_content_length",
                        "Content-Length must be plain ASCII digits",
                        "Content-Length",
                    ),
                    request_id,
                )
                return
            if int(declared) > self.max_body_bytes:
                await send_error(send, body_too_large(self.max_body_bytes), request_id)
                return
        body = await self._read_body(receive)
        if body is None:
            return  # the client went away; nothing to answer
        if isinstance(body, ServiceError):
            await send_error(send, body, request_id)
            return
        await self._run_until_disconnect(scope, body, receive, send)

    async def _read_body(self, receive: Receive) -> bytes | ServiceError | None:
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            if total + len(chunk) > self.max_body_bytes:
                return body_too_large(self.max_body_bytes)
            total += len(chunk)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

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


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
