"""The acceptance commands against a real demo service over loopback HTTP, with fixtures this
file generates; each parity gate is shown to fail on a perturbed reference; the pure parts of
the statistics, the state fitting and the bench table on hand-made inputs (the GPU run's parts:
tests/engine/test_gpu_run.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from acceptance import cli
from acceptance.common import Gate, Outcome, read_jsonl, write_jsonl
from acceptance.parity import negative_control_verdict, rotate_descriptions
from harness import stats
from harness.client import Client, ServiceCallError
from harness.report import format_table
from harness.server import LoopbackServer
from harness.workloads import filler, fit_words
from semif_serve.app import create_app
from semif_serve.domain.numerics import expected_calibration_error
from tests.support import TOKEN, make_settings

ROOT = Path(__file__).resolve().parents[2]

STATES = [
    "Health checks passed in all three zones after the release",
    {"ticket": "The customer reports a duplicate charge and asks for a refund.", "priority": "high"},
    "The nightly backup failed twice, then the on-call engineer rolled back the change",
    ["zone two logged a timeout", "the status page was updated", "the audit passed"],
]
QUESTIONS = [
    ("Did the deployment succeed?", [("yes", "It succeeded."), ("no", "It failed.")]),
    (
        "Which queue should handle this?",
        [("billing", "Billing."), ("accounts", "Accounts."), ("support", "Support.")],
    ),
    ("Is a refund requested?", [("yes", "Yes."), ("no", "No."), ("unclear", "Unclear.")]),
]


def fixture_rows() -> list[dict]:
    """12 SemIf rows: 4 groups, each one state asked 3 questions, with labels."""
    rows = []
    for g, state in enumerate(STATES):
        for k, (question, options) in enumerate(QUESTIONS):
            rows.append(
                {
                    "id": f"g{g}-q{k}",
                    "family": "generated",
                    "group_id": f"g{g}",
                    "state": state,
                    "question": question,
                    "options": [{"id": i, "description": d} for i, d in options],
                    "label": (g + k) % len(options),
                }
            )
    return rows


@pytest.fixture(scope="module")
def live(engine, checkpoint, tmp_path_factory):
    """A real uvicorn on a loopback port serving the demo service as parity runs it
    (`SEMIF_DIRECT_PATH=plain`: every lone question the plain forward); files the commands need."""
    from semif_serve.service.startup import Service

    service = Service.start(make_settings(checkpoint, direct_path="plain"), engine=engine)
    work = tmp_path_factory.mktemp("acceptance")
    token = work / "token"
    token.write_text(TOKEN + "\n")
    fixture = write_jsonl(work / "fixture.jsonl", fixture_rows())
    with LoopbackServer(create_app(service)) as server:
        yield {"url": server.url, "token": token, "fixture": fixture, "work": work}


def run(live, command: str, *args: str, out: str | None = None) -> tuple[int, dict]:
    out_path = live["work"] / f"{out or command}.json"
    connection = ["--url", live["url"], "--token-file", str(live["token"]), "--out", str(out_path)]
    rc = cli.main([command, *connection, *args])
    return rc, json.loads(out_path.read_text())


def gates(result: dict) -> dict[str, bool]:
    return {g["name"]: g["passed"] for g in result["gates"]}


@pytest.fixture(scope="module")
def reference(live) -> Path:
    """Predictions made by scoring the fixture once: the stand-in for upstream's."""
    path = live["work"] / "reference.jsonl"
    rc, result = run(live, "score", "--fixture", str(live["fixture"]), "--predictions-out", str(path))
    assert rc == 0 and result["summary"] == {"rows": 12, "scored": 12}
    return path


def perturbed(live, reference: Path, name: str, change) -> Path:
    rows = read_jsonl(reference)
    change(rows)
    return write_jsonl(live["work"] / f"{name}.jsonl", rows)


# -- parity and its gates -----------------------------------------------------------------


def test_parity_passes_against_its_own_predictions(live, reference, capsys):
    rc, result = run(live, "parity", "--fixture", str(live["fixture"]), "--predictions", str(reference))
    assert rc == 0, capsys.readouterr().out
    s = result["summary"]
    assert (s["same_top"], s["same_hash"], s["fixture_rows"], s["max_gap"]) == (12, 12, 12, 0.0)
    assert all(gates(result).values())
    assert result["service"]["demo"] is True
    assert "same top choice" in capsys.readouterr().out


