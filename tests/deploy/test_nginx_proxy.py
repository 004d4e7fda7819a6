"""stacks/semif-multi/nginx.conf run by the real nginx in front of a real replica of the app on
loopback: the body limits per path (a photo past the JSON limit reaches the replica on
/v1/systemone only) and the 413s in each door's envelope. Skips where nginx is not installed,
except in CI (.ci/run installs it).

The config is the stack's own, with only what cannot hold here rewritten: the replicas' names
(nothing resolves here) become the test replica's address, and the listen port, the pid, the
logs and the temporary directories move under the test's directory.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from harness.server import LoopbackServer, free_port
from semif_serve.app import create_app
from tests.support import TOKEN, decision
from tests.support.proxy_bodies import (
    JSON_LIMIT,
    PHOTO_BYTES,
    PHOTO_LIMIT,
    photo_multipart,
    refused_by_a_replica,
    too_large_for_systemone,
)

NGINX = shutil.which("nginx")
if NGINX is None:
    if os.environ.get("CI"):
        raise RuntimeError("nginx is not installed; .ci/run installs it")
    pytest.skip("nginx is not installed (.ci/run installs it)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
NGINX_CONF = ROOT / "stacks" / "semif-multi" / "nginx.conf"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def local_conf(text: str, replica_port: int, port: int, work: Path) -> str:
    """The stack's nginx.conf with its replicas at 127.0.0.1:replica_port, listening on `port`,
    its pid, logs and temporary files under `work`."""
    text = re.sub(r"(\bserver\s+)semif-gpu\d+:\d+", rf"\g<1>127.0.0.1:{replica_port}", text)
    text = re.sub(r"^(\s*)listen\s+8032;", rf"\g<1>listen 127.0.0.1:{port};", text, flags=re.M)
    text = re.sub(r"^pid\s+[^;]+;", f"pid {work / 'nginx.pid'};", text, flags=re.M)
    text = re.sub(r"^error_log\s+[^;]+;", f"error_log {work / 'error.log'} warn;", text, flags=re.M)
    text = text.replace(
        "access_log /dev/stdout upstreamlog;", f"access_log {work / 'access.log'} upstreamlog;"
    )
    temp = "".join(
        f"    {kind}_temp_path {work / kind};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    # Workers run as the master's user (root in CI containers: the default user could not write here).
    user = "user root;\n" if os.geteuid() == 0 else ""
    return user + text.replace("http {\n", "http {\n" + temp, 1)


@pytest.fixture(scope="module")
def proxy(service, tmp_path_factory):
    work = tmp_path_factory.mktemp("nginx")
    with LoopbackServer(create_app(service)) as replica:
        port = free_port()
        conf = work / "nginx.conf"
        conf.write_text(
            local_conf(NGINX_CONF.read_text(encoding="utf-8"), int(replica.url.rsplit(":", 1)[1]), port, work)
        )
        process = subprocess.Popen(
            [NGINX, "-p", str(work), "-c", str(conf), "-e", str(work / "error.log"), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + 15
            while True:
                assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
                with socket.socket() as probe:
                    if probe.connect_ex(("127.0.0.1", port)) == 0:
                        break
                assert time.monotonic() < deadline, "nginx did not start listening"
                time.sleep(0.05)
            yield f"http://127.0.0.1:{port}"
        finally:
            process.terminate()
            process.wait(timeout=15)


def test_a_decision_goes_through_nginx_to_the_replica(proxy):
    response = httpx.post(f"{proxy}/decide", json=decision(), headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["probabilities"]


def test_a_photo_past_the_json_limit_reaches_the_replica_on_systemone_only(proxy):
    content_type, body = photo_multipart(PHOTO_BYTES)
    assert JSON_LIMIT < len(body) < PHOTO_LIMIT
    headers = {**AUTH, "Content-Type": content_type}
    photo = httpx.post(f"{proxy}/v1/systemone", content=body, headers=headers, timeout=60)
    assert refused_by_a_replica(photo), photo.text  # the replica read the photo and said why
    elsewhere = httpx.post(f"{proxy}/decide", content=body, headers=headers, timeout=60)
    assert elsewhere.status_code == 413
    assert elsewhere.json()["error"]["code"] == "body_too_large"  # the service's envelope, from nginx
    assert "nginx" not in elsewhere.text


def test_systemone_bodies_past_their_limits_get_413_in_typesafe_s_shape(proxy):
    content_type, body = photo_multipart(PHOTO_LIMIT + 1)
    over = httpx.post(
        f"{proxy}/v1/systemone", content=body, headers={**AUTH, "Content-Type": content_type}, timeout=60
    )
    assert too_large_for_systemone(over, PHOTO_LIMIT), over.text
    # A JSON body past 1 MiB passes nginx (one limit per path there) and the service refuses it.
    json_body = httpx.post(
        f"{proxy}/v1/systemone",
        content=b"x" * (JSON_LIMIT + 1),
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=60,
    )
    assert too_large_for_systemone(json_body, JSON_LIMIT), json_body.text
