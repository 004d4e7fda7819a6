"""acceptance/gpu_run.py end to end on the CPU: the tiny checkpoint's geometry on a simulated CUDA
device (tests/support/cuda_sim.py), so a Python error cannot first appear on a lent GPU; its pure parts on
hand-made inputs; and which kernel transformers bound, read through transformers' own decorator."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from acceptance.capacity import CapacityProbe, Deadline, capacity_decisions, find_capacity
from acceptance.gpu_images import ENGINE_GAPS, engine_table, image_gates
from acceptance.gpu_run import (
    Device,
    GpuRun,
    RunOptions,
    capacity_gates,
    compare_readouts,
    memory_gates,
)
from acceptance.kernels import bound_kernels, fast_linear_attention
from harness.client import ServiceCallError
from tests.support.cuda_sim import MIB, SimulatedCuda


class SimulatedDevice(Device):
    """The run's device on the CPU: tensors on "cpu", torch.cuda's calls on a simulated card."""

    def __init__(self, cuda: SimulatedCuda) -> None:
        super().__init__(cuda, "cpu", simulated=True)

    def adopt(self, model) -> None:
        self.cuda.track(model)

    def adopt_vision(self, tower) -> None:
        self.cuda.track_vision(tower)


def expected_boundary(cuda: SimulatedCuda, weights: int, prefix: int, width: int) -> int:
    """The simulated card's own limit: rows whose suffix forward fits beside the weights."""
    return (cuda.limit - weights) // cuda.forward_bytes(1, prefix, width)


def test_the_gpu_run_goes_end_to_end_on_a_simulated_device(tmp_path, capsys):
    cuda = SimulatedCuda(row_bytes=MIB, token_bytes=8 * 1024, patch_bytes=4096)
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
        image_sizes=IMAGE_SIZES,
        image_repeats=1,
        deadline_s=600,
        hard_limit_s=3600,
    )
    status = GpuRun(options, SimulatedDevice(cuda)).run()
    result = json.loads(out.read_text())
    phases = result["phases"]
    failed = {
        name: p.get("traceback", p.get("reason")) for name, p in phases.items() if p["status"] != "done"
    }
    assert not failed, failed
    assert list(phases) == [
        "environment",
        "kernel",
        "service",
        "parity",
        "memory",
        "latency",
        "capacity",
        "images",
        "batching",
        "adapters",
        "keep",
    ]
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
    answered = sum(r["requests"] for r in latency) + len(latency)  # each row's warm-up besides
    waits = phases["latency"]["engine_waits"]
    assert waits["requests"] == answered
    follow_ups = phases["latency"]["short_after_lone_long"]
    assert len(follow_ups) == 2 and all(f["long_input_tokens"] > 1500 for f in follow_ups)
    assert all(f["short_e2e_ms"] >= f["short_server_ms"] > 0 for f in follow_ups)
    assert all(f["short_wait_ms"] is not None for f in follow_ups)

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
    check_images(phases["images"], cuda, tmp_path)
    check_images_through_the_engine(phases["images"], cuda, service)
    assert phases["batching"]["prefills_for_8_clients"] == 1
    adapters = phases["adapters"]
    assert adapters["adapters"] == 4 and len(adapters["works"]) == 4
    assert all(ms["adapter"] > 0 and ms["base"] > 0 for ms in adapters["works"].values())
    keep = phases["keep"]
    assert [r["state_tokens"] for r in keep["rows"]] == [256, 768]
    assert all(r["keep_ms"] > 0 and r["cached_ms"] > 0 and r["plain_ms"] > 0 for r in keep["rows"])
    assert keep["keep_pays_from_tokens"] in (None, 256, 768)
    gates = {(g["phase"], g["name"]): g["passed"] for g in result["gates"]}
    assert gates[("keep", "third visit from the cache")] is True
    assert gates[("capacity", "boundary is an OOM")] is True
    assert gates[("capacity", "estimate never OOMs")] is not any(
        r["estimate_rows"] > r["max_rows"] for r in rows.values()
    )
    assert gates[("memory", "forced OOM is 503")] and gates[("run", "every phase ran")]
    worst_wait = max(f["short_wait_ms"] for f in follow_ups)
    assert gates[("latency", "a short request after a lone long one waits little for the engine")] is (
        worst_wait <= 5.0
    )
    assert status == (0 if all(gates.values()) else 1)
    captured = capsys.readouterr()
    printed = captured.out
    assert "OOM boundary" in printed and "spec 0.1.3 ms" in printed and "gates" in printed
    assert "images (vision tower" in printed and "images through the service's engine" in printed
    # The simulated tower takes more per patch than the estimate allows: the run says so.
    below = any(
        r["engine"]["tower_peak_bytes"] > r["engine"]["tower_estimate_bytes"]
        for r in phases["images"]["rows"]
    )
    assert below and not gates[("images", "tower estimate covers its peak")]
    assert "memory estimate is below its measured peak" in captured.err