def swap_binary(rows):
    """The reference's first binary row, its two probabilities swapped: a clear-margin flip."""
    row = next(r for r in rows if len(r["option_ids"]) == 2)
    row["probabilities"] = row["probabilities"][::-1]
    return row


def test_parity_fails_on_a_changed_prompt_hash(live, reference):
    def change(rows):
        rows[3]["prompt_sha256"] = "0" * 64

    path = perturbed(live, reference, "hash", change)
    rc, result = run(live, "parity", "--fixture", str(live["fixture"]), "--predictions", str(path))
    assert rc == 1
    assert gates(result) == {
        "scored": True,
        "prompt_sha256": False,
        "top choice": True,
        "probability gap": True,
    }
    assert result["hash_mismatches"] == [read_jsonl(reference)[3]["id"]]


def test_parity_fails_on_a_flipped_top_with_a_clear_margin(live, reference):
    flipped = {}

    def change(rows):
        flipped.update(swap_binary(rows))

    path = perturbed(live, reference, "flip", change)
    margin = stats.top2_margin(flipped["probabilities"])
    assert 0.02 < margin < 0.1  # a clear margin, and a gap under the gap limit: only the top gate fails
    rc, result = run(live, "parity", "--fixture", str(live["fixture"]), "--predictions", str(path))
    assert rc == 1
    assert gates(result) == {
        "scored": True,
        "prompt_sha256": True,
        "top choice": False,
        "probability gap": True,
    }
    (flip,) = result["disagreements"]
    assert (flip["id"], flip["kind"]) == (flipped["id"], "flip")
    assert flip["our_margin"] == pytest.approx(margin) and flip["reference_margin"] == pytest.approx(margin)
    # The same row under a tie threshold above its margin is a tie flip, reported apart, and passes.
    rc, result = run(
        live,
        "parity",
        "--fixture",
        str(live["fixture"]),
        "--predictions",
        str(path),
        "--tie-margin",
        "0.2",
        out="tie",
    )
    assert rc == 0 and result["summary"]["tie_flips"] == 1 and result["summary"]["real_flips"] == 0


def test_parity_fails_on_a_probability_off_by_0_3(live, reference):
    def change(rows):
        row = next(r for r in rows if len(r["option_ids"]) == 3)
        probs = row["probabilities"]
        top = stats.top_index(probs)
        row["probabilities"] = [p + 0.3 if i == top else p - 0.15 for i, p in enumerate(probs)]

    path = perturbed(live, reference, "gap", change)
    rc, result = run(live, "parity", "--fixture", str(live["fixture"]), "--predictions", str(path))
    assert rc == 1
    assert gates(result) == {
        "scored": True,
        "prompt_sha256": True,
        "top choice": True,
        "probability gap": False,
    }
    assert result["summary"]["max_gap"] == pytest.approx(0.3)


def test_parity_fails_when_a_reference_row_is_missing(live, reference):
    path = perturbed(live, reference, "missing", lambda rows: rows.pop(0))
    rc, result = run(live, "parity", "--fixture", str(live["fixture"]), "--predictions", str(path))
    assert rc == 1 and not gates(result)["scored"]
    assert result["missing_reference"] == ["g0-q0"]


# -- the other commands -------------------------------------------------------------------


def test_noise_floor_is_deterministic(live):
    rc, result = run(live, "noise-floor", "--fixture", str(live["fixture"]))
    assert rc == 0
    assert result["summary"]["identical"] == 12 and result["summary"]["max_gap"] == 0.0


def test_negative_control_makes_parity_fail(live, reference):
    rc, result = run(
        live,
        "negative-control",
        "--fixture",
        str(live["fixture"]),
        "--predictions",
        str(reference),
        "--expect",
        "any",
    )
    assert rc == 0
    assert gates(result) == {"scored": True, "parity fails (any)": True}
    # Every rotated prompt differs; the random demo model's answers ignore the option text, so
    # its top choices may still match (a real model's do not: the spec saw 14/144).
    assert result["summary"]["same_hash"] == 0
    assert "prompt_sha256" in result["summary"]["parity_failed_gates"]


