"""Many clients, many states: requests over different states share one forward whatever their
states, for every kind of served model (tests/support/served_models.py), through the real app.

Sixteen System One requests at the default orderings (a 4-option choice: several rows each), each
about a new state of its own, queued while the engine is busy, run in at most 4 forwards (counted
in /metrics), their shares in two lanes at once, and each answer equals the same request asked
alone; /metrics' per-forward histograms say what the forwards carried."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading

import httpx
import pytest

from semif_serve.app import create_app
from semif_serve.engine import batching as engine_batching
from tests.support import TOKEN
from tests.support.polling import wait_until_async
from tests.support.served_models import BASE, SERVED, SERVED_IDS, Served, serving, systemone_body

pytestmark = pytest.mark.service
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHOICE = {
    "type": "choice",
    "instructions": "Which team handles it?",
    "criteria": {"billing": "Billing problems.", "platform": None, "security": None, "support": None},
}
LEV = next(s for s in SERVED if s.id == "lev-release")


@pytest.fixture(scope="module")
def shared(engine, checkpoint, served_models):
    # Two intra-op threads for every forward, whatever the machine's load: a forward this large
    # then runs its shares in two lanes (engine/lanes.py), on every kind of model.
    with serving(engine, checkpoint, served_models, torch_threads=2) as service:
        yield service


def body(served: Served, i: int) -> dict:
    """A choice about a new state (a noul where the model answers no choice)."""
    state = f"Ticket {i}: the customer in region {i * 7} was charged twice for plan {i % 5}." + (
        " The second charge went through after the first was refunded." * 6
    )  # long enough that a forward of such states splits into lanes on every model
    question = CHOICE if served.asks("choice") else {"type": "noul", "instructions": "Is it billing's?"}
    return systemone_body(served, state, {"team": question})


def metric(metrics: str, name: str) -> float:
    line = next(line for line in metrics.splitlines() if line.startswith(name + " "))
    return float(line.split()[1])


def answers(reply: httpx.Response) -> dict[str, float]:
    """Each option's probability in the reply (a noul's P(true))."""
    answer = reply.json()["answers"]["team"]
    return answer["probabilities"] if answer["type"] == "choice" else {"true": answer["noul"]}


@contextlib.asynccontextmanager
async def engine_held(service):
    """A client of the real app, /metrics as it was, and a call that frees the engine, which a
    job holds busy until then (requests sent meanwhile queue behind it)."""
    gate = threading.Event()
    transport = httpx.ASGITransport(app=create_app(service))
    async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as client:
        before = (await client.get("/metrics")).text
        busy = asyncio.ensure_future(service.worker.run(lambda: gate.wait(60)))

        async def free() -> None:
            gate.set()
            await busy

        yield client, before, free


def together_then_alone(service, bodies: list[dict]):
    """`bodies` queued while the engine is busy, then freed at once; then each alone."""

    async def main():
        async with engine_held(service) as (client, before, free):
            asks = [asyncio.ensure_future(client.post("/v1/systemone", json=b, headers=AUTH)) for b in bodies]
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 50
            while service.worker.pending < len(bodies) + 1 and loop.time() < deadline:
                await asyncio.sleep(0.01)
            queued = service.worker.pending - 1
            await free()
            together = await asyncio.gather(*asks)
            after = (await client.get("/metrics")).text
            alone = [await client.post("/v1/systemone", json=b, headers=AUTH) for b in bodies]
            return queued, before, after, together, alone

    return asyncio.run(main())


def assert_answered_as_alone(together, alone) -> None:
    assert all(r.status_code == 200 for r in together + alone), [
        r.text for r in together if r.status_code != 200
    ]
    for a, b in zip(together, alone, strict=True):
        got, want = answers(a), answers(b)
        assert got.keys() == want.keys()
        assert max(abs(got[k] - want[k]) for k in got) < 1e-5


@pytest.mark.parametrize("served", SERVED, ids=SERVED_IDS)
def test_sixteen_requests_over_sixteen_new_states_run_in_at_most_four_forwards_and_answer_as_alone(
    shared, served
):
    queued, before, after, together, alone = together_then_alone(shared, [body(served, i) for i in range(16)])
    assert queued == 16
    assert_answered_as_alone(together, alone)
    forwards = metric(after, "semif_forwards_total") - metric(before, "semif_forwards_total")
    assert 1 <= forwards <= 4
    carried = metric(after, "semif_per_forward_requests_sum") - metric(
        before, "semif_per_forward_requests_sum"
    )
    assert carried >= 16  # every request counted in the forwards that carried it
    assert metric(after, "semif_per_forward_padding_share_sum") == metric(
        before, "semif_per_forward_padding_share_sum"
    )
    rows, sequences = (
        metric(after, f"semif_per_forward_{name}_sum") - metric(before, f"semif_per_forward_{name}_sum")
        for name in ("rows", "sequences")
    )
    assert rows == metric(after, "semif_forward_rows_total") - metric(before, "semif_forward_rows_total")
    if served.method == "semif":  # `choice=shifts` by default: min(n, 4) rows (contract.md)
        assert rows == 16 * len(CHOICE["criteria"])
    assert 1 <= sequences <= rows  # each sequence ends in a row it reads
    lanes = metric(after, "semif_per_forward_lanes_sum") - metric(before, "semif_per_forward_lanes_sum")
    assert forwards < lanes <= 2 * forwards  # a forward's shares ran in two lanes, and still answer as alone


def test_eight_lev_and_eight_base_requests_over_new_states_share_at_most_four_forwards(shared):
    bodies = [body(LEV if i % 2 else BASE, i) for i in range(16)]
    queued, before, after, together, alone = together_then_alone(shared, bodies)
    assert queued == 16
    assert_answered_as_alone(together, alone)
    assert 1 <= metric(after, "semif_forwards_total") - metric(before, "semif_forwards_total") <= 4
    # Replies of one forward share its time; each says how many requests that forward carried.
    forwards: dict[tuple[float, int], list[str]] = {}
    for i, reply in enumerate(together):
        timing = reply.json()["x_timing"]
        key = (timing["forward_seconds"], timing["merged_requests"])
        forwards.setdefault(key, []).append("lev" if i % 2 else "base")
    assert all(len(models) == merged for (_, merged), models in forwards.items())
    assert any({"lev", "base"} == set(models) for models in forwards.values())  # both in one forward


# The base and a PEFT adapter, each a flood of its own requests (lev's jobs take the same batcher's
# turns; a flood of lev's 16-question requests costs this suite ~30 s more).
FLOODED = [s for s in SERVED if s.id in ("base", "adapter")]


@pytest.mark.parametrize("served", FLOODED, ids=[s.id for s in FLOODED])
def test_a_small_request_during_a_flood_of_heavy_ones_waits_for_one_forward_then_runs_in_its_own(
    shared, served
):
    """Eight heavy requests (many rows over long new states, each past one forward's budget) in two
    waves, so two rounds are waiting; a one-row request that reaches the engine's queue while they
    run is answered after at most the forward running then and its own (counted in forwards, from
    its arrival), not after the other round's turn too."""
    service = shared
    app = create_app(service)
    gate = threading.Event()
    batcher = service.worker.batcher
    real = batcher.submit
    arrived: dict[str, int] = {}
    long_state = "The zones recovered after the release, then the errors stopped. " * 60

    def heavy(i: int) -> dict:
        questions = {f"q{k}": {**CHOICE, "instructions": f"Which team handles part {k}?"} for k in range(16)}
        return systemone_body(served, f"Flood {i}. " + long_state, questions)

    async def watched(job, wait=None):
        small = "Ticket 99" in job.payload.prompts[0].text
        if "Flood" in job.payload.prompts[0].text:
            arrived["heavy"] = arrived.get("heavy", 0) + 1
        if small:
            arrived["at"] = batcher.stats().forwards
        try:
            return await real(job, wait)
        finally:
            if small:
                arrived["answered"] = batcher.stats().forwards

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as client:
            busy = asyncio.ensure_future(service.worker.run(lambda: gate.wait(60)))
            flood = [
                asyncio.ensure_future(client.post("/v1/systemone", json=heavy(i), headers=AUTH))
                for i in range(4)
            ]
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 50
            while service.worker.pending < 5 and loop.time() < deadline:
                await asyncio.sleep(0.01)
            start = batcher.stats().forwards
            gate.set()
            await busy
            while batcher.stats().forwards == start and loop.time() < deadline:
                await asyncio.sleep(0.001)  # the first wave's first forward has run
            flood += [
                asyncio.ensure_future(client.post("/v1/systemone", json=heavy(i), headers=AUTH))
                for i in range(4, 8)
            ]
            while arrived.get("heavy", 0) < 8 and loop.time() < deadline:
                await asyncio.sleep(0.001)  # the second wave has reached the engine's queue
            second = batcher.stats().forwards
            while batcher.stats().forwards <= second + 1 and loop.time() < deadline:
                await asyncio.sleep(0.001)  # it is a round of its own, taking turns with the first
            tiny = await client.post("/v1/systemone", json=body(served, 99), headers=AUTH)
            replies = await asyncio.gather(*flood)
            return tiny, replies, batcher.stats().forwards

    bounds = batcher.bounds
    # Each heavy step past the budget, as a 3k-token state's prefill chunk is at the defaults.
    batcher.bounds = dataclasses.replace(bounds, max_forward_tokens=256)
    batcher.submit = watched  # type: ignore[method-assign]
    try:
        tiny, replies, end = asyncio.run(main())
    finally:
        batcher.submit = real  # type: ignore[method-assign]
        batcher.bounds = bounds
    assert tiny.status_code == 200 and all(r.status_code == 200 for r in replies)
    waited = arrived["answered"] - arrived["at"]
    assert end > arrived["answered"]  # the flood had forwards left when the small request was answered
    assert 1 <= waited <= 2  # the forward running when it came, then its own


def next_on_its_answer(service, served: Served, gather: float):
    """Client a's request runs; client b's queues behind it; a sends its next on its answer.
    The replies, /metrics before and after, and /health, with the gathering wait set to `gather`."""
    batcher = service.worker.batcher

    async def main():
        async with engine_held(service) as (client, before, free):

            async def client_a():
                first = await client.post("/v1/systemone", json=body(served, 200), headers=AUTH)
                return first, await client.post("/v1/systemone", json=body(served, 201), headers=AUTH)

            a = asyncio.ensure_future(client_a())
            # a's turn taken (waiting behind the engine's busy job), then b queued behind that turn;
            # a's job counted once submitted (`pending` counts it while it is still being encoded)
            await wait_until_async(
                lambda: batcher.admitted == 1 and batcher.queued == 0, what="a's turn taken"
            )
            b = asyncio.ensure_future(client.post("/v1/systemone", json=body(served, 202), headers=AUTH))
            await wait_until_async(lambda: batcher.queued == 1, what="b queued behind a's turn")
            await free()
            replies = [*await a, await b]
            after = (await client.get("/metrics")).text
            return replies, before, after, (await client.get("/health")).json()["batching"]

    bounds = batcher.bounds
    batcher.bounds = dataclasses.replace(bounds, max_gather_seconds=gather)
    try:
        return asyncio.run(main())
    finally:
        batcher.bounds = bounds


@pytest.mark.parametrize("served", SERVED, ids=SERVED_IDS)
def test_a_clients_next_request_sent_on_its_answer_shares_the_forward_of_the_request_waiting(
    shared, served, monkeypatch
):
    # A wait of up to the second set: the share of a's forward that also bounds it is
    # test_batching's; a's forward here is a tiny model's, shorter than a busy CI's HTTP round trip.
    monkeypatch.setattr(engine_batching, "GATHER_SHARE", 1e6)
    replies, before, after, batching = next_on_its_answer(shared, served, gather=1.0)
    assert [r.status_code for r in replies] == [200, 200, 200], [r.text for r in replies]

    def grew(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert batching["max_gather_seconds"] == 1.0
    assert grew("semif_forwards_total") == 2  # a's, then b's and a's next together
    assert grew("semif_merged_forwards_total") == 1
    assert (grew("semif_gathers_total"), grew("semif_gathered_requests_total")) == (1, 1)
    assert 0 < grew("semif_gather_seconds_total") < 1.0
    replies, before, after, batching = next_on_its_answer(shared, served, gather=0.0)
    assert [r.status_code for r in replies] == [200, 200, 200]
    assert grew("semif_forwards_total") == 3  # without the wait, one request a forward
    assert grew("semif_merged_forwards_total") == grew("semif_gathers_total") == 0
