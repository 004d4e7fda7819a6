"""The cost of System One's default orderings policy against asking every question once.

    uv run python bench/systemone_orderings.py [--runs N]

In-process, on the bench checkpoint (bench/run.py: Qwen3.5's layer mix, hidden 384, the real
vocabulary): a typical request (a noul, a choice of 8, a score of 5) over a ~1,000-token state,
under `SEMIF_SYSTEMONE_ORDERINGS=none` and under the default, median wall time of the request.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import httpx

from bench.run import bench_checkpoint
from semif_serve.app import create_app
from semif_serve.service.settings import DEFAULT_SYSTEMONE_ORDERINGS, Settings
from semif_serve.service.startup import Service
from semif_serve.tools.demo import DEMO_REVISION

TOKEN = "bench-token-0123456789"
STATE = "The customer wrote in about a double charge on the March invoice and a failed refund. " * 60
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Is the customer asking for a refund?"},
    "queue": {
        "type": "choice",
        "criteria": {f"queue {i}": f"Queue {i} handles this kind of ticket." for i in range(8)},
    },
    "urgency": {"type": "score", "criteria": ["none", "low", "medium", "high", "critical"]},
}


def median_seconds(policy: str, runs: int, checkpoint: Path) -> tuple[float, int]:
    settings = Settings(
        model_path=checkpoint,
        model_revision=DEMO_REVISION,
        device="cpu",
        api_token=TOKEN,
        systemone_orderings=policy,
    )
    app = create_app(Service.start(settings))
    body = {"model": "jev-latest", "state": STATE, "questions": QUESTIONS}

    async def go() -> tuple[list[float], int]:
        transport = httpx.ASGITransport(app=app)
        times = []
        async with httpx.AsyncClient(transport=transport, base_url="http://b", timeout=600) as client:
            for _ in range(runs + 1):
                t0 = time.perf_counter()
                response = await client.post(
                    "/v1/systemone", json=body, headers={"Authorization": f"Bearer {TOKEN}"}
                )
                times.append(time.perf_counter() - t0)
                assert response.status_code == 200, response.text
                rows = sum(a["x_semif"]["rows"] for a in response.json()["answers"].values())
        return times[1:], rows  # the first request warms up

    times, rows = asyncio.run(go())
    return statistics.median(times), rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    checkpoint = bench_checkpoint()
    base, base_rows = median_seconds("none", args.runs, checkpoint)
    averaged, rows = median_seconds(DEFAULT_SYSTEMONE_ORDERINGS, args.runs, checkpoint)
    print(f"none: {base_rows} rows, median {base * 1000:.0f} ms")
    print(
        f"{DEFAULT_SYSTEMONE_ORDERINGS}: {rows} rows, "
        f"median {averaged * 1000:.0f} ms ({averaged / base:.2f}x)"
    )


if __name__ == "__main__":
    main()