def test_negative_control_verdict_requires_the_expected_gate_and_every_row():
    def parity(**passed):
        names = ("scored", "prompt_sha256", "top choice", "probability gap")
        gate_list = [Gate(n, passed.get(n.replace(" ", "_"), True), "") for n in names]
        return Outcome("negative-control", {"same_top": 5, "fixture_rows": 12}, gate_list, {})

    assert negative_control_verdict(parity(prompt_sha256=False, top_choice=False), "top").passed
    assert not negative_control_verdict(parity(prompt_sha256=False), "top").passed
    assert negative_control_verdict(parity(prompt_sha256=False), "any").passed
    assert not negative_control_verdict(parity(), "any").passed
    # A parity failure from refused rows proves nothing.
    assert not negative_control_verdict(parity(scored=False, top_choice=False), "top").passed


def test_rotate_descriptions_keeps_ids_in_place():
    row = fixture_rows()[1]
    rotated = rotate_descriptions(row)
    assert [o["id"] for o in rotated["options"]] == ["billing", "accounts", "support"]
    assert [o["description"] for o in rotated["options"]] == ["Accounts.", "Support.", "Billing."]
    assert row["options"][0]["description"] == "Billing."  # the input is untouched


def test_shared_matches_direct(live):
    rc, result = run(live, "shared-vs-direct", "--fixture", str(live["fixture"]))
    assert rc == 0
    s = result["summary"]
    assert (s["states"], s["fixture_rows"], s["same_top"], s["same_hash"]) == (4, 12, 12, 12)
    assert s["max_gap"] < 1e-4  # float32 on the CPU: the two paths agree to ~1e-5
    assert all(t["prefix_tokens"] > 0 and t["batch_size"] == 3 for t in result["shared_timings"])


def test_averaging_reports_accuracy_ci_agreement_and_ece(live, capsys):
    rc, result = run(live, "averaging", "--fixture", str(live["fixture"]), "--resamples", "200")
    assert rc == 0
    s = result["summary"]
    assert (s["rows"], s["groups"], s["all_fallback_rows"]) == (12, 4, 0)
    for mode in ("single", "rotations", "all"):
        assert 0.0 <= s["modes"][mode]["accuracy"] <= 1.0
        assert 0.0 <= s["modes"][mode]["ece"] <= 1.0
    for mode in ("rotations", "all"):
        split = s["modes"][mode]
        assert split["unanimous"]["rows"] + split["split"]["rows"] == 12
    for name in ("rotations - single", "all - single", "all - rotations"):
        d = s["differences"][name]
        assert d["ci_low"] <= d["difference"] <= d["ci_high"] and d["resamples"] == 200
    assert [r["rotations"]["orderings"] for r in result["rows"][:3]] == [2, 3, 3]
    assert [r["all"]["orderings"] for r in result["rows"][:3]] == [2, 6, 6]
    assert "95% CI" in capsys.readouterr().out


def test_latency_reports_the_five_rows(live, capsys):
    rc, result = run(
        live,
        "latency",
        "--runs",
        "1",
        "--requests",
        "2",
        "--long-tokens",
        "600",
        "--max-median-ms",
        "1=60000",
    )
    assert rc == 0
    rows = result["summary"]["rows"]
    assert [r["orderings"] for r in rows] == [None, None, "rotations", "all", "rotations"]
    assert all(r["requests"] == 2 and r["e2e_median_ms"] >= r["server_median_ms"] > 0 for r in rows)
    assert abs(result["summary"]["short_input_tokens"] - 130) <= 10
    assert abs(result["summary"]["long_state_tokens"] - 600) <= 30
    assert rows[1]["input_tokens"] > rows[0]["input_tokens"] + 500
    assert gates(result) == {"answered": True, "row 1 median": True}
    assert "server median ms" in capsys.readouterr().out


def test_unreachable_service_exits_2(tmp_path):
    token = tmp_path / "token"
    token.write_text("x" * 12)
    fixture = write_jsonl(tmp_path / "f.jsonl", fixture_rows()[:1])
    rc = cli.main(
        ["noise-floor", "--url", "http://127.0.0.1:9", "--token-file", str(token), "--fixture", str(fixture)]
    )
    assert rc == 2


