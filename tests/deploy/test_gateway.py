"""The gateway (stacks/semif-k8s/files/haproxy.cfg) run by the real haproxy in front of three real
replicas of the app on loopback: state-affinity routing, the body fallback, least load, failover.

The replicas share one loaded engine (they are three uvicorn servers over three create_app
instances, each with its own admission: queue, drain state); which one answered is the gateway's
X-SemIf-Replica header. Skips where haproxy is not installed, except in CI (.ci/run installs it).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import threading
import time

import httpx
import pytest
import uvicorn

from bench.gateway import REPLICA_HEADER, STATE_KEY_HEADER, Gateway, state_key
from semif_serve.app import create_app
from semif_serve.http.server import server_config
from tests.support import TOKEN, decision
from tests.support.proxy_bodies import (
    JSON_LIMIT,
    PHOTO_BYTES,
    PHOTO_LIMIT,
    photo_multipart,
    refused_by_a_replica,
    too_large_for_systemone,
)
from tests.support.tls_context import built_per_client

HAPROXY = shutil.which("haproxy")
if HAPROXY is None:
    if os.environ.get("CI"):
        raise RuntimeError("haproxy is not installed; .ci/run installs it")
    pytest.skip("haproxy is not installed (.ci/run installs it)", allow_module_level=True)

AUTH = {"Authorization": f"Bearer {TOKEN}"}
# Unicode, quotes, a backslash and an escaped control character: the body fallback must hash the
# state as JSON decodes it, exactly as the client hashes it for the header.
STATES = [f"Replica routing check {i}: the canary in zone {i % 3} passed." for i in range(10)] + [
    'Zürich said "ok" at 09:00 \\ then the pager went off\ttwice.',
    "出荷は完了しましたか。",
]


class Replica:
    """A real uvicorn with the real app on a loopback port, in a thread."""

    def __init__(self, service) -> None:
        self.app = create_app(service)
        self.server = uvicorn.Server(server_config(self.app, "127.0.0.1", 0, 10.0, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> Replica:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module", autouse=True)
def a_new_tls_context_per_call():
    """The routing tests send one request after another; the bounded-load hash diverts a key while the
    last request's stream still counts, and only a client's ~40 ms TLS build gave HAProxy time to end
    it (found when the suite shared one context: see tests/support/tls_context.py)."""
    with built_per_client():
        yield


@pytest.fixture(scope="module")
def replicas(service):
    started = [Replica(service).start() for _ in range(3)]
    yield started
    for replica in started:
        if replica.thread.is_alive():
            replica.stop()


@pytest.fixture(scope="module")
def gateway(replicas, tmp_path_factory):
    with Gateway([r.port for r in replicas], tmp_path_factory.mktemp("gateway"), haproxy=HAPROXY) as running:
        wait_until(lambda: len(ready_servers(running)) == 3)
        yield running


def wait_until(condition, seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def ready_servers(gateway: Gateway) -> set[str]:
    """The servers the gateway routes to now: ask each replica's /health through it, by key."""
    seen = set()
    for state in STATES:
        response = httpx.get(f"{gateway.url}/health", headers={STATE_KEY_HEADER: state_key(state)}, timeout=5)
        if response.status_code == 200:
            seen.add(response.headers[REPLICA_HEADER])
    return seen


def in_flight(gateway: Gateway) -> float:
    """Requests the gateway's by_state replicas are serving now, from its own metrics."""
    metrics = httpx.get(f"http://127.0.0.1:{gateway.env['SEMIF_GATEWAY_OPS_PORT']}/metrics", timeout=5).text
    counts = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("haproxy_server_current_sessions{") and 'proxy="by_state"' in line
    ]
    assert counts, "the gateway's metrics name no by_state server"
    return sum(counts)


