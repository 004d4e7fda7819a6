"""The same batch on a Ray cluster through Ray Data (`semif-serve run-batch --ray`; the optional
extra `semif-serve[ray]`).

The driver checks the input as the local run does (a repeated custom_id refuses the job, lines
already in the output are skipped), hands the remaining lines to Ray as a dataset (each its
line number and bytes), and `map_batches` runs them through `LineScorer` actors: one engine
each, started in the actor's `__init__` from the driver's settings (one GPU each where
SEMIF_DEVICE is cuda), answering a batch of lines exactly as the local run does (`BatchScorer`
over the real app). Results come back in input order and the driver writes them to the output
with the local run's writer, so both runs write the same lines.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from semif_serve.batch.job import BatchFiles, plan
from semif_serve.batch.lines import parse_line, read_lines
from semif_serve.batch.progress import Progress, Summary
from semif_serve.batch.runner import BatchScorer, Pacing, ResultWriter
from semif_serve.service.settings import Settings

#: Set on every Ray worker of the job: nothing is downloaded there either.
OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "SEMIF_CPU_KERNELS")


@dataclass(frozen=True)
class RayPlan:
    """Where and how wide: the cluster's address (None: RAY_ADDRESS, else a local cluster), the
    engines (actors), the lines handed to an actor at once, and the GPUs per actor (None: one
    where SEMIF_DEVICE is cuda, else none)."""

    address: str | None = None
    num_actors: int = 1
    batch_size: int = 64
    gpus: float | None = None

    def gpus_for(self, settings: Settings) -> float:
        """GPUs each actor asks the cluster for."""
        if self.gpus is not None:
            return self.gpus
        return 1.0 if settings.device.startswith("cuda") else 0.0


class LineScorer:
    """A Ray Data actor: the real service started once in `__init__`, a batch of lines answered
    per call (`{"line", "raw"}` in, `{"line", "result"}` out, each result one output line's JSON)."""

    def __init__(self, settings: Settings, pacing: Pacing) -> None:
        from semif_serve.service.startup import Service

        self.scorer = BatchScorer(Service.start(settings))
        self.pacing = pacing
        self.loop = asyncio.new_event_loop()

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[Any]]:
        lines = [parse_line(int(n), bytes(raw)) for n, raw in zip(batch["line"], batch["raw"], strict=True)]
        results: list[dict[str, Any]] = []
        self.loop.run_until_complete(self.scorer.score([lines], results.extend, self.pacing))
        return {
            "line": [line.number for line in lines],
            "result": [json.dumps(result, ensure_ascii=False) for result in results],
        }


def _pending(path: Path, finished: set[str]) -> Iterator[dict[str, Any]]:
    with path.open("rb") as source:
        for number, raw in read_lines(source):
            if parse_line(number, raw).id not in finished:
                yield {"line": number, "raw": raw}


def score_on_ray(
    settings: Settings, files: BatchFiles, pacing: Pacing, where: RayPlan, bar: bool | None = None
) -> Summary:
    """The whole job on Ray: check the input, score what is left on `where.num_actors` engines,
    write every result (in input order) to the output. Raises DuplicateCustomId before Ray starts."""
    import ray

    with files.readable_input() as path:
        checked = plan(path, files)
        env = {name: os.environ[name] for name in OFFLINE_ENV if name in os.environ}
        ray.init(address=where.address, runtime_env={"env_vars": env}, log_to_driver=False)
        progress = Progress(checked.summary(), sys.stderr, bar=bar)
        try:
            context = ray.data.DataContext.get_current()
            context.execution_options.preserve_order = True  # results in input order
            context.enable_progress_bars = False  # ours counts lines
            items = list(_pending(path, checked.finished))
            if items:
                dataset = ray.data.from_items(items).map_batches(
                    LineScorer,
                    fn_constructor_kwargs={"settings": settings, "pacing": pacing},
                    batch_size=where.batch_size,
                    concurrency=where.num_actors,
                    num_gpus=where.gpus_for(settings),
                    batch_format="numpy",
                )
                with files.appendable_output() as out:
                    writer = ResultWriter(out)
                    for scored in dataset.iter_batches(batch_size=where.batch_size, batch_format="numpy"):
                        results = [json.loads(text) for text in scored["result"]]
                        writer(results)
                        for result in results:
                            progress(result)
        finally:
            progress.close()
            ray.shutdown()
    return progress.summary
