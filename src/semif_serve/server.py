"""Running the app under uvicorn, with a drain on SIGTERM.

The first SIGTERM/SIGINT stops admitting (new POSTs get 503 draining, /health says
draining so a load balancer takes the replica out) while the socket stays open; in-flight
requests finish within SEMIF_SHUTDOWN_GRACE_SECONDS; then uvicorn shuts down. A second
signal exits at once.
"""

from __future__ import annotations

import logging
import time

import uvicorn

log = logging.getLogger("semif_serve.server")


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that drains before it stops listening."""

    def __init__(self, config: uvicorn.Config, admission, grace_seconds: float) -> None:
        super().__init__(config)
        self.admission = admission
        self.grace_seconds = grace_seconds
        self.drain_deadline: float | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.drain_deadline is not None:
            super().handle_exit(sig, frame)  # a second signal: stop now
            return
        self.admission.draining = True
        self.drain_deadline = time.monotonic() + self.grace_seconds
        log.info(
            "draining: refusing new requests",
            extra={"in_progress": self.admission.in_progress, "grace_seconds": self.grace_seconds},
        )

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            if self.admission.in_progress == 0 or time.monotonic() >= self.drain_deadline:
                log.info("drained", extra={"left_in_progress": self.admission.in_progress})
                self.should_exit = True
        return await super().on_tick(counter)


def run_server(app, host: str, port: int, grace_seconds: float) -> None:
    """Serve `app` (from create_app) until drained."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=max(1, int(grace_seconds)),
    )
    DrainingServer(config, app.admission, grace_seconds).run()
