"""One default TLS context for the suite's httpx clients.

httpx builds a new TLS context for every client it makes (certifi's bundle read and parsed: 30 to 70
ms on a busy CI machine), httpx.get and httpx.post included. The suite makes well over a thousand
plain-HTTP calls to loopback servers, and polls /health in loops, so it spent a minute building
contexts no connection used. A client asking for the default verification (verify=True, no
client certificate) now gets the one context built for the same certificate settings; any other
request is built as httpx builds it.
"""

from __future__ import annotations

import contextlib
import os
import ssl
import threading
from collections.abc import Iterator

import httpx._transports.default as transports

_build = transports.create_ssl_context
_contexts: dict[tuple, ssl.SSLContext] = {}
_lock = threading.Lock()


def shared_default_context(verify=True, cert=None, trust_env: bool = True) -> ssl.SSLContext:
    """httpx's create_ssl_context, built once per certificate setting for the default verification."""
    if verify is not True or cert is not None:
        return _build(verify=verify, cert=cert, trust_env=trust_env)
    # What httpx reads to choose the CA bundle: a change of either builds a new context.
    key = (os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR")) if trust_env else (None, None)
    with _lock:
        if (trust_env, *key) not in _contexts:
            _contexts[(trust_env, *key)] = _build(verify=True, cert=None, trust_env=trust_env)
        return _contexts[(trust_env, *key)]


def install() -> None:
    """Make httpx's transports (every Client, AsyncClient and httpx.get/post) use the shared context."""
    transports.create_ssl_context = shared_default_context


@contextlib.contextmanager
def built_per_client() -> Iterator[None]:
    """httpx's own behaviour again while inside: a new context for each client."""
    shared, transports.create_ssl_context = transports.create_ssl_context, _build
    try:
        yield
    finally:
        transports.create_ssl_context = shared
