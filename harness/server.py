"""Starting a real semif-serve on a loopback port, for the tests, the benchmarks and
`gpu_run`: in a thread of this process, or as a child process (its own GIL and RSS)."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A port nothing listens on right now (the child binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


class LoopbackServer:
    """A real uvicorn serving `app` on 127.0.0.1 in a background thread."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        config = uvicorn.Config(app, host=LOOPBACK, port=0, log_config=None, access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="loopback-uvicorn", daemon=True)
        self.url = ""

    def __enter__(self) -> LoopbackServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the loopback server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{LOOPBACK}:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def wait_healthy(
    url: str, process: subprocess.Popen, seconds: float, exited: Callable[[], str], late: str
) -> None:
    """Until `url`/health answers 200: RuntimeError(`exited()`) if the process ends first,
    RuntimeError(`late`) after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(exited())
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(late)


def stop_process(process: subprocess.Popen, grace: float = 30.0) -> None:
    """End a child server: SIGTERM (its drain), then SIGKILL after `grace` seconds."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


class ServiceProcess:
    """`semif-serve serve` as a child process on a free loopback port, configured through SEMIF_*.

    Waits for /health to report ready (startup loads and warms up the model). The token is
    random per process and written to `token_file` for the acceptance commands.
    """

    def __init__(
        self,
        model_path: Path,
        revision: str,
        settings: Mapping[str, Any],
        work_dir: Path,
        startup_timeout: float = 600.0,
        log_name: str = "service.log",
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.token = "acc-" + secrets.token_urlsafe(24)
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.token_file = self.work_dir / "token"
        self.log_path = self.work_dir / log_name
        self.startup_timeout = startup_timeout
        env = {k: v for k, v in os.environ.items() if not k.startswith("SEMIF_")}
        env.update(
            SEMIF_MODEL_PATH=str(model_path),
            SEMIF_MODEL_REVISION=revision,
            SEMIF_HOST=LOOPBACK,
            SEMIF_PORT=str(self.port),
            SEMIF_API_TOKEN_FILE=str(self.token_file),
        )
        env.update({f"SEMIF_{k.upper()}": str(v) for k, v in settings.items()})
        env.update(extra_env or {})
        self.env = env
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> ServiceProcess:
        self.token_file.write_text(self.token + "\n", encoding="utf-8")
        self.token_file.chmod(0o600)
        self._log = open(self.log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed in __exit__
        self.process = subprocess.Popen(
            [sys.executable, "-m", "semif_serve.tools.cli", "serve"],
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        wait_healthy(
            self.url,
            self.process,
            self.startup_timeout,
            lambda: (
                f"semif-serve exited with {self.process.returncode} during startup; "
                f"see {self.log_path}:\n{self.tail()}"
            ),
            f"semif-serve was not ready within {self.startup_timeout:.0f} s; see {self.log_path}",
        )

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(
                self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]
            )
        except OSError:
            return ""

    @property
    def pid(self) -> int:
        return self.process.pid

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            stop_process(self.process)
        self._log.close()


def read_rss(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS since start or since `reset_peak_rss`) of a process, in bytes."""
    values = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024
    return values


def reset_peak_rss(pid: int) -> bool:
    """Reset the kernel's peak-RSS mark of a process we own (`clear_refs` 5); False if not allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
        return True
    except OSError:
        return False
