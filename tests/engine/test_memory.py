"""The memory cap, the release policy, out-of-memory handling and splitting, on a simulated allocator."""

from __future__ import annotations

import asyncio
import gc
import weakref

import httpx
import pytest
import torch

from semif_serve.app import create_app
from semif_serve.domain.numerics import GIB, MIB
from semif_serve.domain.types import ConfigurationError, DecisionError, TooManyRows
from semif_serve.doors.base import refusal_of
from semif_serve.doors.native.api import NATIVE_ERRORS
from semif_serve.engine.memory import CudaMemory, ReleasePolicy
from semif_serve.engine.worker import EngineWorker
from semif_serve.service.startup import Service
from tests.support import TOKEN, decision, make_settings
from tests.support.memory_sim import SimulatedMemory, cuda_oom

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def service_on(engine, checkpoint, memory: SimulatedMemory, **settings) -> Service:
    """The real service and engine (shared weights) on a simulated device."""
    config = make_settings(checkpoint, **settings)
    return Service.start(config, engine=engine.with_options(memory=memory))


def post(app, url, body):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(url, json=body, headers=AUTH)

    return asyncio.run(go())


# -- the cap ----------------------------------------------------------------------------------


class FakeCuda:
    """torch.cuda's memory calls, recorded; the only stand-in for a GPU here."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.fractions: list[tuple[float, int]] = []

    def get_device_properties(self, index):
        return type("Props", (), {"total_memory": self.total})()

    def set_per_process_memory_fraction(self, fraction, device):
        self.fractions.append((fraction, device))


def test_the_cap_becomes_the_exact_fraction_of_the_card():
    cuda = FakeCuda(total=141 * GIB)
    fraction = CudaMemory(12, cuda=cuda).apply_cap()
    assert cuda.fractions == [(12 / 141, 0)]
    assert fraction == 12 / 141


@pytest.mark.parametrize("cap", [0, -1, 142])
def test_a_cap_of_zero_negative_or_above_the_card_is_a_startup_error(cap):
    cuda = FakeCuda(total=141 * GIB)
    with pytest.raises(ConfigurationError, match="SEMIF_VRAM_CAP_GIB"):
        CudaMemory(cap, cuda=cuda).apply_cap()
    assert cuda.fractions == []


# -- the release policy -------------------------------------------------------------------------


def test_no_release_below_the_margin_and_a_release_above_it():
    memory = SimulatedMemory(floor=100 * MIB)
    policy = ReleasePolicy(memory, margin_bytes=512 * MIB)
    policy.mark_baseline()
    releases = memory.releases
    memory.reserved = 100 * MIB + 512 * MIB  # exactly at the margin
    assert policy.after_success() is False
    assert memory.releases == releases
    memory.reserved += 1
    assert policy.after_success() is True
    assert memory.releases == releases + 1
    assert memory.reserved == 100 * MIB


def test_every_engine_failure_releases_but_a_refused_request_does_not(engine):
    memory = SimulatedMemory()
    worker = EngineWorker(engine, ReleasePolicy(memory, 512 * MIB))
    worker.policy.mark_baseline()
    before = memory.releases

    def refused():
        raise TooManyRows(65, 64)

    with pytest.raises(TooManyRows) as refusal:
        worker.run_now(refused)
    assert refusal_of(NATIVE_ERRORS, refusal.value, False, ()).status == 422
    assert memory.releases == before

    def broken():
        raise ValueError("something inside the forward")

    with pytest.raises(DecisionError) as failure:
        worker.run_now(broken)
    answer = refusal_of(NATIVE_ERRORS, failure.value, False, ())
    assert (answer.status, answer.code) == (500, "internal_error")
    assert failure.value.__cause__ is None and failure.value.__context__ is None
    assert memory.releases == before + 1


@pytest.mark.parametrize(
    "exc",
    [
        cuda_oom(""),
        cuda_oom("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("CUDA error: out of memory"),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
        MemoryError(),
    ],
    ids=["empty-oom", "oom", "runtime-error", "cublas-alloc", "cudnn-alloc", "host"],
)
def test_every_kind_of_out_of_memory_maps_to_503(exc, engine):
    memory = SimulatedMemory()
    worker = EngineWorker(engine, ReleasePolicy(memory, 0))

    def job():
        raise exc

    with pytest.raises(DecisionError) as failure:
        worker.run_now(job)
    answer = refusal_of(NATIVE_ERRORS, failure.value, False, ())
    assert (answer.status, answer.code) == (503, "out_of_memory")
    assert worker.out_of_memory_events == 1


def test_a_cublas_error_that_is_not_an_allocation_failure_stays_a_500(engine):
    worker = EngineWorker(engine, ReleasePolicy(SimulatedMemory(), 0))

    def job():
        raise RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx`")

    with pytest.raises(DecisionError) as failure:
        worker.run_now(job)
    answer = refusal_of(NATIVE_ERRORS, failure.value, False, ())
    assert (answer.status, answer.code) == (500, "internal_error")
    assert worker.out_of_memory_events == 0


def test_the_failed_forwards_memory_is_unreachable_before_the_release_runs(engine):
    memory = SimulatedMemory()
    worker = EngineWorker(engine, ReleasePolicy(memory, 0))
    seen: list[bool] = []

    class Activations:
        pass

    def job():
        activations = Activations()
        activations.cycle = activations  # only the gc frees a cycle
        handles.append(weakref.ref(activations))
        raise cuda_oom("")

    handles: list[weakref.ref] = []
    memory.on_release = lambda: seen.append(handles[0]() is None)
    gc.disable()
    try:
        with pytest.raises(DecisionError):
            worker.run_now(job)
    finally:
        gc.enable()
    assert seen == [True]


def test_a_release_that_itself_fails_does_not_mask_the_original_error(engine):
    memory = SimulatedMemory()

    def explode():
        raise RuntimeError("release failed")

    memory.on_release = explode
    worker = EngineWorker(engine, ReleasePolicy(memory, 0))

    def job():
        raise cuda_oom("")

    with pytest.raises(DecisionError) as failure:
        worker.run_now(job)
    assert refusal_of(NATIVE_ERRORS, failure.value, False, ()).code == "out_of_memory"


# -- through the real service -------------------------------------------------------------------


def test_an_out_of_memory_forward_gets_503_returns_to_baseline_and_the_next_request_is_answered(
    engine, checkpoint
):
    memory = SimulatedMemory(floor=100 * MIB, growth=300 * MIB)
    service = service_on(engine, checkpoint, memory)
    app = create_app(service)
    # The baseline counts what the state cache may hold; the allocator itself goes back to its floor.
    baseline = service.worker.policy.baseline_bytes - service.engine.cache.budget_bytes
    memory.fail_next = cuda_oom("")
    refused = post(app, "/decide", decision())
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "out_of_memory"
    assert memory.reserved == baseline
    answered = post(app, "/decide", decision())
    assert answered.status_code == 200
    # The answer may leave its state queued for an idle prefill, which the cache's budget covers.
    assert memory.reserved <= service.worker.policy.baseline_bytes + service.worker.policy.margin_bytes


def test_a_burst_that_grows_past_the_margin_is_given_back(engine, checkpoint):
    # One forward (one sync) past baseline (floor + the state cache's 1 GiB budget) + the 512 MiB margin.
    memory = SimulatedMemory(floor=100 * MIB, growth=1700 * MIB)
    service = service_on(engine, checkpoint, memory)
    app = create_app(service)
    before = memory.releases
    body = {"state": "s", "decisions": [decision(id=f"d{i}") for i in range(4)]}
    assert post(app, "/decide/shared", body).status_code == 200
    assert memory.releases > before
    assert memory.reserved == service.worker.policy.baseline_bytes - service.engine.cache.budget_bytes


def test_a_shared_request_over_the_memory_budget_is_split_and_equals_the_unsplit_answer(
    engine, checkpoint, service
):
    body = {
        "state": {"report": "Deployment finished; two of three zones are healthy."},
        "decisions": [decision(id=f"d{i}", question=f"Question {i}: is zone {i} healthy?") for i in range(5)],
    }
    unsplit = post(create_app(service), "/decide/shared", body).json()
    assert unsplit["timing"]["forward_batches"] == 1

    probe = service.engine.codec.encode_prompt(
        body["state"], "Question 0: is zone 0 healthy?", ("a", "b"), service.settings.max_input_tokens
    )
    prefix = len(service.engine.codec.state_prefix(body["state"], probe))
    width = len(probe.ids) - prefix + 8
    estimate = service.engine.estimate
    two_rows = estimate.prefill_bytes(prefix) + 2 * estimate.row_bytes(prefix, width) + 1
    # The cap also holds the state cache's budget, which the baseline counts.
    memory = SimulatedMemory(floor=0, cap=two_rows + service.engine.cache.budget_bytes)
    split_service = service_on(engine, checkpoint, memory)
    split = post(create_app(split_service), "/decide/shared", body).json()
    assert split["timing"]["forward_batches"] == 3
    for a, b in zip(unsplit["results"], split["results"], strict=True):
        assert a["id"] == b["id"]
        assert a["option_logits"] == pytest.approx(b["option_logits"], abs=1e-5)


def test_a_request_whose_single_row_cannot_fit_is_refused_with_the_memory_it_needs(engine, checkpoint):
    memory = SimulatedMemory(floor=0, cap=1)
    service = service_on(engine, checkpoint, memory)
    response = post(create_app(service), "/decide/shared", {"state": "s", "decisions": [decision()]})
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "too_large_for_memory"
    assert "GiB" in error["message"]


def test_a_failure_while_building_the_response_is_a_500_envelope_and_the_service_goes_on(
    service, monkeypatch
):
    import semif_serve.doors.native.api as native_module

    app = create_app(service)

    def broken(*args, **kwargs):
        raise KeyError(TOKEN)

    monkeypatch.setattr(native_module, "decision_result", broken)
    secret_state = "the secret state text"
    failed = post(app, "/decide", decision(state=secret_state))
    assert failed.status_code == 500
    assert failed.json()["error"]["code"] == "internal_error"
    assert TOKEN not in failed.text and secret_state not in failed.text
    monkeypatch.undo()
    assert post(app, "/decide", decision()).status_code == 200
    assert torch.is_grad_enabled()  # the engine left global torch state alone


# -- the estimate against what transformers allocates ------------------------------------------


def test_the_estimate_counts_the_key_value_copies_sdpa_makes_when_a_mask_is_passed(engine, monkeypatch):
    from transformers.integrations import sdpa_attention

    from semif_serve.engine.forwards import logits_over, prefill
    from semif_serve.engine.memory import MemoryEstimate
    from semif_serve.engine.state_cache import StateCache

    copies: list[int] = []
    repeat_kv = sdpa_attention.repeat_kv

    def recording(hidden, n_rep):
        out = repeat_kv(hidden, n_rep)
        if out is not hidden:
            copies.append(out.numel() * out.element_size())
        return out

    monkeypatch.setattr(sdpa_attention, "repeat_kv", recording)
    model = engine.model
    assert model.config._attn_implementation == "sdpa"
    prefix = list(range(1000, 1040))
    stored = StateCache(1 << 30).put(prefix, prefill(model, prefix))  # one chunk, no mask: GQA, no copy
    assert copies == []
    rows, width = 3, 7
    logits_over(model, stored.fork(rows), len(prefix), [list(range(5, 5 + width))] * rows, engine.pad_id)
    full_layers = model.config.layer_types.count("full_attention")
    assert len(copies) == 2 * full_layers  # keys and values, in every full-attention layer
    per_layer = max(copies[i] + copies[i + 1] for i in range(0, len(copies), 2))
    estimate = MemoryEstimate(model.config, next(model.parameters()).element_size())
    assert estimate.sdpa_copy_per_token * (len(prefix) + width) * rows == per_layer
    without_copies = estimate.row_bytes(len(prefix), width) - int(
        estimate.SAFETY * estimate.sdpa_copy_per_token * (len(prefix) + width)
    )
    assert estimate.row_bytes(len(prefix), width) > without_copies


def test_the_documented_capacity_table_is_what_the_estimate_gives():
    import re
    from pathlib import Path

    from transformers import Qwen3_5TextConfig

    from semif_serve.engine.memory import MemoryEstimate
    from semif_serve.tools.demo import QWEN35_4B_SHAPE

    text = (Path(__file__).resolve().parents[2] / "docs" / "memory.md").read_text(encoding="utf-8")
    documented = re.findall(r"^\| ~[\d,]+ \| ([\d,]+) \| (\d+) \| (\d+) \| (\d+) \| \d+ \|$", text, re.M)
    assert len(documented) == 4
    floor, budget, width, chunk = 7.85 * GIB, 1 * GIB, 43, 2048  # as the table's heading says
    estimate = MemoryEstimate(Qwen3_5TextConfig(**QWEN35_4B_SHAPE.text_config(248320)), 2)
    copies = estimate.sdpa_copy_per_token

    def rows(headroom: float, prefix: int, sdpa_copies: bool) -> int:
        estimate.sdpa_copy_per_token = copies if sdpa_copies else 0
        return estimate.rows_per_forward(int(headroom), prefix, width, chunk)

    for prefix, without_budget, with_budget, now in documented:
        prefix = int(prefix.replace(",", ""))
        assert rows(12 * GIB - floor, prefix, sdpa_copies=False) == int(without_budget)
        assert rows(12 * GIB - floor - budget, prefix, sdpa_copies=False) == int(with_budget)
        assert rows(12 * GIB - floor - budget, prefix, sdpa_copies=True) == int(now)
