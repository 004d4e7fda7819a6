"""A request of rows alone through the worker, as a method hands it its jobs (`score_job`): the
engine tests' way to queue rows without a door or a method."""

from __future__ import annotations

import functools

from semif_serve.domain.requests import BASE, RowsRequest
from semif_serve.engine.rows import Readout, RowsJob
from semif_serve.engine.state_cache import state_digest
from semif_serve.engine.worker import EngineWorker


def rows_job(worker: EngineWorker, request: RowsRequest) -> RowsJob:
    """The job of `request`'s rows as SemIf's codec encodes them, over its state keyed as SemIf's
    method keys it (the served adapter's name; None: the base)."""
    images = [image.sha256 for image in request.images]
    bank = worker.engine.adapters
    model = None if request.adapter == BASE else bank.adapters[request.adapter].name
    prepare = functools.partial(worker.engine.prepare, request)
    return RowsJob(state_digest(request.state, images, model), prepare, images=bool(images))


async def score(worker: EngineWorker, request: RowsRequest) -> Readout:
    """The worker's readout of `request`'s rows, merged with whatever else is queued."""
    return await worker.score_job(rows_job(worker, request))