def test_module_entry_point_runs():
    done = subprocess.run(
        [sys.executable, "-m", "acceptance", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0
    for command in ("parity", "noise-floor", "negative-control", "shared-vs-direct", "averaging", "latency"):
        assert command in done.stdout


# -- the client ---------------------------------------------------------------------------


def test_client_retries_429_busy_then_returns():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.headers["authorization"])
        if len(calls) < 3:
            return httpx.Response(
                429, headers={"Retry-After": "0"}, json={"error": {"code": "busy", "message": "busy"}}
            )
        return httpx.Response(200, json={"id": "x"})

    with Client("http://svc", "tok-123", transport=httpx.MockTransport(handler)) as client:
        body, elapsed = client.decide({"id": "x"})
    assert body == {"id": "x"} and elapsed >= 0 and client.busy_retries == 2
    assert calls == ["Bearer tok-123"] * 3


def test_client_raises_the_error_envelope_and_gives_up_on_busy():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/decide":
            return httpx.Response(
                429, headers={"Retry-After": "0"}, json={"error": {"code": "busy", "message": "m"}}
            )
        return httpx.Response(
            503, json={"error": {"code": "out_of_memory", "message": "split it", "field": None}}
        )

    with Client("http://svc", "t", max_busy_retries=1, transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(ServiceCallError) as busy:
            client.decide({})
        with pytest.raises(ServiceCallError) as oom:
            client.decide_shared("s", [])
    assert (busy.value.status, busy.value.code, client.busy_retries) == (429, "busy", 1)
    assert (oom.value.status, oom.value.code) == (503, "out_of_memory")


# -- pure statistics ----------------------------------------------------------------------


def result(ids, probs, sha="h"):
    return {"id": "r", "option_ids": ids, "probabilities": probs, "prompt_sha256": sha}


def test_compare_results_separates_ties_from_real_flips():
    ours = result(["a", "b"], [0.5, 0.5])
    theirs = result(["a", "b"], [0.45, 0.55])
    assert stats.compare_results(ours, theirs, tie_margin=0.02)["kind"] == "tie_flip"
    ours = result(["a", "b"], [0.7, 0.3])
    assert stats.compare_results(ours, theirs, tie_margin=0.02)["kind"] == "flip"
    # Matched by option id, not position.
    c = stats.compare_results(result(["b", "a"], [0.55, 0.45]), theirs, 0.02)
    assert (c["kind"], c["gap"], c["same_hash"]) == ("match", 0.0, True)
    assert stats.compare_results(result(["a", "c"], [0.5, 0.5]), theirs, 0.02)["kind"] == "option_mismatch"


def test_percentiles_ece_and_accuracy():
    assert stats.median([3, 1, 2]) == 2
    assert stats.percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert stats.top_index([0.2, 0.4, 0.4]) == 1 and stats.top2_margin([0.1, 0.6, 0.3]) == pytest.approx(0.3)
    # Two bins: (0.9: 1 of 2 right) -> |0.5-0.9|, (0.3: 1 of 1 right) -> |1-0.3|; weights 2/3, 1/3.
    ece = expected_calibration_error([0.9, 0.9, 0.3], [True, False, True])
    assert ece == pytest.approx(2 / 3 * 0.4 + 1 / 3 * 0.7)
    assert expected_calibration_error([1.0, 0.0], [True, False]) == pytest.approx(0.0)
    assert stats.accuracy([True, False, True, True]) == 0.75 and stats.accuracy([]) is None


def test_group_bootstrap_is_seeded_and_resamples_groups():
    groups = ["a", "a", "b", "b", "c", "c", "d", "d"]
    base = [False, False, True, False, True, True, False, True]
    treat = [True, True, True, True, True, True, False, True]
    one = stats.group_bootstrap_difference(groups, base, treat, resamples=1000, seed=1)
    two = stats.group_bootstrap_difference(groups, base, treat, resamples=1000, seed=1)
    assert one == two
    assert one["difference"] == pytest.approx(3 / 8) and one["groups"] == 4
    assert one["ci_low"] <= one["difference"] <= one["ci_high"]
    # Every resample draws whole groups: a group worth +1 row never splits, so the bounds are
    # multiples of 1/8 here (each resample has exactly 8 rows).
    assert (one["ci_low"] * 8) == pytest.approx(round(one["ci_low"] * 8))
    same = stats.group_bootstrap_difference(groups, base, base, resamples=50)
    assert (same["difference"], same["ci_low"], same["ci_high"]) == (0.0, 0.0, 0.0)


def test_fit_words_finds_the_target_on_a_linear_tokenizer():
    seen = []

    def measure(words):
        seen.append(words)
        return 47 + int(3.2 * words)

    words, tokens = fit_words(measure, 2000)
    assert abs(tokens - 2000) <= 60 and len(seen) <= 6
    assert fit_words(lambda w: 100 + w, 50) == (1, 101)  # below the floor
    assert filler(40) == filler(40) and filler(40).startswith(filler(10)) and not filler(40).endswith(".")


def test_format_table_aligns_numbers_right():
    text = format_table(["name", "ms"], [["a", 1.5], ["bbb", "12.25 ms"]])
    lines = text.splitlines()
    assert lines[0].startswith("name") and lines[2].endswith("  1.5") and lines[3].endswith("12.25 ms")


# -- the bench table -----------------------------------------------------------------------


def test_bench_table_has_one_row_per_measurement():
    from bench import run as bench

    results = {
        "shared": {
            "prefix_tokens": 1000,
            "shared_median_s": 1.0,
            "sequential_median_s": 9.0,
            "speedup": 9.0,
            "server_speedup": 9.5,
            "met": True,
            "shared_timing": {"true_suffix_tokens": 1470, "batch_size": 21},
            "terse_timing": {"true_suffix_tokens": 1092, "batch_size": 21},
            "terse_shared_s": 0.8,
            "terse_sequential_s": 8.0,
            "terse_speedup": 10.0,
        },
        "overhead": {
            "input_tokens": 500,
            "e2e_median_ms": 300.0,
            "forward_median_ms": 296.0,
            "overhead_ms": 4.0,
            "overhead_share": 0.013,
            "in_server_outside_forward_ms": 1.5,
            "health_round_trip_ms": 1.2,
            "met": True,
        },
        "rotations": {
            "input_tokens": 2100,
            "rotations_median_ms": 1300.0,
            "single_median_ms": 1200.0,
            "ratio": 1.08,
            "server_ratio": 1.09,
            "met": True,
        },
        "memory": {
            "requests": 4,
            "rows_per_request": 64,
            "max_prompt_tokens": 4029,
            "baseline_mib": 1200.0,
            "peak_mib": 3100.0,
            "settled_mib": 1380.0,
            "settled_growth": 0.15,
            "after_traffic_growth": 0.01,
            "met": False,
        },
        "concurrency": {
            "1 client": {"requests_per_s": 8.0, "p50_ms": 120.0, "p99_ms": 130.0},
            "16 clients": {"requests_per_s": 8.2, "p50_ms": 1900.0, "p99_ms": 2000.0},
        },
    }
    rows = bench.table_rows(results)
    assert [r[3] for r in rows] == ["yes", "-", "yes", "yes", "NO", "-"]
    assert "9.0x" in rows[0][1] and "70 tok/row" in rows[1][0] and "10.0x" in rows[1][1]
    assert "+15.0%" in rows[4][1] and "16 clients" in rows[5][0]
    assert bench.table_rows({}) == []


@pytest.mark.parametrize("mode", ["single", "rotations"])
def test_scored_service_output_feeds_the_calibrate_command(live, capsys, mode):
    from semif_serve.tools.cli import main as semif_main

    path = live["work"] / f"scored-{mode}.jsonl"
    extra = [] if mode == "single" else ["--orderings", mode]
    rc, result = run(
        live, "score", "--fixture", str(live["fixture"]), "--predictions-out", str(path), *extra, out=mode
    )
    assert rc == 0 and result["summary"]["scored"] == 12
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(("combined" in r) == (mode != "single") for r in rows)
    capsys.readouterr()
    args = ["calibrate", "--gold", str(live["fixture"]), "--predictions", str(path), "--mode", mode]
    assert semif_main([*args, "--workload", "w"]) == 0
    entry = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    value = entry["w"] if mode == "single" else entry["w"][mode]
    assert 0.05 <= value <= 20


def test_a_result_without_out_goes_to_the_user_state_directory_never_the_checkout(
    live, tmp_path, monkeypatch, capsys
):
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    monkeypatch.chdir(checkout)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    connection = ["--url", live["url"], "--token-file", str(live["token"])]
    fixture = ["--fixture", str(live["fixture"]), "--limit", "2"]
    assert cli.main(["score", *connection, *fixture, "--predictions-out", str(tmp_path / "p.jsonl")]) == 0
    assert list(checkout.iterdir()) == []
    (written,) = (tmp_path / "state" / "semif-serve" / "acceptance-results").glob("score-*.json")
    assert json.loads(written.read_text())["summary"] == {"rows": 2, "scored": 2}
    assert str(written) in capsys.readouterr().out
