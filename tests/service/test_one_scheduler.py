"""One scheduler for every method: lev's rows are jobs of the same batcher as SemIf's, so the
guarantees are the base's, shown by the same tests parametrised over both methods, through the
real app: requests in flight share forwards (counted in /metrics), each answer equals the same
request asked alone, and a tiny request beside a long prefill in steps is answered first."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from semif_serve.app import create_app
from semif_serve.service.startup import Service
from semif_serve.tools.lev_builder import write_lev_release
from tests.support import TOKEN, make_settings

AUTH = {"Authorization": f"Bearer {TOKEN}"}
MODELS = """
[models.lev-tiny]
release = "plain"
"""
STATE = "The March invoice was charged twice; the customer asked for a refund."
# The model each method is asked by: the base reads SemIf's method, lev-tiny lev's.
METHODS = {"semif": "jev-latest", "lev": "lev-tiny"}


@pytest.fixture(scope="module")
def models_file(checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("one-scheduler")
    write_lev_release(root / "plain", checkpoint, prompt_style="plain", seed=3)
    (root / "models.toml").write_text(MODELS)
    return root / "models.toml"


def service_over(engine, checkpoint, models_file, **settings) -> Service:
    return Service.start(make_settings(checkpoint, models=models_file, **settings), engine=engine)


def noul(i: int, model: str) -> dict:
    """A yes/no question; on the base asked once (lev reads its release's own orders)."""
    question = {"type": "noul", "instructions": f"Is statement {i} about the invoice true?"}
    return question if model != "jev-latest" else {**question, "x_orderings": "none"}


def body(model: str, i: int, state: str = STATE) -> dict:
    return {"model": model, "state": state, "questions": {"q": noul(i, model)}}


def forwards(metrics: str) -> float:
    line = next(line for line in metrics.splitlines() if line.startswith("semif_forwards_total "))
    return float(line.split()[1])


@pytest.mark.parametrize("method", list(METHODS))
def test_sixteen_requests_in_flight_share_forwards_counted_in_metrics_and_answer_as_alone(
    engine, checkpoint, models_file, method
):
    service = service_over(engine, checkpoint, models_file)
    app = create_app(service)
    model = METHODS[method]
    gate = threading.Event()

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as client:
            before = forwards((await client.get("/metrics")).text)
            busy = asyncio.ensure_future(service.worker.run(lambda: gate.wait(60)))  # the engine is busy
            asks = [
                asyncio.ensure_future(client.post("/v1/systemone", json=body(model, i), headers=AUTH))
                for i in range(16)
            ]
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 50
            # every request encoded and waiting for the busy engine (the busy job counts one)
            while service.worker.pending < 17 and loop.time() < deadline:
                await asyncio.sleep(0.01)
            queued = service.worker.pending - 1
            gate.set()
            await busy
            together = await asyncio.gather(*asks)
            after = forwards((await client.get("/metrics")).text)
            alone = [await client.post("/v1/systemone", json=body(model, i), headers=AUTH) for i in range(16)]
            return queued, before, after, together, alone

    queued, before, after, together, alone = asyncio.run(main())
    assert queued == 16
    assert all(r.status_code == 200 for r in together + alone), [
        r.text for r in together if r.status_code != 200
    ]
    assert 1 <= after - before < 16  # merged, and counted like the base's
    for got, want in zip(together, alone, strict=True):
        assert abs(got.json()["answers"]["q"]["noul"] - want.json()["answers"]["q"]["noul"]) < 1e-5


@pytest.mark.parametrize("method", list(METHODS))
def test_a_tiny_request_is_answered_while_a_long_state_of_either_method_is_prefilled_in_steps(
    engine, checkpoint, models_file, method
):
    service = service_over(engine, checkpoint, models_file, prefill_chunk_tokens=16, keep_state_tokens=64)
    app = create_app(service)
    long_state = "The zones recovered after the release, then the errors stopped for good. " * 30
    finished: list[str] = []
    started = threading.Event()
    real = service.worker.engine.run_group

    def recording(group):
        started.set()
        return real(group)

    service.worker.engine.run_group = recording  # type: ignore[method-assign]
    heavy = {**body(METHODS[method], 0, long_state)}
    heavy["questions"] = {
        f"q{i}": noul(i, METHODS[method]) for i in range(3)
    }  # rows over one prefix: prefilled once, in steps

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as client:

            async def ask(name: str, payload: dict) -> httpx.Response:
                reply = await client.post("/v1/systemone", json=payload, headers=AUTH)
                finished.append(name)
                return reply

            first = asyncio.ensure_future(ask("heavy", heavy))
            while not started.is_set():
                await asyncio.sleep(0.005)
            tiny = await ask("tiny", body("jev-latest", 1, "Short state."))
            return await first, tiny

    heavy_reply, tiny_reply = asyncio.run(asyncio.wait_for(main(), 240))
    assert heavy_reply.status_code == tiny_reply.status_code == 200, heavy_reply.text
    assert finished == ["tiny", "heavy"]
    assert heavy_reply.json()["x_timing"]["prefill"] == "fresh"  # its prefix prefilled once, in steps
