"""acceptance/gpu_run.py end to end on the CPU: the tiny checkpoint's geometry on a simulated CUDA
device (tests/cuda_sim.py), so a Python error cannot first appear on a lent GPU; its pure parts on
hand-made inputs; and which kernel transformers bound, read through transformers' own decorator."""

from __future__ import annotations

import json
import sys
import types

import pytest
from cuda_sim import MIB, SimulatedCuda

from acceptance.gpu_run import Device, GpuRun, RunOptions


class SimulatedDevice(Device):
    """The run's device on the CPU: tensors on "cpu", torch.cuda's calls on a simulated card."""

    def __init__(self, cuda: SimulatedCuda) -> None:
        super().__init__(cuda, "cpu", simulated=True)

    def adopt(self, model) -> None:
        self.cuda.track(model)


def expected_boundary(cuda: SimulatedCuda, weights: int, prefix: int, width: int) -> int:
    """The simulated card's own limit: rows whose suffix forward fits beside the weights."""
    return (cuda.limit - weights) // cuda.forward_bytes(1, prefix, width)


def test_the_gpu_run_goes_end_to_end_on_a_simulated_device(tmp_path, capsys):
    cuda = SimulatedCuda(row_bytes=MIB, token_bytes=8 * 1024)
    out = tmp_path / "gpu-run.json"
    options = RunOptions(
        out=out,
        shape="demo",
        vram_cap_gib=0.25,
        state_cache_mib=8,
        runs=1,
        requests=2,
        burst=(1960, 8),
        forced_oom_room_mib=16,
        capacity_tokens=(140, 3900),  # the shortest and the longest state: the test stays under a minute
        deadline_s=600,
        hard_limit_s=3600,
    )
    status = GpuRun(options, SimulatedDevice(cuda)).run()
    result = json.loads(out.read_text())
    phases = result["phases"]
    failed = {name: p.get("traceback", p.get("reason")) for name, p in phases.items() if p["status"] != "done"}
    assert not failed, failed
    assert list(phases) == ["environment", "kernel", "service", "parity", "memory", "latency", "capacity"]
    assert result["simulated_device"] is True and result["environment"]["gpu"] == "Simulated NVIDIA H200"
    assert set(result["environment"]["kernels_bound"].values()) == {"reference"}
    assert phases["kernel"]["max_relative_error"] == 0.0  # the reference against itself

    service = phases["service"]
    assert service["cap_fraction"] == pytest.approx(0.25 / 141)
    assert service["max_batch_rows"] >= 1024
    weights = round(service["weights_gib"] * 1024**3)

    parity = phases["parity"]["rows"]
    assert {r["target_tokens"] for r in parity} == {115, 1900, 3200}
    assert all(r["same_hash"] for r in parity)
    assert max(r["prefill_chunks"] for r in parity) == 2

    memory = phases["memory"]
    assert memory["forced_oom"] == "503 out_of_memory" and memory["oom_events"] == 1
    assert memory["next_request"] == "answered"
    assert cuda.fraction == pytest.approx(0.25 / 141)  # the cap is back after the forced OOM

    latency = phases["latency"]["rows"]
    assert [r["spec_0_1_3_server_ms"] for r in latency] == [35, 92, 78, 81, 158]
    assert all(r["requests"] == 2 and not r["errors"] for r in latency)

    rows = {r["target_prefix_tokens"]: r for r in phases["capacity"]["rows"]}
    assert list(rows) == [140, 3900]
    for row in rows.values():
        boundary = expected_boundary(cuda, weights, row["prefix_tokens"], row["suffix_width"])
        assert row["max_rows"] == boundary and row["complete"]
        assert row["first_failure"] == boundary + 1 and row["first_failure_outcome"] == "out_of_memory"
        # The estimate knows nothing of the simulated card: where it allows more than fits, the run says so.
        too_many = row["estimate_rows"] > boundary
        assert row["estimate_at_its_rows"] == ("out_of_memory" if too_many else "ok")
    assert rows[140]["max_rows"] > 64  # the batcher's row bound was raised past the boundary
    gates = {(g["phase"], g["name"]): g["passed"] for g in result["gates"]}
    assert gates[("capacity", "boundary is an OOM")] is True
    assert gates[("capacity", "estimate never OOMs")] is not any(
        r["estimate_rows"] > r["max_rows"] for r in rows.values()
    )
    assert gates[("memory", "forced OOM is 503")] and gates[("run", "every phase ran")]
    assert status == (0 if all(gates.values()) else 1)
    printed = capsys.readouterr().out
    assert "OOM boundary" in printed and "spec 0.1.3 ms" in printed and "gates" in printed
