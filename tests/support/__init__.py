"""What the tests share besides fixtures: the token, settings over a checkpoint, a native body, clients."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from semif_serve.service.settings import Settings
from semif_serve.tools.demo import DEMO_REVISION

TOKEN = "test-token-0123456789"


@contextmanager
def request_log_lines() -> Iterator[list[dict]]:
    """The request log's JSON lines written inside the block, as the service formats them
    (the list is filled when the block ends)."""
    from semif_serve.http.logs import JsonFormatter

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("semif_serve.request")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    lines: list[dict] = []
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        lines.extend(json.loads(line) for line in stream.getvalue().splitlines())


def make_settings(model_path: Path, **overrides) -> Settings:
    """Settings over `model_path` on the CPU with the tests' token, changed by `overrides`."""
    values = dict(
        model_path=model_path,
        model_revision=DEMO_REVISION,
        device="cpu",
        api_token=TOKEN,
    )
    values.update(overrides)
    return Settings(**values)


def in_process_client(app):
    """A client of `app` through httpx's ASGI transport, with the bearer token by default."""
    transport = httpx.ASGITransport(app=app)
    with_auth = {"Authorization": f"Bearer {TOKEN}"}

    class Client:
        def __init__(self):
            self.app = app

        async def _request(self, method, url, **kw):
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                return await c.request(method, url, **kw)

        def request(self, method, url, auth=True, **kw):
            headers = dict(with_auth if auth else {})
            headers.update(kw.pop("headers", {}))
            return asyncio.run(self._request(method, url, headers=headers, **kw))

        def post(self, url, **kw):
            return self.request("POST", url, **kw)

        def get(self, url, **kw):
            return self.request("GET", url, **kw)

    return Client()


def decision(**overrides) -> dict:
    """A native `/decide` body (a yes/no deployment question), changed by `overrides`."""
    body = {
        "id": "q1",
        "state": "Health checks passed in all three zones.",
        "question": "Did the deployment succeed?",
        "options": [
            {"id": "yes", "description": "It succeeded."},
            {"id": "no", "description": "It failed."},
        ],
    }
    body.update(overrides)
    return body


def open_post(port: int, body: bytes, send: int | None = None):
    """A raw HTTP/1.1 POST /decide over a socket, sending only the first `send` body bytes."""
    import socket

    sock = socket.create_connection(("127.0.0.1", port))
    head = (
        f"POST /decide HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body[:send])
    return sock
