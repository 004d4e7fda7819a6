"""Admission control: the queue cap before the body is read, the body limit, and slots that never leak."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from harness.server import LoopbackServer
from semif_serve.app import create_app
from semif_serve.service.startup import Service
from tests.support import TOKEN, decision, make_settings, open_post
from tests.support.polling import wait_until, wait_until_async

AUTH = (b"authorization", f"Bearer {TOKEN}".encode())


def scope(headers=(), path="/decide", method="POST"):
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [AUTH, *headers],
        "client": ("127.0.0.1", 1),
        "server": ("t", 80),
    }


class Exchange:
    """One raw ASGI request: a scripted body, and what the app sent back."""

    def __init__(self, chunks, hold: asyncio.Event | None = None):
        self.chunks = list(chunks)
        self.reads = 0
        self.hold = hold
        self.messages: list[dict] = []
        self.finished = asyncio.Event()

    async def receive(self):
        if self.reads < len(self.chunks):
            self.reads += 1
            more = self.reads < len(self.chunks) or self.hold is not None
            return {"type": "http.request", "body": self.chunks[self.reads - 1], "more_body": more}
        if self.hold is not None:
            await self.hold.wait()
            return {"type": "http.disconnect"}
        await self.finished.wait()  # like a server: disconnect only once the response is sent
        return {"type": "http.disconnect"}

    async def send(self, message):
        self.messages.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finished.set()

    @property
    def status(self):
        return next(m["status"] for m in self.messages if m["type"] == "http.response.start")

    @property
    def headers(self):
        start = next(m for m in self.messages if m["type"] == "http.response.start")
        return {k.decode(): v.decode() for k, v in start["headers"]}

    @property
    def json(self):
        return json.loads(
            b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")
        )


@pytest.fixture
def small_service(engine, checkpoint):
    return Service.start(make_settings(checkpoint, max_queue=2, max_body_bytes=1000), engine=engine)


def while_every_slot_is_taken(app, path="/decide", method="POST", body=b""):
    """Fill the queue with requests whose bodies never finish, send one more, return its exchange."""

    async def go():
        hold = asyncio.Event()
        stuck = [Exchange([b"{"], hold=hold) for _ in range(app.admission.max_queue)]
        tasks = [asyncio.create_task(app(scope(), e.receive, e.send)) for e in stuck]
        await wait_until_async(
            lambda: app.admission.in_progress == app.admission.max_queue, what="every slot taken"
        )
        extra = Exchange([body])
        await app(scope(path=path, method=method), extra.receive, extra.send)
        hold.set()
        await asyncio.gather(*tasks)
        return extra

    return asyncio.run(go())


def test_a_request_past_the_queue_cap_gets_429_before_its_body_is_read(small_service):
    app = create_app(small_service)
    refused = while_every_slot_is_taken(app, body=json.dumps(decision()).encode())
    assert refused.status == 429
    assert refused.reads == 0
    assert refused.json["error"]["code"] == "busy"
    assert refused.headers["retry-after"].isdigit()
    assert app.admission.in_progress == 0


def test_health_is_answered_while_every_slot_is_taken(small_service):
    app = create_app(small_service)
    health = while_every_slot_is_taken(app, path="/health", method="GET")
    assert health.status == 200
    assert health.json["queue"]["in_progress"] == 2


@pytest.mark.parametrize("value", ["\uff11\uff12", "+12", " 12", "12 ", "-1", "1e3", "0x10", ""])
def test_a_content_length_that_is_not_plain_ascii_digits_is_400(small_service, value):
    app = create_app(small_service)
    exchange = Exchange([b"{}"])
    header = (b"content-length", value.encode("utf-8"))
    asyncio.run(app(scope([header]), exchange.receive, exchange.send))
    assert exchange.status == 400
    assert exchange.json["error"]["code"] == "invalid_content_length"
    assert exchange.reads == 0
    assert app.admission.in_progress == 0


def test_a_declared_content_length_over_the_limit_is_413_without_reading(small_service):
    app = create_app(small_service)
    exchange = Exchange([b"x" * 2000])
    asyncio.run(app(scope([(b"content-length", b"2000")]), exchange.receive, exchange.send))
    assert exchange.status == 413
    assert exchange.json["error"]["code"] == "body_too_large"
    assert exchange.reads == 0


def test_a_chunked_body_stops_being_read_at_the_first_chunk_that_would_pass_the_limit(small_service):
    app = create_app(small_service)
    exchange = Exchange([b"x" * 400, b"x" * 400, b"x" * 400, b"x" * 400])
    asyncio.run(app(scope(), exchange.receive, exchange.send))
    assert exchange.status == 413
    assert exchange.reads == 3  # the third chunk would pass 1000 bytes; the fourth is never asked for


def test_a_body_exactly_at_the_limit_is_accepted(small_service):
    app = create_app(small_service)
    body = json.dumps(decision()).encode()
    body += b" " * (1000 - len(body))
    exchange = Exchange([body[:500], body[500:]])
    asyncio.run(app(scope(), exchange.receive, exchange.send))
    assert exchange.status == 200


def test_a_flood_with_cancelled_clients_leaves_no_slot_taken(engine, checkpoint):
    service = Service.start(make_settings(checkpoint, max_queue=4), engine=engine)
    app = create_app(service)
    gate = threading.Event()

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:

            async def one(i):
                return await client.post(
                    "/decide", json=decision(id=f"q{i}"), headers={"Authorization": f"Bearer {TOKEN}"}
                )

            # The engine is held so the cancellations below land on requests holding their slots.
            busy = asyncio.ensure_future(service.worker.run(lambda: gate.wait(60)))
            tasks = [asyncio.create_task(one(i)) for i in range(24)]
            await wait_until_async(
                lambda: app.admission.in_progress == 4 and app.admission.refused == 20,
                what="four requests admitted and the other twenty refused",
            )
            for task in tasks[::3]:
                task.cancel()
            gate.set()
            await busy
            done = await asyncio.gather(*tasks, return_exceptions=True)
        return [d.status_code for d in done if isinstance(d, httpx.Response)]

    statuses = asyncio.run(go())
    assert set(statuses) <= {200, 429}
    assert 200 in statuses
    assert app.admission.in_progress == 0
    assert service.worker.pending == 0


def test_clients_that_disconnect_mid_request_over_real_http_release_their_slots(engine, checkpoint):
    service = Service.start(make_settings(checkpoint, max_queue=3), engine=engine)
    app = create_app(service)
    with LoopbackServer(app) as server:
        port = int(server.url.rsplit(":", 1)[1])
        body = json.dumps(decision()).encode()
        for _ in range(3):
            # Half a body, then hang up once it holds a slot: the slot must come back.
            with open_post(port, body, send=20):
                wait_until(lambda: app.admission.in_progress == 1, what="the half-sent request's slot")
            wait_until(lambda: app.admission.in_progress == 0, what="the slot back after the hang-up")
        # The engine is held, so a full body's request is still waiting on it when its client hangs up.
        gate = threading.Event()
        holder = threading.Thread(target=service.worker.run_now, args=(lambda: gate.wait(60),))
        holder.start()
        try:
            for _ in range(3):
                # A full body, then hang up before the answer: the slot must come back.
                with open_post(port, body):
                    wait_until(lambda: app.admission.in_progress == 1, what="the full request's slot")
                wait_until(lambda: app.admission.in_progress == 0, what="the slot back after the hang-up")
        finally:
            gate.set()
            holder.join()
        ok = httpx.post(f"{server.url}/decide", json=decision(), headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200
        wait_until(lambda: service.worker.pending == 0, what="no job left with the engine")
