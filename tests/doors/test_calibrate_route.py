"""`POST /calibrate` through the real app: the fit `semif-serve calibrate` prints for the same rows
(the command run on JSONL files written here), the metrics at T=1 computed by hand, bearer auth,
and every broken rule a 422 naming the field."""

from __future__ import annotations

import json
import math
import random
import threading
from pathlib import Path

import pytest

import semif_serve.doors.native.api as native_api
from semif_serve.app import create_app
from semif_serve.domain.fitting import calibration_report, reliability_bins
from semif_serve.service.startup import Service
from semif_serve.tools.cli import main
from tests.support import in_process_client, make_settings


def labelled_rows(n: int, seed: int) -> list[dict]:
    """Rows of 2-4 logits whose labels are drawn from softmax(z / 2), in groups of three."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        logits = [rng.gauss(0.0, 3.0) for _ in range(rng.randint(2, 4))]
        weights = [math.exp(z / 2.0) for z in logits]
        label = rng.choices(range(len(logits)), weights=weights)[0]
        rows.append({"logits": logits, "label": label, "group": f"g{i // 3}"})
    return rows


def cli_report(tmp_path: Path, rows: list[dict], workload: str) -> dict:
    """`semif-serve calibrate --json` on the same rows, written as gold and prediction files."""
    gold, preds = tmp_path / f"{workload}.jsonl", tmp_path / "preds.jsonl"
    gold.write_text(
        "".join(
            json.dumps(
                {
                    "id": i,
                    "group_id": r["group"],
                    "options": [{"id": f"o{k}"} for k in range(len(r["logits"]))],
                    "label": r["label"],
                }
            )
            + "\n"
            for i, r in enumerate(rows)
        )
    )
    preds.write_text(
        "".join(
            json.dumps(
                {
                    "id": i,
                    "option_ids": [f"o{k}" for k in range(len(r["logits"]))],
                    "option_logits": r["logits"],
                }
            )
            + "\n"
            for i, r in enumerate(rows)
        )
    )
    out = tmp_path / "report.json"
    assert main(["calibrate", "--gold", str(gold), "--predictions", str(preds), "--json", str(out)]) == 0
    return json.loads(out.read_text())


def by_hand(rows: list[dict]) -> dict:
    """Accuracy, mean NLL and mean Brier at T=1, from the rows alone."""
    right, nll, brier = 0, 0.0, 0.0
    for r in rows:
        exps = [math.exp(z) for z in r["logits"]]
        probs = [e / sum(exps) for e in exps]
        right += probs.index(max(probs)) == r["label"]
        nll -= math.log(probs[r["label"]])
        brier += sum((p - (k == r["label"])) ** 2 for k, p in enumerate(probs))
    return {"accuracy": right / len(rows), "nll_before": nll / len(rows), "brier_before": brier / len(rows)}


def test_the_route_reports_what_the_calibrate_command_prints_for_the_same_rows(client, tmp_path):
    rows = labelled_rows(240, seed=5)
    reply = client.post("/calibrate", json={"workload": "tickets", "rows": rows})
    assert reply.status_code == 200, reply.text
    got = reply.json()
    expected = cli_report(tmp_path, rows, "tickets")
    for key in (
        "n",
        "groups",
        "accuracy",
        "temperature",
        "nll_before",
        "nll_after",
        "ece_before",
        "ece_after",
    ):
        assert got[key] == pytest.approx(expected[key], abs=1e-12), key
    assert got["ece_out_of_fold"] == pytest.approx(expected["ece_out_of_fold"], abs=1e-12)
    assert got["folds"] == expected["folds"]
    assert got["warnings"] == expected["warnings"]
    assert got["entry"] == expected["entry"] == {"tickets": round(expected["temperature"], 4)}
    for key, value in by_hand(rows).items():
        assert got[key] == pytest.approx(value, abs=1e-9), key
    assert 1.4 < got["temperature"] < 2.8  # the labels were drawn at T=2
    for side in ("bins_before", "bins_after"):
        assert len(got[side]) == 10 and sum(b["count"] for b in got[side]) == 240
    # ECE is the bins' count-weighted gap, so the drawn diagram and the number agree.
    gap = sum(b["count"] * abs(b["accuracy"] - b["confidence"]) for b in got["bins_after"]) / 240
    assert gap == pytest.approx(got["ece_after"], abs=1e-12)


def test_the_route_needs_the_bearer_token(client):
    body = {"workload": "w", "rows": labelled_rows(3, seed=1)}
    reply = client.post("/calibrate", json=body, auth=False)
    assert reply.status_code == 401
    assert reply.json()["error"]["code"] == "unauthorized"


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        (lambda b: b["rows"][1].update(label=4), "rows[1].label", "label must index logits (0..1), got 4"),
        (lambda b: b["rows"][1].update(label=-1), "rows[1].label", "got -1"),
        (lambda b: b["rows"][2].update(logits=[1.0]), "rows[2].logits", "at least 2"),
        (lambda b: b["rows"][0].update(logits=[1.0, "2"]), "rows[0].logits[1]", "number"),
        (lambda b: b["rows"][0].pop("group"), "rows[0].group", "required"),
        (lambda b: b.update(rows=[]), "rows", "at least 1"),
        (lambda b: b.update(workload=" "), "workload", "non-empty"),
        (lambda b: b["rows"][0].update(logits=[1e307, 0.0]), "rows[0].logits", "within +-1e+06"),
    ],
)
def test_a_broken_rule_is_a_422_naming_the_field(client, change, field, words):
    body = {"workload": "w", "rows": [{"logits": [0.5, -0.5], "label": 0, "group": k} for k in range(3)]}
    change(body)
    reply = client.post("/calibrate", json=body)
    assert reply.status_code == 422, reply.text
    error = reply.json()["error"]
    assert (error["code"], error["field"]) == ("validation_error", field)
    assert words in error["message"]


def test_rows_over_the_logit_limit_are_refused_before_any_fit(engine, checkpoint):
    small = Service.start(make_settings(checkpoint, calibrate_max_logits=8), engine=engine)
    client = in_process_client(create_app(small))
    at_limit = {"workload": "w", "rows": [{"logits": [0.0, 1.0], "label": 1, "group": k} for k in range(4)]}
    assert client.post("/calibrate", json=at_limit).status_code == 200
    over = {**at_limit, "rows": [*at_limit["rows"], {"logits": [0.0, 1.0], "label": 0, "group": 9}]}
    reply = client.post("/calibrate", json=over)
    assert reply.status_code == 422
    error = reply.json()["error"]
    assert (error["code"], error["field"]) == ("validation_error", "rows")
    assert "10 logits" in error["message"] and "SEMIF_CALIBRATE_MAX_LOGITS" in error["message"]


def test_logits_at_the_float_limit_fit_to_finite_numbers_not_nan():
    # z / T at the search's least T (0.05) overflows these; the fit must shift before it scales.
    rows = [([1e307, 0.0], 0), ([0.0, 1e307], 0), ([1e308, -1e308], 0), ([0.5, -0.5], 1)]
    report = calibration_report(rows, ["a", "b", "c", "d"])
    numbers = [value for value in report.values() if isinstance(value, float)]
    assert numbers and all(math.isfinite(value) for value in numbers)
    for temperature in (0.05, 1.0, 20.0):  # the reliability bins read softmax at any T
        assert all(math.isfinite(b.confidence) for b in reliability_bins(rows, temperature) if b.count)


def test_fits_run_on_their_own_thread_so_decisions_keep_the_shared_pool(client):
    seen = []
    original = native_api.calibration_report

    def recording(*args):
        seen.append(threading.current_thread().name)
        return original(*args)

    body = {"workload": "w", "rows": [{"logits": [0.5, -0.5], "label": k % 2, "group": k} for k in range(8)]}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native_api, "calibration_report", recording)
        reply = client.post("/calibrate", json=body)
    assert reply.status_code == 200, reply.text
    assert seen and all(name.startswith("semif-calibrate") for name in seen)
