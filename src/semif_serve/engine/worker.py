"""The one worker that owns the engine: requests are encoded off the event loop (each on a thread
of its own, so none waits for another's tokenising), queued, and
merged into as few forwards as fit whenever the engine thread is free (`batching.Batcher`);
every failure is mapped, released and re-raised unchained, and a failed merged forward is
retried request by request so that only the failing request fails."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from semif_serve.domain.types import DecisionError, EngineFailure, EngineWait, OutOfMemory, Refusal
from semif_serve.engine.batching import Batcher, Bounds, Group, Unfinished, Wait
from semif_serve.engine.memory import ReleasePolicy
from semif_serve.engine.rows import RowsJob

if TYPE_CHECKING:
    from semif_serve.engine.rows import PreparedRows, Readout, ScoredRow
    from semif_serve.engine.runner import TorchEngine

log = logging.getLogger("semif_serve.worker")
T = TypeVar("T")
ENCODERS = 32  # encoder threads where the caller gives none (the service gives SEMIF_MAX_QUEUE)


# How cuBLAS and cuDNN report a failed workspace or handle allocation (a RuntimeError, not an OOM).
_ALLOCATION_FAILURES = ("out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed")


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA OOM (whatever its message), a RuntimeError saying 'out of memory' or carrying a cuBLAS
    or cuDNN allocation failure (CUBLAS_STATUS_ALLOC_FAILED), or a host MemoryError."""
    if isinstance(exc, MemoryError):
        return True
    try:
        import torch

        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return True
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    message = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(failure in message for failure in _ALLOCATION_FAILURES)


def classify_failure(exc: BaseException) -> DecisionError:
    """The domain error for an engine failure; carries no traceback and no request text."""
    if is_out_of_memory(exc):
        return OutOfMemory()
    return EngineFailure()


class EngineWorker:
    """Runs its engine's jobs one at a time on a dedicated thread; merges queued requests' rows.
    Bound to one engine when built: every request it scores, and its idle work, are that engine's."""

    def __init__(
        self,
        engine: TorchEngine,
        policy: ReleasePolicy,
        bounds: Bounds | None = None,
        encoders: int = ENCODERS,
    ) -> None:
        self.engine = engine
        self.policy = policy
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="semif-engine")
        # Requests are encoded (and refused) before they join a group, each on its own thread while
        # at most `encoders` are in flight (the tokenizer releases the GIL, so they share the CPU).
        self._encoder = ThreadPoolExecutor(max_workers=encoders, thread_name_prefix="semif-encode")
        # Requests with images are prepared one at a time: decoded pixels' memory stays one request's.
        self._image_encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="semif-images")
        self.batcher: Batcher[PreparedRows, ScoredRow] = Batcher(
            None, bounds or Bounds(), self._executor, run_groups=self._run_groups, cost=engine.forward_cost
        )  # no idle work: nothing is prefilled for a request that may never come
        self._job_ids = itertools.count()
        self.pending = 0
        self.out_of_memory_events = 0

    async def score_job(self, job: RowsJob) -> Readout:
        """The engine's readout of one job's rows, merged with whatever else is queued when the
        engine is free; the numbers are those of the job alone. `job.prepare` makes its rows on
        an encoder thread (the one image thread for a job with images); `job.demand_key` names
        the state they read, so a lone row sees that others want it too. A cancelled caller's
        rows are dropped before their forward."""
        encoder = self._image_encoder if job.images else self._encoder
        return await self._scored(job.demand_key, encoder, job.prepare)

    async def _scored(
        self, demand_key: str, encoder: ThreadPoolExecutor, prepare: Callable[[], PreparedRows]
    ) -> Readout:
        loop = asyncio.get_running_loop()
        engine = self.engine
        self.pending += 1
        # Counted from before encoding, so a lone row can see that others want its state too.
        engine.cache.demand.enter(demand_key)
        try:
            prepared = await loop.run_in_executor(encoder, prepare)
            prepared = dataclasses.replace(prepared, demand_key=demand_key)
            wait = Wait()
            scored = await self.batcher.submit(prepared.job(next(self._job_ids)), wait)
            waited = EngineWait(wait.seconds)
            return dataclasses.replace(engine.readout(prepared, scored), wait=waited)
        finally:
            engine.cache.demand.leave(demand_key)
            self.pending -= 1

    def _run_groups(
        self, groups: Sequence[Group[PreparedRows]]
    ) -> Sequence[Mapping[Hashable, Sequence[ScoredRow]] | Unfinished]:
        return self._guarded(lambda: self.engine.run_groups(groups))

    async def run(self, job: Callable[[], T]) -> T:
        """Run `job` on the engine thread; a cancelled caller's job is skipped if not yet started."""
        loop = asyncio.get_running_loop()
        self.pending += 1
        try:
            return await loop.run_in_executor(self._executor, self._guarded, job)
        finally:
            self.pending -= 1

    def run_now(self, job: Callable[[], T]) -> T:
        """Run `job` on the engine thread through the same guard and wait for it (startup warm-up):
        a forward on the caller's thread would give OpenMP a second team of threads, and with more
        of its threads than cores it stops spinning between parallel ops (every op then waits for
        a sleeping thread to wake; measured: a ~1k-token prefill ~30% slower)."""
        return self._executor.submit(self._guarded, job).result()

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
        """Stop the threads after the running job."""
        self._encoder.shutdown(wait=True, cancel_futures=True)
        self._image_encoder.shutdown(wait=True, cancel_futures=True)
        self._executor.shutdown(wait=True, cancel_futures=True)
