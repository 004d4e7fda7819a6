"""Shared fixtures: a tiny random-weight Qwen3.5 checkpoint on disk, loaded through the real loader."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The service processes the tests start share compiled bytecode: with PYTHONDONTWRITEBYTECODE set
# (and no `uv sync --compile-bytecode`), each would compile torch and transformers from source again.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

from semif_serve.app import create_app  # noqa: E402
from semif_serve.engine.runner import TorchEngine  # noqa: E402
from semif_serve.service.settings import Settings  # noqa: E402
from semif_serve.service.startup import Service, load_engine  # noqa: E402
from semif_serve.tools.demo import DEMO_REVISION, write_checkpoint  # noqa: E402

TOKEN = "test-token-0123456789"


def pytest_collection_modifyitems(config, items):
    """The control-plane suite runs last, so that CI's build of it (started beside the tests) has
    the whole run to finish."""
    items.sort(key=lambda item: item.get_closest_marker("k8s_controlplane") is not None)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("demo-model"))


@pytest.fixture(scope="session")
def tokenizer(checkpoint):
    """The checkpoint's tokenizer (Qwen3.5's real vocabulary) as transformers loads it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint))


def make_settings(model_path: Path, **overrides) -> Settings:
    values = dict(
        model_path=model_path,
        model_revision=DEMO_REVISION,
        device="cpu",
        api_token=TOKEN,
    )
    values.update(overrides)
    return Settings(**values)


@pytest.fixture(scope="session")
def engine(checkpoint) -> TorchEngine:
    return load_engine(make_settings(checkpoint))


@pytest.fixture(scope="session")
def service(engine, checkpoint) -> Service:
    return Service.start(make_settings(checkpoint), engine=engine)


@pytest.fixture(scope="session")
def vision_checkpoint(tmp_path_factory) -> Path:
    """The demo's checkpoint: the tiny Qwen3.5 with a vision tower."""
    return write_checkpoint(tmp_path_factory.mktemp("vision-model"), multimodal=True)


@pytest.fixture(scope="session")
def vision_engine(vision_checkpoint) -> TorchEngine:
    return load_engine(make_settings(vision_checkpoint))


@pytest.fixture(scope="session")
def vision_service(vision_engine, vision_checkpoint) -> Service:
    return Service.start(make_settings(vision_checkpoint), engine=vision_engine)


@pytest.fixture(scope="session")
def vision_reference(vision_checkpoint):
    """The vision checkpoint as transformers' own classes load it (the independent side)."""
    from vision_reference import load_reference

    return load_reference(vision_checkpoint)


@pytest.fixture(scope="module")
def app(service):
    """The real app over the session's service (a module that needs another defines its own)."""
    return create_app(service)


@pytest.fixture(scope="module")
def server(app):
    """`app` behind a real uvicorn on a loopback port, with the service's own server settings."""
    from test_hardening import HardenedServer  # it imports this module's helpers

    with HardenedServer(app) as running:
        yield running


@pytest.fixture
def client(service):
    """An in-process client of the real app (admission included)."""
    return in_process_client(create_app(service))


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