IMAGE_SIZES = ((40, 24), (96, 64))  # one upscaled to the processor's minimum, one kept as it is


def check_images(images, cuda: SimulatedCuda, tmp_path) -> None:
    """The image phase against independent computations: the tower's weights read from a demo
    vision checkpoint's safetensors headers, the tokens from transformers' own resize rule, the
    peaks from the simulated card's own accounting, the readouts from a full forward."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from semif_serve.engine.vision import MAX_PIXELS, MIN_PIXELS
    from semif_serve.tools.demo import write_checkpoint
    from tests.support.vision_reference import vision_tower_elements

    elements = vision_tower_elements(write_checkpoint(tmp_path / "vl", multimodal=True))
    assert images["vision_parameters"] == elements
    assert images["vision_weights_bytes"] == 2 * elements  # BF16
    config = images["vision_config"]
    factor = config["patch_size"] * config["spatial_merge_size"]
    rows = images["rows"]
    assert [(r["width"], r["height"]) for r in rows] == list(IMAGE_SIZES)
    for row in rows:
        height, width = smart_resize(row["height"], row["width"], factor, MIN_PIXELS, MAX_PIXELS)
        assert row["resized"] == [width, height]
        patches = (height // config["patch_size"]) * (width // config["patch_size"])
        assert (
            row["patches"] == patches and row["image_tokens"] == patches // config["spatial_merge_size"] ** 2
        )
        # The prefix holds the image's tokens and the state's text; the text-only state, its text alone.
        assert row["prefix_tokens"] >= row["text_prefix_tokens"] + row["image_tokens"]
        assert row["tower_peak_bytes"] == patches * cuda.patch_bytes
        assert row["prefill_peak_bytes"] == cuda.forward_bytes(1, 0, row["prefix_tokens"])
        assert row["readout_vs_full_forward_gap"] < 1e-2  # BF16 on the CPU
        assert row["kept_state_gap"] == 0.0 and row["eight_rows_vs_one_gap"] < 1e-2
        for key in ("tower_seconds", "prefill_seconds", "one_question_seconds", "without_image_seconds"):
            assert row[key] > 0, key
    assert rows[0]["resized"] != [40, 24]  # below the processor's minimum: upscaled
    assert rows[1]["image_tokens"] > rows[0]["image_tokens"]


def check_images_through_the_engine(images, cuda: SimulatedCuda, service) -> None:
    """The engine's part of the phase against independent computations: the grid from the
    blocks' processor run, the tower's peak from the simulated card's own accounting, its
    estimate from docs/memory.md's formula, the answers from the blocks' full forward."""
    config = images["vision_config"]
    merge = config["spatial_merge_size"]
    assert images["engine_prefill_chunk_tokens"] == service["prefill_chunk_tokens"]
    headroom = round(service["headroom_gib"] * 1024**3) - images["vision_weights_bytes"]
    assert abs(images["engine_headroom_bytes"] - headroom) <= 1  # the tower's weights come off
    for row in images["rows"]:
        engine = row["engine"]
        assert "refused" not in engine, engine
        assert engine["grid_thw"] == row["grid_thw"] and engine["patches"] == row["patches"]
        assert engine["prompts_match_blocks"]  # the engine's placeholder and pads: the blocks' prompt
        # The engine's state prefix: the image's tokens and the state's text, within what the rows share.
        assert (
            row["text_prefix_tokens"] + row["image_tokens"] <= engine["prefix_tokens"] <= row["prefix_tokens"]
        )
        assert len(engine["input_tokens"]) == 8 and min(engine["input_tokens"]) > engine["prefix_tokens"]
        patches = row["patches"]
        assert engine["tower_peak_bytes"] == patches * cuda.patch_bytes
        hidden = config["hidden_size"]
        formula = patches * (2 * (6 * hidden + 2 * config["intermediate_size"]) + 4 * 2 * hidden)
        formula += 2 * config["out_hidden_size"] * patches // merge**2
        assert engine["tower_estimate_bytes"] == int(formula * 1.25)
        assert engine["tower_measured_vs_estimate"] == pytest.approx(
            patches * cuda.patch_bytes / int(formula * 1.25)
        )
        assert engine["first_prefill"] == "fresh" and engine["tower_runs_first"] == 1
        assert engine["second_prefill"] == "cached" and engine["tower_runs_second"] == 0
        for key in ENGINE_GAPS:
            assert engine[key] < 1e-2, key  # BF16 on the CPU
        # Question 0 through the engine reads as through the blocks' own prefill and readout.
        assert (
            max(abs(a - b) for a, b in zip(engine["probabilities"][0], row["probabilities"], strict=True))
            < 1e-2
        )
        seconds = [
            engine[k]
            for k in (
                "without_image_seconds",
                "first_question_seconds",
                "eight_questions_seconds",
                "second_question_seconds",
            )
        ]
        assert min(seconds) > 0
        assert engine["eight_vs_one"] == pytest.approx(seconds[2] / seconds[1])
        assert engine["first_vs_second"] == pytest.approx(seconds[1] / seconds[3])


# -- the pure parts ------------------------------------------------------------------------------


@pytest.mark.parametrize("capacity,hint", [(40, 63), (100, 63), (63, 63), (1, 16), (0, 16), (2000, 63)])
def test_find_capacity_brackets_and_bisects(capacity, hint):
    search = find_capacity(lambda n: n <= capacity, hint=hint, limit=1024)
    assert search.fits == min(capacity, 1024) and search.complete
    assert search.capped == (capacity >= 1024)
    if not search.capped:
        assert search.first_failure == search.fits + 1
    assert len(search.probes) <= 16


def test_find_capacity_stops_at_the_deadline():
    budget = iter([True, True, False])
    search = find_capacity(lambda n: n <= 40, hint=63, limit=1024, keep_going=lambda: next(budget))
    assert not search.complete and search.fits == 31 and search.first_failure == 63


def test_capacity_decisions_and_the_deadline():
    decisions = capacity_decisions(120)
    assert len({d["id"] for d in decisions}) == 120 and all(len(d["options"]) == 2 for d in decisions)
    deadline = Deadline(100.0)
    assert deadline.allows(50) and not deadline.allows(200) and deadline.left() <= 100


class FakeShared:
    """A /decide/shared stand-in: one forward up to 5 rows, split up to 10, out of memory past 10."""

    def decide_shared(self, state, decisions):
        n = len(decisions)
        if n > 10:
            raise ServiceCallError(503, "out_of_memory", "split it")
        timing = {
            "forward_batches": 1 if n <= 5 else 2,
            "prefix_tokens": 140,
            "batch_size": n,
            "padded_suffix_tokens": 43 * n,
        }
        return {"timing": timing}, 0.01


def capacity_row(**overrides):
    row = {
        "target_prefix_tokens": 140,
        "complete": True,
        "capped_by_max_rows": False,
        "first_failure_outcome": "out_of_memory",
        "estimate_out_of_memory": 0,
        "estimate_refusals": 0,
        "estimate_rows": 5,
        "max_rows": 10,
    }
    return {**row, **overrides}


def test_capacity_probe_counts_splits_and_out_of_memory():
    strict = CapacityProbe(FakeShared(), "s", split_counts=False)
    assert find_capacity(strict, hint=8, limit=64).fits == 5
    assert strict.suffix_width == 43 and strict.prefix_tokens == 140
    lenient = CapacityProbe(FakeShared(), "s", split_counts=True)
    assert find_capacity(lenient, hint=8, limit=64).fits == 10
    assert lenient.count("out_of_memory") >= 1 and (8, "split into 2") in lenient.outcomes


@pytest.mark.parametrize(
    "change,failing",
    [
        ({}, set()),
        ({"estimate_out_of_memory": 1}, {"estimate never OOMs"}),
        ({"estimate_rows": 11}, {"estimate within the boundary"}),
        ({"first_failure_outcome": "split into 2"}, {"boundary is an OOM"}),
        ({"capped_by_max_rows": True, "first_failure_outcome": None}, {"boundary is an OOM"}),
        ({"estimate_refusals": 2}, {"estimate refuses nothing that fits"}),
        ({"complete": False}, {"capacity measured"}),
    ],
)
def test_each_capacity_gate_fails_on_its_own_defect(change, failing):
    gates = capacity_gates([capacity_row(**change)])
    assert {g.name for g in gates if not g.passed} == failing


def test_a_skipped_state_size_fails_the_capacity_table():
    gates = capacity_gates([capacity_row(), {"target_prefix_tokens": 3900, "skipped": "deadline"}])
    assert [g.name for g in gates if not g.passed] == ["capacity measured"]


def test_the_memory_gates_pass_a_release_and_fail_a_leak():
    healthy = {
        "baseline_gib": 8.85,
        "margin_gib": 0.5,
        "after_burst_gib": 8.9,
        "after_oom_gib": 7.85,
        "forced_oom": "503 out_of_memory",
        "next_request": "answered",
    }
    assert all(g.passed for g in memory_gates(healthy))
    leaked = {**healthy, "after_oom_gib": 11.9}
    assert [g.name for g in memory_gates(leaked) if not g.passed] == ["back to baseline after OOM"]
    kept = {**healthy, "after_burst_gib": 12.6, "forced_oom": "500 internal_error"}
    assert {g.name for g in memory_gates(kept) if not g.passed} == {"burst given back", "forced OOM is 503"}


def engine_row(**overrides):
    engine = {
        "prompts_match_blocks": True,
        "first_vs_full_forward_gap": 0.01,
        "eight_vs_full_forward_gap": 0.02,
        "second_vs_full_forward_gap": 0.01,
        "first_prefill": "fresh",
        "second_prefill": "cached",
        "tower_runs_first": 1,
        "tower_runs_second": 0,
        "tower_measured_vs_estimate": 0.8,
        "eight_vs_one": 1.2,
        "first_vs_second": 9.0,
    }
    return {**engine, **overrides}


def image_row(engine=None, **overrides):
    row = {
        "width": 448,
        "height": 448,
        "readout_vs_full_forward_gap": 0.01,
        "eight_rows_vs_one_gap": 0.004,
        "kept_state_gap": 0.0,
        "eight_vs_one": 1.2,
        "first_vs_second": 9.0,
        "engine": engine_row(**(engine or {})),
    }
    return {**row, **overrides}


@pytest.mark.parametrize(
    "change,failing",
    [
        ({}, set()),
        ({"readout_vs_full_forward_gap": 0.2}, {"image path vs full forward"}),
        ({"eight_rows_vs_one_gap": 0.11}, {"eight rows read as one"}),
        ({"kept_state_gap": 0.01}, {"kept image state reads as fresh"}),
        # The goals are the service's: the blocks' own ratios missing them fail nothing.
        ({"eight_vs_one": 1.6, "first_vs_second": 4.0}, set()),
        ({"engine": {"eight_vs_one": 1.6}}, {"goal: eight questions <= 1.5x one"}),
        ({"engine": {"first_vs_second": 4.0}}, {"goal: second question >= 5x faster"}),
        ({"engine": {"eight_vs_full_forward_gap": 0.2}}, {"engine vs full forward"}),
        ({"engine": {"prompts_match_blocks": False}}, {"engine vs full forward"}),
        ({"engine": {"second_prefill": "fresh"}}, {"engine's second question from the cached state"}),
        ({"engine": {"tower_runs_second": 1}}, {"engine's second question from the cached state"}),
        ({"engine": {"tower_measured_vs_estimate": 1.3}}, {"tower estimate covers its peak"}),
    ],
)
def test_each_image_gate_fails_on_its_own_defect(change, failing):
    gates = image_gates({"rows": [image_row(), image_row(width=1920, height=1080, **change)]})
    assert {g.name for g in gates if not g.passed} == failing


def test_an_estimate_below_the_measured_tower_peak_is_said_in_the_gate():
    gates = image_gates({"rows": [image_row(engine={"tower_measured_vs_estimate": 1.3})]})
    gate = next(g for g in gates if g.name == "tower estimate covers its peak")
    assert "1.3" in gate.detail and "BELOW" in gate.detail


@pytest.mark.parametrize(
    "outcome",
    [
        {"refused": "the image needs 0.3 GiB in the vision tower"},
        {"failed": "OutOfMemoryError: the image needs 0.3 GiB in the vision tower and more"},
    ],
)
def test_an_image_the_engine_refused_or_failed_fails_every_engine_gate_and_says_why(outcome):
    refused = image_row(width=1920, height=1080)
    refused["engine"] = outcome
    data = {"rows": [image_row(), refused]}
    gates = image_gates(data)
    failing = {g.name: g.detail for g in gates if not g.passed}
    assert set(failing) == {
        "engine answers every size",
        "engine vs full forward",
        "engine's second question from the cached state",
        "tower estimate covers its peak",
        "goal: eight questions <= 1.5x one",
        "goal: second question >= 5x faster",
    }
    assert f"1920x1080: {next(iter(outcome.values()))}" in failing["engine answers every size"]
    head, body = engine_table({"rows": [refused]})
    assert body == [["1920x1080", next(iter(outcome.values()))[:60], *["-"] * (len(head) - 2)]]


def test_an_image_size_the_deadline_skipped_fails_the_image_table():
    gates = image_gates({"rows": [image_row(), {"width": 1920, "height": 1080, "skipped": "deadline"}]})
    assert [g.name for g in gates if not g.passed] == ["image sizes measured"]


def result(probabilities, sha="abc"):
    return {"probabilities": probabilities, "prompt_sha256": sha}


def test_direct_and_shared_readouts_are_compared_by_hash_top_choice_and_gap():
    same = compare_readouts(result([0.7, 0.3]), result([0.68, 0.32]))
    assert same["same_hash"] and same["same_top"] and not same["tie"]
    assert same["max_gap"] == pytest.approx(0.02)
    tie = compare_readouts(result([0.505, 0.495]), result([0.49, 0.51]))
    assert not tie["same_top"] and tie["tie"]
    real = compare_readouts(result([0.8, 0.2]), result([0.3, 0.7], sha="other"))
    assert not real["same_top"] and not real["tie"] and not real["same_hash"]


# -- which kernel transformers bound ------------------------------------------------------------


def test_the_kernel_is_read_from_what_transformers_bound_not_from_what_is_installed(monkeypatch):
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    # A kernel package as transformers imports it (fla.ops.gated_delta_rule.chunk_gated_delta_rule).
    fla, ops, rule = (types.ModuleType(n) for n in ("fla", "fla.ops", "fla.ops.gated_delta_rule"))

    def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False):
        return "kernel"

    chunk_gated_delta_rule.__module__ = rule.__name__
    chunk_gated_delta_rule.__qualname__ = "chunk_gated_delta_rule"
    rule.chunk_gated_delta_rule, ops.gated_delta_rule, fla.ops = chunk_gated_delta_rule, rule, ops
    for module in (fla, ops, rule):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)  # installed or not: it fails to import

    def reference_rule(query, key, value, g, beta, initial_state=None, output_final_state=False):
        return "reference"

    def reference_conv(hidden_states, weight, bias=None, activation=None):
        return "reference"

    modeling = types.SimpleNamespace(
        torch_chunk_gated_delta_rule=use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")(
            reference_rule
        ),
        causal_conv1d_fn=use_kernel_func_from_hub_with_fallback("causal_conv1d_fn", "causal_conv1d")(
            reference_conv
        ),
        torch_recurrent_gated_delta_rule=reference_rule,  # not a transformers wrapper
    )
    bound = bound_kernels(modeling)
    assert bound["chunk_gated_delta_rule"] == "fla.ops.gated_delta_rule.chunk_gated_delta_rule"
    assert bound["causal_conv1d_fn"] == "reference"
    assert bound["fused_recurrent_gated_delta_rule"] == "unknown"
    assert fast_linear_attention(bound)
    assert modeling.torch_chunk_gated_delta_rule(1, 2, 3, g=4, beta=5) == "kernel"  # what runs, as read


def test_this_machine_binds_the_reference_kernels():
    assert set(bound_kernels().values()) == {"reference"}
    assert not fast_linear_attention(bound_kernels())


def test_a_preflight_that_cannot_run_its_kernel_reports_why_instead_of_raising():
    from acceptance.gpu_run import run_preflight

    # A real child process, as on the GPU; here it has no CUDA device, so its check must fail cleanly.
    found = run_preflight("demo", Device(cuda=None, tensor_device="cuda"), timeout=300)
    assert found["passed"] is False
    assert found["error"] and "seconds" in found


FAKE_FLA = """
def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False):
    raise RuntimeError("the planted kernel ran")


