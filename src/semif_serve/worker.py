"""The one worker that owns the engine: jobs arrive through a queue, one forward at a time,
off the event loop; every failure is mapped, released and re-raised unchained."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from .domain import DecisionError, EngineFailure, OutOfMemory, Refusal
from .memory import ReleasePolicy

log = logging.getLogger("semif_serve.worker")
T = TypeVar("T")


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA OOM (whatever its message), a RuntimeError saying 'out of memory', or a host MemoryError."""
    if isinstance(exc, MemoryError):
        return True
    try:
        import torch

        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return True
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def classify_failure(exc: BaseException) -> DecisionError:
    """The domain error for an engine failure; carries no traceback and no request text."""
    if is_out_of_memory(exc):
        return OutOfMemory()
    return EngineFailure()


class EngineWorker:
    """Runs engine jobs one at a time on a dedicated thread."""

    def __init__(self, policy: ReleasePolicy) -> None:
        self.policy = policy
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="semif-engine")
        self.pending = 0
        self.out_of_memory_events = 0

    async def run(self, job: Callable[[], T]) -> T:
        """Run `job` on the engine thread; a cancelled caller's job is skipped if not yet started."""
        loop = asyncio.get_running_loop()
        self.pending += 1
        try:
            return await loop.run_in_executor(self._executor, self._guarded, job)
        finally:
            self.pending -= 1

    def run_now(self, job: Callable[[], T]) -> T:
        """Run `job` synchronously through the same guard (startup warm-up)."""
        return self._guarded(job)

    def _guarded(self, job: Callable[[], T]) -> T:
        failure: DecisionError | None = None
        try:
            result = job()
        except Refusal:
            raise  # the request was refused before anything ran that needs releasing
        except Exception as exc:  # noqa: BLE001 - every engine failure becomes a domain error
            failure = classify_failure(exc)
            log.error("engine failure: %s", type(exc).__name__)
        if failure is None:
            self.policy.after_success()
            return result
        # The original exception and its frames (which hold activations) are gone by now.
        if isinstance(failure, OutOfMemory):
            self.out_of_memory_events += 1
        self.policy.after_failure()
        raise failure from None

    def shutdown(self) -> None:
        """Stop the thread after the running job."""
        self._executor.shutdown(wait=True, cancel_futures=True)