def decide(gateway: Gateway, state: str, header: bool = True, **kw) -> httpx.Response:
    """POST a decision once no earlier request still counts against a replica: the bounded-load
    hash diverts a key from a replica whose last stream HAProxy has not yet ended."""
    wait_until(lambda: in_flight(gateway) == 0)
    headers = dict(AUTH)
    if header:
        headers[STATE_KEY_HEADER] = state_key(state)
    headers.update(kw.pop("headers", {}))
    return httpx.post(f"{gateway.url}/decide", json=decision(state=state), headers=headers, timeout=30, **kw)


def placement(gateway: Gateway, header: bool = True) -> dict[str, str]:
    placed = {}
    for state in STATES:
        response = decide(gateway, state, header=header)
        assert response.status_code == 200, response.text
        placed[state] = response.headers[REPLICA_HEADER]
    return placed


def test_one_state_key_always_reaches_one_replica_and_the_keys_spread_over_all(gateway):
    first = placement(gateway)
    assert all(server.startswith("by_state/") for server in first.values())
    assert placement(gateway) == first
    assert len(set(first.values())) == 3


def test_the_state_in_an_uncompressed_body_routes_exactly_as_the_header_does(gateway):
    by_header = placement(gateway, header=True)
    by_body = placement(gateway, header=False)
    assert by_body == by_header
    # System One bodies carry the state at the same place.
    for state in STATES[:3] + STATES[-2:]:
        body = {
            "model": "jev-latest",
            "state": state,
            "questions": {"ok": {"type": "noul", "instructions": "Did it pass?"}},
        }
        response = httpx.post(f"{gateway.url}/v1/systemone", json=body, headers=AUTH, timeout=30)
        assert response.status_code == 200, response.text
        assert response.headers[REPLICA_HEADER] == by_header[state]


def test_a_malformed_key_is_ignored_and_the_body_state_is_used(gateway):
    state = STATES[3]
    expected = decide(gateway, state).headers[REPLICA_HEADER]
    for bad in ("not-a-hash", state_key(state)[:63], state_key(state) + "0"):
        response = decide(gateway, state, header=False, headers={STATE_KEY_HEADER: bad})
        assert response.headers[REPLICA_HEADER] == expected


def test_requests_without_a_readable_state_go_to_the_least_loaded_replica(gateway):
    models = httpx.get(f"{gateway.url}/v1/models", headers=AUTH, timeout=10)
    assert models.status_code == 200
    assert models.headers[REPLICA_HEADER].startswith("least_load/")
    body = gzip.compress(json.dumps(decision(state=STATES[0])).encode())
    compressed = httpx.post(
        f"{gateway.url}/decide",
        content=body,
        timeout=30,
        headers={**AUTH, "Content-Encoding": "gzip", "Content-Type": "application/json"},
    )
    assert compressed.status_code == 200, compressed.text
    assert compressed.headers[REPLICA_HEADER].startswith("least_load/")


def test_a_body_over_the_limit_is_refused_at_the_gateway_in_the_service_envelope(gateway):
    response = httpx.post(f"{gateway.url}/decide", content=b"x" * (1048576 + 1), headers=AUTH, timeout=30)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "body_too_large"
    assert REPLICA_HEADER not in response.headers  # answered by the gateway itself


def test_a_photo_past_the_json_limit_reaches_a_replica_on_systemone_only(gateway):
    content_type, body = photo_multipart(PHOTO_BYTES)
    assert JSON_LIMIT < len(body) < PHOTO_LIMIT
    headers = {**AUTH, "Content-Type": content_type}
    photo = httpx.post(f"{gateway.url}/v1/systemone", content=body, headers=headers, timeout=60)
    assert refused_by_a_replica(photo), photo.text  # the replica read the photo and said why
    assert photo.headers[REPLICA_HEADER].startswith("least_load/")
    elsewhere = httpx.post(f"{gateway.url}/decide", content=body, headers=headers, timeout=60)
    assert elsewhere.status_code == 413 and elsewhere.json()["error"]["code"] == "body_too_large"
    assert REPLICA_HEADER not in elsewhere.headers


