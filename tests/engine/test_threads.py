"""The thread policy (engine.threads): a forward's intra-op threads from its size and the free
cores, each Linear's raised count inside a forward kept on fewer, the operator's pin respected,
over the real engine and the tiny checkpoint."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from semif_serve.domain.requests import RowsRequest
from semif_serve.domain.types import PromptRow
from semif_serve.engine import threads as engine_threads
from semif_serve.engine.threads import (
    EngineThreads,
    LinearHooks,
    OtherLoad,
    ThreadPolicy,
    pinned_threads,
)

TOL = 1e-5
ROWS = [PromptRow(f"Which team owns step {i}?", ("platform", "payments", "search")) for i in range(4)]


class FixedLoad(OtherLoad):
    """Others keep `busy` cores busy, whatever /proc says."""

    def __init__(self, busy: float) -> None:
        super().__init__()
        self.busy = busy

    def busy_cores(self) -> float:
        return self.busy


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def no_running_forward():
    """`EngineThreads.use` leaves its forward on the calling thread: none is left to later tests."""
    yield
    engine_threads._RUNNING.forward = None


def test_the_operator_pins_with_the_setting_or_the_openmp_variables():
    assert pinned_threads(3, {"OMP_NUM_THREADS": "1"}) == 3  # SEMIF_TORCH_THREADS first
    assert pinned_threads(None, {"OMP_NUM_THREADS": "2"}) == 2
    assert pinned_threads(None, {"MKL_NUM_THREADS": "4"}) == 4
    assert pinned_threads(None, {"OMP_NUM_THREADS": "", "MKL_NUM_THREADS": "x"}) is None
    assert pinned_threads(None, {}) is None


def test_small_forwards_take_one_thread_long_ones_every_free_core():
    policy = ThreadPolicy(cores=8, parallel_tokens=100)
    assert policy.wanted(60) == 1
    assert policy.wanted(250) == 2  # one thread per 100 tokens computed
    assert policy.wanted(10_000) == 8  # never more than the cores
    assert policy.wanted(10_000, others_busy=2.9) == 5  # what others hold is not ours
    assert policy.wanted(10_000, others_busy=0.2) == 8  # a sliver of a core is not held
    assert policy.wanted(10_000, others_busy=50.0) == 1
    assert ThreadPolicy(cores=8, pinned=3).wanted(10) == 3


def test_another_process_burning_a_core_counts_as_busy():
    load = OtherLoad()
    load.busy_cores()
    burner = subprocess.Popen(
        [sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<1.5: pass"]
    )
    try:
        time.sleep(1.2)
        others = load.busy_cores()
    finally:
        burner.wait()
    assert others >= 0.3  # the burner's share of a core (the machine is shared: not a whole one)


class ScriptedReadings(OtherLoad):
    """/proc's counters as the test writes them: (seconds, busy ticks of all, ticks of this process)."""

    def __init__(self, readings: list[tuple[float, int, int]]) -> None:
        super().__init__()
        self.readings = readings
        self._ticks = 100

    def _read(self) -> tuple[float, int, int] | None:
        return self.readings.pop(0)


def test_a_reading_over_a_stopped_stretch_leaves_the_estimate_as_it_was():
    load = ScriptedReadings([(0.0, 0, 0), (0.5, 50, 0), (30.0, 3050, 0), (30.5, 3055, 5)])
    load.busy_cores()
    assert load.busy_cores() == pytest.approx(1.0)  # others used 50 ticks of 50: one core
    assert load.busy_cores() == pytest.approx(1.0)  # 30 s unseen (stopped): says nothing of now
    assert load.busy_cores() == pytest.approx(0.0)  # the next half second is read again