fused_recurrent_gated_delta_rule = chunk_gated_delta_rule
"""


@pytest.mark.parametrize("blocked", [False, True], ids=["bound", "fallback"])
def test_the_fallback_binds_transformers_reference_code_even_where_fla_imports(tmp_path, blocked):
    import subprocess
    from pathlib import Path

    package = tmp_path / "fla" / "ops" / "gated_delta_rule"
    package.mkdir(parents=True)
    for folder in (tmp_path / "fla", tmp_path / "fla" / "ops"):
        (folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text(FAKE_FLA)
    root = Path(__file__).resolve().parents[2]
    script = (
        "import json, sys; from acceptance.kernels import block_kernel_packages, bound_kernels; "
        + ("block_kernel_packages(); " if blocked else "")
        + "print(json.dumps(bound_kernels()))"
    )
    env = {"PYTHONPATH": f"{tmp_path}:{root}:{root / 'src'}", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    bound = json.loads(done.stdout.strip().splitlines()[-1])
    planted = "fla.ops.gated_delta_rule.chunk_gated_delta_rule"
    if blocked:
        assert set(bound.values()) == {"reference"}
    else:
        assert bound["chunk_gated_delta_rule"] == planted == bound["fused_recurrent_gated_delta_rule"]
        assert bound["causal_conv1d_fn"] == "reference"


@pytest.mark.parametrize(
    "fraction,device,error",
    [
        (1, 0, TypeError),  # torch wants a float: an int fraction fails on the card
        (1.5, 0, ValueError),
        (-0.1, 0, ValueError),
        (0.5, 1, AssertionError),  # one card: index 1 is out of range
        (0.5, "cpu", ValueError),
        (0.5, 0.0, ValueError),
    ],
)
def test_the_simulated_card_refuses_what_torch_cuda_refuses(fraction, device, error):
    cuda = SimulatedCuda()
    with pytest.raises(error):
        cuda.set_per_process_memory_fraction(fraction, device)
    cuda.set_per_process_memory_fraction(0.5, "cuda:0")
    assert cuda.limit == cuda.properties.total_memory // 2


def test_the_simulated_allocator_returns_cached_blocks_before_it_fails():
    cuda = SimulatedCuda(total_memory=100 * MIB)
    cuda.set_per_process_memory_fraction(0.5, 0)
    cuda.allocate(30 * MIB)
    cuda.free(30 * MIB)
    assert (cuda.allocated, cuda.reserved) == (0, 30 * MIB)  # kept as cache
    cuda.allocate(40 * MIB)  # fits once the cache is given back
    assert cuda.reserved == 40 * MIB
    with pytest.raises(torch.cuda.OutOfMemoryError):
        cuda.allocate(11 * MIB)
    assert cuda.out_of_memory_events == 1


def test_the_adapter_phase_measures_every_work_and_its_gates_fail_on_their_own_defect():
    from acceptance.gpu_run import adapter_gates

    works = {
        "suffix": {"base": 100.0, "adapter": 110.0, "4 adapters": 120.0},
        "prefill": {"base": 100.0, "adapter": 114.0},
    }
    measured = {"works": works, "adapter_bytes": 64 * MIB, "allocated_delta_bytes": 65 * MIB}
    assert all(g.passed for g in adapter_gates(measured, simulated=False))
    slow = {**measured, "works": {**works, "prefill": {"base": 100.0, "adapter": 120.0}}}
    assert [g.name for g in adapter_gates(slow, simulated=False) if not g.passed] == [
        "adapter rows <= 1.15x base: prefill"
    ]
    mixed = {**measured, "works": {**works, "suffix": {"base": 100.0, "adapter": 100.0, "4 adapters": 140.0}}}
    assert [g.name for g in adapter_gates(mixed, simulated=False) if not g.passed] == [
        "4 adapters mixed <= 1.3x one: suffix"
    ]
    leaked = {**measured, "allocated_delta_bytes": 90 * MIB}
    assert [g.name for g in adapter_gates(leaked, simulated=False) if not g.passed] == [
        "adapters' device bytes are their tensors"
    ]
    assert len(adapter_gates(leaked, simulated=True)) == 3  # a simulated card sees no adapter bytes


def test_only_runs_the_phases_asked_after_the_environment_and_the_service(tmp_path):
    from acceptance.gpu_run import OPTIONAL_PHASES, parse_args

    assert parse_args(["--only", "images,latency"]).only == ("images", "latency")
    assert parse_args([]).only is None
    with pytest.raises(SystemExit):
        parse_args(["--only", "images,imagse"])

    class Recording(GpuRun):
        """The run's own phase loop over phases that only record that they ran."""

        def __getattribute__(self, name):
            if name in ("environment", "start_service", *OPTIONAL_PHASES):
                return lambda: ({}, [])
            return super().__getattribute__(name)

    out = tmp_path / "gpu-run.json"
    Recording(RunOptions(out=out, only=("images",)), SimulatedDevice(SimulatedCuda())).run()
    assert list(json.loads(out.read_text())["phases"]) == ["environment", "service", "images"]
    Recording(RunOptions(out=out), SimulatedDevice(SimulatedCuda())).run()
    assert list(json.loads(out.read_text())["phases"]) == [
        "environment",
        "kernel",
        "service",
        *OPTIONAL_PHASES[1:],
    ]
