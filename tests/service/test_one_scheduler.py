"""One scheduler for every method: lev's rows are jobs of the same batcher as SemIf's, so the
guarantees are the base's, shown by the same tests parametrised over every kind of served model
(tests/support/served_models.py), through the real app: requests in flight share forwards
(counted in /metrics), each answer equals the same request asked alone, and a tiny request
beside a long prefill in steps is answered first."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from semif_serve.app import create_app
from tests.support import TOKEN
from tests.support.served_models import SERVED, SERVED_IDS, Served, noul, serving, systemone_body

AUTH = {"Authorization": f"Bearer {TOKEN}"}
STATE = "The March invoice was charged twice; the customer asked for a refund."


def body(served: Served, i: int, state: str = STATE) -> dict:
    return systemone_body(served, state, {"q": noul(served, f"Is statement {i} about the invoice true?")})


def forwards(metrics: str) -> float:
    line = next(line for line in metrics.splitlines() if line.startswith("semif_forwards_total "))
    return float(line.split()[1])


@pytest.fixture(scope="module")
def shared(engine, checkpoint, served_models):
    with serving(engine, checkpoint, served_models) as service:
        yield service


@pytest.fixture(scope="module")
def stepped(engine, checkpoint, served_models):
    """Long states prefilled 16 tokens a step."""
    with serving(engine, checkpoint, served_models, prefill_chunk_tokens=16, keep_state_tokens=64) as service:
        yield service


@pytest.mark.parametrize("served", SERVED, ids=SERVED_IDS)
def test_sixteen_requests_in_flight_share_forwards_counted_in_metrics_and_answer_as_alone(shared, served):
    service = shared
    app = create_app(service)
    gate = threading.Event()

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as client:
            before = forwards((await client.get("/metrics")).text)
            busy = asyncio.ensure_future(service.worker.run(lambda: gate.wait(60)))  # the engine is busy
            asks = [
                asyncio.ensure_future(client.post("/v1/systemone", json=body(served, i), headers=AUTH))
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
            alone = [
                await client.post("/v1/systemone", json=body(served, i), headers=AUTH) for i in range(16)
            ]
            return queued, before, after, together, alone

    queued, before, after, together, alone = asyncio.run(main())
    assert queued == 16
    assert all(r.status_code == 200 for r in together + alone), [
        r.text for r in together if r.status_code != 200
    ]
    assert 1 <= after - before < 16  # merged, and counted like the base's
    for got, want in zip(together, alone, strict=True):
        assert abs(got.json()["answers"]["q"]["noul"] - want.json()["answers"]["q"]["noul"]) < 1e-5


# Each model is the long one once and the tiny one once (beside the next model's long state).
BESIDE = [(SERVED[i], SERVED[(i + 1) % len(SERVED)]) for i in range(len(SERVED))]


@pytest.mark.parametrize(
    ("heavy_model", "tiny_model"), BESIDE, ids=[f"{h.id}-long-{t.id}-tiny" for h, t in BESIDE]
)
def test_a_tiny_request_is_answered_while_a_long_state_of_any_model_is_prefilled_in_steps(
    stepped, monkeypatch, heavy_model, tiny_model
):
    service = stepped
    app = create_app(service)
    long_state = f"The zones of {heavy_model.id} recovered after the release, then the errors stopped. " * 30
    finished: list[str] = []
    started = threading.Event()
    real = service.worker.engine.run_groups

    def recording(groups):
        started.set()
        return real(groups)

    monkeypatch.setattr(service.worker.engine, "run_groups", recording)
    questions = {f"q{i}": noul(heavy_model, f"Is statement {i} true?") for i in range(3)}
    heavy = systemone_body(
        heavy_model, long_state, questions
    )  # rows over one prefix: prefilled once, in steps

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
            tiny = await ask("tiny", body(tiny_model, 1, "Short state."))
            return await first, tiny

    heavy_reply, tiny_reply = asyncio.run(asyncio.wait_for(main(), 240))
    assert heavy_reply.status_code == tiny_reply.status_code == 200, heavy_reply.text
    assert finished == ["tiny", "heavy"]
    assert heavy_reply.json()["x_timing"]["prefill"] == "fresh"  # its prefix prefilled once, in steps