def test_systemone_bodies_past_their_limits_are_refused_at_the_gateway_in_typesafe_s_shape(gateway):
    content_type, body = photo_multipart(PHOTO_LIMIT + 1)
    over = httpx.post(
        f"{gateway.url}/v1/systemone",
        content=body,
        headers={**AUTH, "Content-Type": content_type},
        timeout=60,
    )
    assert too_large_for_systemone(over, PHOTO_LIMIT) and REPLICA_HEADER not in over.headers
    # A JSON body keeps the JSON limit there too (the service allows the photo limit to multipart only).
    json_body = httpx.post(
        f"{gateway.url}/v1/systemone",
        content=b"x" * (JSON_LIMIT + 1),
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=60,
    )
    assert too_large_for_systemone(json_body, JSON_LIMIT) and REPLICA_HEADER not in json_body.headers


def owner(replicas, gateway: Gateway, state: str):
    server = decide(gateway, state).headers[REPLICA_HEADER].split("/")[1]
    return replicas[int(server.removeprefix("semif"))]


def test_a_draining_replica_s_request_is_answered_by_another_without_the_client_seeing_503(replicas, gateway):
    state = STATES[5]
    draining = owner(replicas, gateway, state)
    draining.app.admission.draining = True
    try:
        # Before the health check notices: the replica refuses (503 draining), the gateway resends.
        response = decide(gateway, state)
        assert response.status_code == 200, response.text
        assert response.headers[REPLICA_HEADER] != f"by_state/semif{replicas.index(draining)}"
        # After it notices, every state is still answered, none by the draining replica.
        wait_until(lambda: len(ready_servers(gateway)) == 2)
        for other in STATES:
            answered = decide(gateway, other)
            assert answered.status_code == 200
            assert answered.headers[REPLICA_HEADER] != f"by_state/semif{replicas.index(draining)}"
    finally:
        draining.app.admission.draining = False
    wait_until(lambda: len(ready_servers(gateway)) == 3)


def test_a_busy_replica_s_429_reaches_the_client_with_its_retry_after(replicas, gateway):
    state = STATES[7]
    busy = owner(replicas, gateway, state)
    admission = busy.app.admission
    admission.in_progress += admission.max_queue
    try:
        response = decide(gateway, state)
    finally:
        admission.in_progress -= admission.max_queue
    assert response.status_code == 429
    assert response.headers["Retry-After"] == "1"


def test_when_a_replica_stops_only_its_states_move(replicas, gateway):
    before = placement(gateway)
    stopped = replicas[2]
    stopped.stop()
    wait_until(lambda: len(ready_servers(gateway)) == 2)
    after = placement(gateway)
    moved = {s for s in STATES if after[s] != before[s]}
    assert moved == {s for s in STATES if before[s] == "by_state/semif2"}
    assert moved, "no state lived on the stopped replica"


def test_a_body_near_the_limit_is_read_whole_for_its_state_and_reaches_a_replica(gateway):
    # ~1 MiB of state: the gateway buffers the whole body (tune.bufsize), hashes its state and
    # routes it as the header would; the replica, not the gateway, refuses it (the state's length).
    state = "All zones reported green after the rollout. " * 23000
    body = json.dumps(decision(state=state)).encode()
    assert 1_000_000 < len(body) <= 1048576
    by_header = decide(gateway, state)
    by_body = httpx.post(
        f"{gateway.url}/decide",
        content=body,
        timeout=60,
        headers={**AUTH, "Content-Type": "application/json"},
    )
    assert by_body.status_code == by_header.status_code == 422
    assert by_body.json()["error"]["field"] == "state"
    assert by_body.headers[REPLICA_HEADER] == by_header.headers[REPLICA_HEADER]
    assert by_body.headers[REPLICA_HEADER].startswith("by_state/")