class CountingLoad(OtherLoad):
    """Others keep one core busy; counts how often it was read."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def busy_cores(self) -> float:
        self.reads += 1
        return 1.0


def test_the_load_is_sampled_by_its_own_thread_and_a_forward_only_reads_the_last_value():
    inner = CountingLoad()
    sampled = engine_threads.SampledLoad(inner, period=0.01)
    deadline = time.monotonic() + 5
    while inner.reads < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert inner.reads >= 3  # read without any forward asking
    reads = inner.reads
    assert [sampled.busy_cores() for _ in range(1000)] == [1.0] * 1000
    assert inner.reads - reads < 1000  # the forward's reads did not read /proc


def test_the_engine_sets_its_threads_per_forward_and_reads_the_same_numbers(engine, restore_threads):
    torch.set_num_threads(1)
    request = RowsRequest.of({"log": "deploy 7 finished"}, ROWS, shared=True, max_input_tokens=4096)
    pinned = engine.with_options(threads=ThreadPolicy(cores=2, pinned=1))
    reference = pinned.read(request)
    assert pinned.threads is not None and pinned.threads.switches == 0 and torch.get_num_threads() == 1
    adaptive = engine.with_options(threads=ThreadPolicy(cores=2, parallel_tokens=8))
    assert adaptive.threads is not None
    adaptive.threads.load = FixedLoad(0.0)
    wide = adaptive.read(request)
    assert torch.get_num_threads() == 2 and adaptive.threads.switches == 1  # its rows are many tokens
    for a, b in zip(reference.rows, wide.rows, strict=True):
        assert max(abs(x - y) for x, y in zip(a.option_logits, b.option_logits, strict=True)) <= TOL
    narrow = dataclasses.replace(adaptive.options.threads, parallel_tokens=10**9)
    adaptive.threads.policy = narrow
    adaptive.read(request)
    assert torch.get_num_threads() == 1 and adaptive.threads.switches == 2
    adaptive.read(request)
    assert adaptive.threads.switches == 2  # set only when the wanted count changes


def test_a_pinned_policy_sets_its_count_once_per_thread_and_never_again(restore_threads):
    torch.set_num_threads(1)
    threads = EngineThreads(ThreadPolicy(cores=4, pinned=2), torch, FixedLoad(0.0))
    assert threads.use(10**6) == 2 and torch.get_num_threads() == 2 and threads.switches == 1
    assert threads.use(1) == 2 and threads.switches == 1


def test_the_count_is_set_on_the_thread_that_runs_the_forward(restore_threads):
    torch.set_num_threads(2)
    threads = EngineThreads(ThreadPolicy(cores=2, parallel_tokens=100), torch, FixedLoad(0.0))
    seen = []

    def engine_thread():
        seen.append(torch.get_num_threads())  # a new thread starts from the last count set anywhere
        threads.use(1)
        seen.append(torch.get_num_threads())

    runner = threading.Thread(target=engine_thread)
    runner.start()
    runner.join()
    assert seen == [2, 1]
    assert threads.use(10**4) == 2 and torch.get_num_threads() == 2  # each thread's own count


def test_a_linear_takes_one_more_thread_per_matmul_macs_between_the_forwards_count_and_the_free_cores():
    policy = ThreadPolicy(cores=8, matmul_macs=100)
    assert policy.matmul(8, 50, 1, 8) == 1
    assert policy.matmul(8, 100, 1, 8) == 2  # one more thread per 100 multiply-adds
    assert policy.matmul(8, 10**6, 1, 8) == 8  # never more than the free cores
    assert policy.matmul(8, 10**6, 1, 3) == 3
    assert policy.matmul(8, 0, 4, 8) == 4  # never fewer than the forward's
    assert policy.matmul(7, 10**6, 1, 8) == 1  # under matmul_rows rows it keeps the forward's
    assert policy.matmul(7, 10**6, 3, 8) == 3
    assert ThreadPolicy(cores=8, pinned=3, matmul_macs=100).matmul(8, 10**6, 1, 8) == 3


def test_the_free_cores_are_the_cores_less_those_others_hold_and_at_least_one():
    policy = ThreadPolicy(cores=8)
    assert policy.free() == 8
    assert policy.free(2.9) == 5
    assert policy.free(0.2) == 8  # a sliver of a core is not held
    assert policy.free(50.0) == 1


def _decoder_linear(engine):
    return engine.model.model.layers[0].mlp.up_proj


def _read_recording_a_linears_threads(engine, policy, load):
    """The readout of a read under `policy` and `load`, and the intra-op count each call of a
    decoder Linear ran on (seen after the engine's own hook raised it)."""
    request = RowsRequest.of({"log": "deploy 7 finished"}, ROWS, shared=True, max_input_tokens=4096)
    reader = engine.with_options(threads=policy)
    assert reader.threads is not None
    reader.threads.load = load
    seen = []
    with _recording(_decoder_linear(engine), seen):
        readout = reader.read(request)
    assert seen  # the Linear ran
    return readout, seen


@contextmanager
def _recording(linear, seen):
    """Record the intra-op count inside `linear`'s forward (between the engine's hooks)."""
    original = linear.forward

    def forward(x):
        seen.append(torch.get_num_threads())
        return original(x)

    linear.forward = forward
    try:
        yield
    finally:
        del linear.forward


def test_a_linear_in_a_forward_kept_on_one_thread_runs_on_the_free_cores_and_reads_the_same_numbers(
    engine, restore_threads
):
    torch.set_num_threads(1)
    reference, pinned_seen = _read_recording_a_linears_threads(
        engine, ThreadPolicy(cores=2, pinned=1), FixedLoad(0.0)
    )
    assert set(pinned_seen) == {1}
    policy = ThreadPolicy(cores=2, parallel_tokens=10**9, matmul_macs=1, matmul_rows=1)
    raised, seen = _read_recording_a_linears_threads(engine, policy, FixedLoad(0.0))
    assert set(seen) == {2}
    assert torch.get_num_threads() == 1  # back to the forward's count after each Linear
    for a, b in zip(reference.rows, raised.rows, strict=True):
        assert max(abs(x - y) for x, y in zip(a.option_logits, b.option_logits, strict=True)) <= TOL


@pytest.mark.parametrize(
    ("policy", "busy"),
    [
        (ThreadPolicy(cores=2, parallel_tokens=10**9, matmul_macs=10**12, matmul_rows=1), 0.0),
        (ThreadPolicy(cores=2, parallel_tokens=10**9, matmul_macs=1, matmul_rows=10**9), 0.0),
        (ThreadPolicy(cores=2, pinned=1, matmul_macs=1, matmul_rows=1), 0.0),
        (ThreadPolicy(cores=2, parallel_tokens=10**9, matmul_macs=1, matmul_rows=1), 5.0),
    ],
    ids=["small-matmuls", "few-rows", "pinned", "no-free-core"],
)
def test_a_linear_keeps_the_forwards_thread_when_small_pinned_or_without_a_free_core(
    engine, restore_threads, policy, busy
):
    torch.set_num_threads(1)
    _, seen = _read_recording_a_linears_threads(engine, policy, FixedLoad(busy))
    assert set(seen) == {1} and torch.get_num_threads() == 1


def _hooked(module):
    return len(module._forward_pre_hooks) + len(module._forward_hooks)


def test_the_linears_carry_hooks_only_while_a_forward_raises_them_and_the_head_never(engine, restore_threads):
    torch.set_num_threads(1)
    linear, head = _decoder_linear(engine), engine.model.get_output_embeddings()
    assert isinstance(head, torch.nn.Linear)
    raising = ThreadPolicy(cores=2, parallel_tokens=10**9, matmul_macs=1, matmul_rows=1)
    _read_recording_a_linears_threads(engine, raising, FixedLoad(0.0))
    assert _hooked(linear) == 2  # left on while forwards raise
    assert _hooked(head) == 0  # its column read keeps its fast path
    wide = ThreadPolicy(cores=2, parallel_tokens=1)  # every forward already on both cores
    _read_recording_a_linears_threads(engine, wide, FixedLoad(0.0))
    assert _hooked(linear) == 0
    _read_recording_a_linears_threads(engine, raising, FixedLoad(0.0))
    _read_recording_a_linears_threads(engine, ThreadPolicy(cores=2, pinned=1), FixedLoad(0.0))
    assert _hooked(linear) == 0 and _hooked(head) == 0


def test_engines_over_one_model_share_its_hooks():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert LinearHooks.of(model) is LinearHooks.of(model)


def test_a_model_without_an_output_head_hooks_every_linear():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert not hasattr(model, "get_output_embeddings")
    hooks = LinearHooks.of(model)
    assert len(hooks.linears) == 2
    hooks.hooked(True)
    hooks.hooked(True)  # once
    assert all(_hooked(model[i]) == 2 for i in (0, 2))
    hooks.hooked(False)
    assert all(_hooked(model[i]) == 0 for i in (0, 2))


@pytest.mark.parametrize("failure", ["hook", "shape"])
def test_a_linear_that_raises_returns_the_count_to_the_forwards(restore_threads, failure):
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    seen = []
    linears = LinearHooks.of(model)
    threads = EngineThreads(
        ThreadPolicy(cores=2, matmul_macs=1, matmul_rows=1), torch, FixedLoad(0.0), linears
    )
    assert threads.use(1) == 1
    with _recording(model[0], seen):
        if failure == "hook":

            def refuse(*_):
                seen.append(torch.get_num_threads())
                raise RuntimeError("refused")

            refusal = model[0].register_forward_pre_hook(refuse)  # after the engine's: sees the raise
            with pytest.raises(RuntimeError, match="refused"):
                model(torch.ones(16, 64))
            refusal.remove()
        else:
            with pytest.raises(RuntimeError):
                model(torch.ones(16, 32))  # 512 values: 8 rows of 64 to the hook, the wrong shape to F.linear
        assert seen == [2] and torch.get_num_threads() == 1
        model(torch.ones(16, 64))  # and the next call raises it again
        assert seen == [2, 2] and torch.get_num_threads() == 1


def test_a_linear_outside_a_forward_set_up_by_the_engine_leaves_the_count(restore_threads):
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    seen = []
    linears = LinearHooks.of(model)
    threads = EngineThreads(
        ThreadPolicy(cores=2, matmul_macs=1, matmul_rows=1), torch, FixedLoad(0.0), linears
    )
    assert threads.use(1) == 1  # a forward on this thread: not on the other one

    def other_thread():
        torch.set_num_threads(1)
        model(torch.ones(16, 64))
        seen.append(torch.get_num_threads())

    with _recording(model[0], seen):
        runner = threading.Thread(target=other_thread)
        runner.start()
        runner.join()
        assert seen == [1, 1]
        model(torch.ones(16, 64))  # on the engine's thread it is raised
    assert seen == [1, 1, 2] and torch.get_num_threads() == 1


def test_a_job_run_now_runs_on_the_engine_thread(engine):
    from semif_serve.engine.memory import ReleasePolicy
    from semif_serve.engine.worker import EngineWorker

    worker = EngineWorker(engine, ReleasePolicy(engine.memory, 0, engine.cache), encoders=1)
    try:
        ran_on = worker.run_now(threading.current_thread)
    finally:
        worker.shutdown()
    assert ran_on is not threading.current_thread() and ran_on.name.startswith("semif-engine")
