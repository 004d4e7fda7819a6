"""The gateway's HAProxy config (stacks/semif-k8s/files/haproxy.cfg) run on loopback in front of
replicas at known ports: the same file as the chart's gateway, with its two DNS server-template
lines replaced by one `server` line per replica. Used by bench/multi_replica.py and
tests/deploy/test_gateway.py.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "stacks" / "semif-k8s" / "files" / "haproxy.cfg"
SERVER_TEMPLATE = re.compile(r"^(\s*)server-template semif .*$", re.M)
STATE_KEY_HEADER = "X-SemIf-State-Key"
REPLICA_HEADER = "X-SemIf-Replica"


def state_key(state: str) -> str:
    """The X-SemIf-State-Key a client sends: the lowercase hex SHA-256 of the state's UTF-8 bytes."""
    return hashlib.sha256(state.encode("utf-8")).hexdigest()


def config_with_servers(ports: Sequence[int], host: str = "127.0.0.1") -> str:
    """The gateway config with explicit replicas in place of the DNS-filled slots."""
    text = CONFIG.read_text(encoding="utf-8")
    found = SERVER_TEMPLATE.findall(text)
    assert len(found) == 2, "the config's two backends each fill their servers from one server-template"
    return SERVER_TEMPLATE.sub(
        lambda m: "\n".join(f"{m[1]}server semif{i} {host}:{port}" for i, port in enumerate(ports)), text
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Gateway:
    """haproxy in the foreground on a loopback port, in front of `ports`; stops on exit."""

    def __init__(
        self,
        ports: Sequence[int],
        workdir: Path,
        max_queue: int = 32,
        balance: int = 200,
        haproxy: str = "haproxy",
        config: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """`config`: a config text to run instead (its servers from DNS); `env`: more variables."""
        self.port = free_port()
        self.config = workdir / "haproxy.cfg"
        self.config.write_text(config or config_with_servers(ports), encoding="utf-8")
        self.log = workdir / "haproxy.log"
        self.env = {
            **os.environ,
            "SEMIF_GATEWAY_PORT": str(self.port),
            "SEMIF_GATEWAY_OPS_PORT": str(free_port()),
            "SEMIF_GATEWAY_MAX_QUEUE": str(max_queue),
            "SEMIF_GATEWAY_BALANCE": str(balance),
            **(env or {}),
        }
        self.haproxy = haproxy
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def check(self) -> subprocess.CompletedProcess:
        return subprocess.run(
            [self.haproxy, "-c", "-f", str(self.config)],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=30,
        )

    def __enter__(self) -> Gateway:
        checked = self.check()
        assert checked.returncode == 0, checked.stdout + checked.stderr
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [self.haproxy, "-db", "-f", str(self.config)],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 20
        while True:
            assert self.process.poll() is None, self.log.read_text()
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "haproxy did not listen"
                time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
