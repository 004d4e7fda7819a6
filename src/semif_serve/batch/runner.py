"""A batch file through the real service in this process: the app `create_app` builds, driven
through httpx's ASGI transport with the service's own token, so every line is answered by the
same admission, doors, core and engine as over HTTP (no validation of its own).

Lines are read a window at a time; inside a window the lines about one (model, state) are sent
together, so they are in flight at once and share one prefill in the batcher; at most
`concurrency` lines are in flight (never more than SEMIF_MAX_QUEUE, so admission never answers
a line 429 because of the batch's own pacing). A window's results are written in input order,
flushed and synced once the whole window is answered; the next window is already in flight.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import httpx
from starlette.requests import Request

from semif_serve.app import create_app
from semif_serve.batch.lines import BATCH_URLS, BatchLine, result_line
from semif_serve.http.errors import ServiceError
from semif_serve.service.startup import Service

DEFAULT_WINDOW = 256
RETRIES = 3  # a line refused for a moment (429, 503 with Retry-After) is sent again this often
MAX_RETRY_WAIT_SECONDS = 10.0
#: Called with each answered line's output (progress, counts).
OnAnswer = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class Pacing:
    """How far ahead the batch reads and how many lines it keeps in flight."""

    window: int = DEFAULT_WINDOW
    concurrency: int | None = None  # None: SEMIF_MAX_QUEUE, the most admission takes at once

    def in_flight(self, max_queue: int) -> int:
        """Lines in flight at once: the asked number, held to the service's queue cap."""
        return max(1, min(self.concurrency or max_queue, max_queue))


class BatchScorer:
    """The real app over a started `Service`, answering batch lines as its routes would."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.app = create_app(service)
        self.auth = f"Bearer {service.token}"

    def refusal(self, line: BatchLine, error: ServiceError) -> tuple[int, Any]:
        """`error` rendered by the door that owns the line's url (the native door for none)."""
        scope = {
            "type": "http",
            "method": "POST",
            "path": line.url or "/",
            "headers": [],
            "query_string": b"",
            "state": {"request_id": line.request_id},
        }
        response = self.app.admission.render(error, Request(scope))
        return response.status_code, json.loads(bytes(response.body))

    async def answer(self, client: httpx.AsyncClient, line: BatchLine) -> dict[str, Any]:
        """The output line for `line`: its route's answer, or the refusal of a line it never reaches."""
        if line.problem is not None:
            error = ServiceError(
                line.problem_status, line.problem_code, f"line {line.number}: {line.problem}"
            )
            status, body = self.refusal(line, error)
        elif line.url not in BATCH_URLS:
            known = ", ".join(BATCH_URLS)
            message = f"no batch route {line.url}: a line's url is one of {known}"
            status, body = self.refusal(line, ServiceError(404, "not_found", message))
        elif line.method != "POST":
            status, body = self.refusal(
                line, ServiceError(405, "method_not_allowed", f"{line.url} takes POST, not {line.method}")
            )
        else:
            reply = await self.post(client, line)
            status, body = reply.status_code, _body_of(reply)
        return result_line(line, status, body)

    async def post(self, client: httpx.AsyncClient, line: BatchLine) -> httpx.Response:
        """The line's body POSTed to its route; a refusal that asks to be retried (429, 503 with
        Retry-After: out of device memory, released) is sent again after the delay it names, up
        to RETRIES times, as a client of the service would."""
        assert line.body_text is not None and line.url is not None
        for attempt in range(RETRIES + 1):
            reply = await client.post(
                line.url,
                content=line.body_text.encode("utf-8", "surrogatepass"),
                headers={
                    "Authorization": self.auth,
                    "Content-Type": "application/json",
                    "X-Request-ID": line.request_id,
                },
            )
            wait = retry_after(reply)
            if wait is None or attempt == RETRIES:
                return reply
            await asyncio.sleep(wait)
        raise AssertionError("unreachable")  # the loop returns on its last attempt

    async def score(
        self,
        windows: Iterable[list[BatchLine]],
        write: Callable[[list[dict[str, Any]]], None],
        pacing: Pacing,
        on_answer: OnAnswer = lambda result: None,
    ) -> None:
        """Answer every window's lines and `write` each window's results, in input order."""
        gate = asyncio.Semaphore(pacing.in_flight(self.service.settings.max_queue))
        transport = httpx.ASGITransport(app=self.app, raise_app_exceptions=False)  # a 500, as over HTTP
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://batch", timeout=None, limits=limits
        ) as client:

            async def one(line: BatchLine) -> dict[str, Any]:
                async with gate:
                    result = await self.answer(client, line)
                on_answer(result)
                return result

            in_flight: list[list[asyncio.Task[dict[str, Any]]]] = []
            try:
                for window in windows:
                    # Group by group: the semaphore admits waiters in order, so a state's lines fly together.
                    tasks = {line.number: asyncio.ensure_future(one(line)) for line in grouped(window)}
                    in_flight.append([tasks[line.number] for line in window])
                    if len(in_flight) > 1:  # the next window is queued: finish and write the oldest
                        write(list(await asyncio.gather(*in_flight.pop(0))))
                while in_flight:
                    write(list(await asyncio.gather(*in_flight.pop(0))))
            finally:
                for task in (task for tasks in in_flight for task in tasks):
                    task.cancel()


def retry_after(reply: httpx.Response) -> float | None:
    """Seconds to wait before sending a refused line again, or None when it is not to be retried."""
    if reply.status_code not in (429, 503):
        return None
    try:
        return min(MAX_RETRY_WAIT_SECONDS, max(0.0, float(reply.headers["Retry-After"])))
    except (KeyError, ValueError):
        return None


def _body_of(reply: httpx.Response) -> Any:
    try:
        return reply.json()
    except ValueError:
        return reply.text


def grouped(window: list[BatchLine]) -> list[BatchLine]:
    """The window's lines, those of one (model, state) together, groups in order of first line."""
    groups: dict[tuple[str, str], list[BatchLine]] = {}
    for line in window:
        groups.setdefault(line.group, []).append(line)
    return [line for lines in groups.values() for line in lines]


def windows_of(lines: Iterable[BatchLine], size: int) -> Iterator[list[BatchLine]]:
    """`lines` in consecutive windows of at most `size`."""
    window: list[BatchLine] = []
    for line in lines:
        window.append(line)
        if len(window) >= size:
            yield window
            window = []
    if window:
        yield window


class ResultWriter:
    """Appends result lines to the output, each window in one write, flushed and synced."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.syncable = _is_regular_file(out)
        self.written = 0

    def __call__(self, results: list[dict[str, Any]]) -> None:
        data = b"".join(encode_result(result) for result in results)
        self.out.write(data)
        self.out.flush()
        if self.syncable:
            os.fsync(self.out.fileno())
        self.written += len(results)


def encode_result(result: dict[str, Any]) -> bytes:
    """One output line: compact JSON, non-ASCII kept, and a newline; always UTF-8. A line holding a
    lone UTF-16 surrogate (a custom_id or an echoed string such as "\\ud800", which has no UTF-8
    form) is written with every non-ASCII character escaped, so JSON reads back the same string."""
    text = json.dumps(result, ensure_ascii=False, separators=(",", ":")) + "\n"
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(result, ensure_ascii=True, separators=(",", ":")) + "\n").encode("ascii")


def _is_regular_file(out: BinaryIO) -> bool:
    try:
        import stat

        return stat.S_ISREG(os.fstat(out.fileno()).st_mode)
    except (OSError, ValueError, AttributeError):
        return False
