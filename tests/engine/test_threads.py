"""The thread policy (engine.threads): a forward's intra-op threads from its size and the free
cores, the operator's pin respected, forwards on the engine thread only, over the real engine and
the tiny checkpoint."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from semif_serve.domain.requests import RowsRequest
from semif_serve.domain.types import PromptRow
from semif_serve.engine import threads as engine_threads
from semif_serve.engine.threads import (
    EngineThreads,
    OtherLoad,
    ThreadPolicy,
    pinned_threads,
)
from tests.support.polling import wait_until

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
    assert policy.wanted(10_000, others_busy=0.4) == 8  # a core others use 40% of the time is not held
    assert policy.wanted(10_000, others_busy=0.6) == 7  # one they use 60% of the time is
    assert policy.wanted(10_000, others_busy=50.0) == 1
    assert ThreadPolicy(cores=8, pinned=3).wanted(10) == 3


def test_by_default_a_forward_of_sixteen_tokens_runs_on_two_free_cores():
    policy = ThreadPolicy(cores=2)
    assert policy.wanted(15) == 1
    assert policy.wanted(16) == 2  # the short noul's forwards (~70 tokens) take both cores
    assert policy.wanted(16, others_busy=1.0) == 1  # unless another process holds one


def cpu_seconds(pid: int) -> float:
    """The CPU time (user and system) process `pid` has used, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_another_process_burning_a_core_counts_as_busy():
    load = OtherLoad()
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        load.busy_cores()
        start = cpu_seconds(burner.pid)
        # Half a CPU second within 1.5 s is a third of a core, inside OtherLoad's 2 s fresh window.
        wait_until(lambda: cpu_seconds(burner.pid) - start >= 0.5, 1.5, "the burner's half CPU second")
        others = load.busy_cores()
    finally:
        burner.kill()
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


def test_a_job_run_now_runs_on_the_engine_thread(engine):
    from semif_serve.engine.memory import ReleasePolicy
    from semif_serve.engine.worker import EngineWorker

    worker = EngineWorker(engine, ReleasePolicy(engine.memory, 0, engine.cache), encoders=1)
    try:
        ran_on = worker.run_now(threading.current_thread)
    finally:
        worker.shutdown()
    assert ran_on is not threading.current_thread() and ran_on.name.startswith("semif-engine")
