"""Temperature calibration: the file, applying T, fitting T, and the `calibrate` command."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from semif_serve.domain.calibration import (
    CalibrationFileError,
    CalibrationTable,
    Temperature,
    calibrated_probabilities,
    load_calibration,
)
from semif_serve.domain.fitting import calibration_report, fit_temperature, group_folds
from semif_serve.domain.numerics import top_label_ece as expected_calibration_error
from semif_serve.tools.cli import main


def run_calibrate(argv: list[str]) -> int:
    """`semif-serve calibrate ARGV` through the real command line; argparse's exits become the status."""
    try:
        return main(["calibrate", *argv])
    except SystemExit as exc:  # argparse exits on --help (0) and on bad arguments (2)
        return exc.code if isinstance(exc.code, int) else 2


def write(tmp_path: Path, text: str, name: str = "calibration.json") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def softmax_by_hand(logits: list[float], temperature: float) -> list[float]:
    exps = [math.exp(z / temperature) for z in logits]
    return [e / sum(exps) for e in exps]


def sample_index(rng: random.Random, probs: list[float]) -> int:
    u, acc = rng.random(), 0.0
    for i, p in enumerate(probs):
        acc += p
        if u < acc:
            return i
    return len(probs) - 1


def planted_rows(seed: int, n: int, t_true: float) -> list[tuple[list[float], int]]:
    """Rows whose gold is drawn from softmax(z / t_true): the MLE of T should be near t_true."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        z = [rng.gauss(0.0, 3.0) for _ in range(rng.randint(2, 4))]
        rows.append((z, sample_index(rng, softmax_by_hand(z, t_true))))
    return rows


# --- the calibration file ---------------------------------------------------------------


def test_no_calibration_file_gives_an_empty_table() -> None:
    table = load_calibration(None)
    assert table.names() == [] and table.as_dict() == {}


def test_a_missing_file_is_refused_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(CalibrationFileError, match="nope.json"):
        load_calibration(tmp_path / "nope.json")


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("{not json", "not valid JSON"),
        ("[1.5]", "JSON object"),
        ('{"": 1.5}', "name is empty"),
        ('{"wanli256": true}', '"wanli256"'),
        ('{"wanli256": "2.5"}', '"wanli256"'),
        ('{"wanli256": NaN}', '"wanli256"'),
        ('{"wanli256": Infinity}', '"wanli256"'),
        ('{"wanli256": -Infinity}', '"wanli256"'),
        ('{"wanli256": 0.01}', '"wanli256"'),
        ('{"wanli256": 25}', '"wanli256"'),
        ('{"wanli256": {"rotations": 2.0}}', '"wanli256".*"single"'),
        ('{"wanli256": {"single": 2.0, "rotation": 2.0}}', '"wanli256".*"rotation"'),
        ('{"wanli256": {"single": 2.0, "all": false}}', '"wanli256".*"all"'),
        ('{"wanli256": 2.0, "wanli256": 3.0}', 'duplicate.*"wanli256"'),
    ],
)
def test_each_bad_calibration_file_is_refused_naming_the_file_and_entry(
    tmp_path: Path, text: str, named: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(CalibrationFileError, match=named) as info:
        load_calibration(path)
    assert "calibration.json" in str(info.value)


def test_a_temperature_of_25_is_refused_naming_the_workload_and_mode(tmp_path: Path) -> None:
    path = write(tmp_path, '{"wanli256": {"single": 2.499, "rotations": 25}}')
    with pytest.raises(CalibrationFileError) as info:
        load_calibration(path)
    message = str(info.value)
    assert '"wanli256"' in message and '"rotations"' in message and "25" in message


def test_an_empty_object_is_a_valid_calibration_file(tmp_path: Path) -> None:
    assert load_calibration(write(tmp_path, "{}")).names() == []


def test_the_bounds_themselves_are_accepted(tmp_path: Path) -> None:
    table = load_calibration(write(tmp_path, '{"a": 0.05, "b": 20}'))
    assert table.temperature("a", "single").value == 0.05
    assert table.temperature("b", "single").value == 20.0


def test_number_and_object_forms_parse_with_fallback_to_the_single_read(tmp_path: Path) -> None:
    text = '{"wanli256": 2.499, "authored144": {"single": 1.2342, "rotations": 1.1}}'
    table = load_calibration(write(tmp_path, text))
    assert table.names() == ["authored144", "wanli256"]
    assert table.temperature("authored144", "rotations") == Temperature(1.1, "rotations", "rotations")
    assert table.temperature("authored144", "all") == Temperature(1.2342, "all", "single")
    assert table.temperature("wanli256", "rotations") == Temperature(2.499, "rotations", "single")
    assert table.as_dict() == {
        "authored144": {"single": 1.2342, "rotations": 1.1},
        "wanli256": {"single": 2.499},
    }
    json.dumps(table.as_dict())  # fit for /health


def test_an_unknown_workload_raises_key_error() -> None:
    table = CalibrationTable({"every154": {"single": 1.7086}})
    with pytest.raises(KeyError):
        table.temperature("authored144", "single")


def test_a_loaded_table_cannot_be_edited(tmp_path: Path) -> None:
    table = load_calibration(write(tmp_path, '{"every154": 1.7086}'))
    with pytest.raises(TypeError):
        table.entries["every154"]["single"] = 3.0  # type: ignore[index]
    table.as_dict()["every154"]["single"] = 3.0
    assert table.temperature("every154", "single").value == 1.7086


# --- applying a temperature ---------------------------------------------------------------


def test_calibrated_probabilities_are_softmax_of_logits_over_t() -> None:
    logits = [2.0, -1.0, 0.5]
    expected = softmax_by_hand(logits, 1.7)
    assert calibrated_probabilities(logits, 1.7) == pytest.approx(expected, rel=1e-12)


def test_calibrated_probabilities_stay_finite_for_huge_logits() -> None:
    probs = calibrated_probabilities([1000.0, 999.0], 0.05)
    assert all(math.isfinite(p) for p in probs) and sum(probs) == pytest.approx(1.0)


def test_calibration_never_changes_the_argmax() -> None:
    rng = random.Random(7)
    for _ in range(500):
        logits = [rng.uniform(-30, 30) for _ in range(rng.randint(2, 6))]
        t = rng.uniform(0.05, 20)
        probs = calibrated_probabilities(logits, t)
        assert probs.index(max(probs)) == logits.index(max(logits))


# --- fitting a temperature ----------------------------------------------------------------


def test_the_fit_recovers_a_planted_temperature_of_2() -> None:
    fitted = fit_temperature(planted_rows(seed=11, n=3000, t_true=2.0))
    assert abs(fitted - 2.0) <= 0.2


def test_the_fit_recovers_a_planted_temperature_below_1() -> None:
    fitted = fit_temperature(planted_rows(seed=12, n=3000, t_true=0.5))
    assert abs(fitted - 0.5) <= 0.05


def test_an_always_right_confident_model_hits_the_lower_bound() -> None:
    fitted = fit_temperature([([1.0, 0.0], 0)] * 50)
    assert 0.05 <= fitted <= 0.05 + 1e-6


def test_an_always_wrong_model_hits_the_upper_bound() -> None:
    fitted = fit_temperature([([1.0, 0.0, 0.5], 1)] * 50)
    assert 20 - 1e-6 <= fitted <= 20


def test_the_fit_refuses_zero_rows() -> None:
    with pytest.raises(ValueError):
        fit_temperature([])


def test_ece_matches_a_hand_computation() -> None:
    # Top-label, 10 bins:
    #   [0.90, 0.10] gold 0 -> conf 0.90, right, bin 9
    #   [0.20, 0.80] gold 0 -> conf 0.80, wrong, bin 8
    #   [0.60, 0.40] gold 0 -> conf 0.60, right, bin 6
    #   [0.35, 0.65] gold 1 -> conf 0.65, right, bin 6
    # bin 6: |1 - 0.625| * 2/4 = 0.1875; bin 8: |0 - 0.8| * 1/4 = 0.2;
    # bin 9: |1 - 0.9| * 1/4 = 0.025; total 0.4125.
    probs = [[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.35, 0.65]]
    assert expected_calibration_error(probs, [0, 0, 0, 1]) == pytest.approx(0.4125)


def test_ece_of_a_perfectly_calibrated_bin_is_zero() -> None:
    # Four rows at confidence 0.75, three of them right: accuracy 0.75 == confidence.
    probs = [[0.75, 0.25]] * 4
    assert expected_calibration_error(probs, [0, 0, 0, 1]) == pytest.approx(0.0)


def test_group_folds_never_split_a_group_and_make_five_folds() -> None:
    rng = random.Random(3)
    group_ids = [f"g{rng.randint(0, 40)}" for _ in range(400)]
    folds = group_folds(group_ids)
    assert len(folds) == len(group_ids)
    assert set(folds) == {0, 1, 2, 3, 4}
    fold_of: dict[str, int] = {}
    for group, fold in zip(group_ids, folds, strict=True):
        assert fold_of.setdefault(group, fold) == fold
    assert group_folds(list(reversed(group_ids))) == list(reversed(folds))  # deterministic


def test_the_report_improves_nll_and_gives_an_out_of_fold_ece() -> None:
    rows = planted_rows(seed=5, n=600, t_true=3.0)
    report = calibration_report(rows, [i // 4 for i in range(len(rows))])
    assert report["n"] == 600
    expected_accuracy = sum(z.index(max(z)) == g for z, g in rows) / len(rows)
    assert report["accuracy"] == pytest.approx(expected_accuracy)
    assert report["nll_after"] <= report["nll_before"]
    assert 0.0 <= report["ece_out_of_fold"] <= 1.0
    assert report["temperature"] == pytest.approx(fit_temperature(rows))
    assert 1.5 < report["temperature"] < 5.0


# --- the calibrate command ----------------------------------------------------------------


def write_fixtures(tmp_path: Path, n: int, t_true: float, seed: int) -> tuple[Path, Path, float]:
    """Gold rows in canonical option order; predictions with option_ids shuffled per row.

    Returns the gold path, the predictions path and the accuracy of argmax in canonical order.
    """
    rng = random.Random(seed)
    gold_lines, pred_lines, right = [], [], 0
    for i in range(n):
        k = rng.randint(2, 4)
        option_ids = [f"opt{j}" for j in range(k)]
        z = [rng.gauss(0.0, 3.0) for _ in range(k)]
        label = sample_index(rng, softmax_by_hand(z, t_true))
        right += z.index(max(z)) == label
        options = [{"id": oid, "description": f"option {oid}"} for oid in option_ids]
        gold_lines.append(
            {
                "id": f"r{i}",
                "group_id": f"g{i // 3}",
                "options": options,
                "label": label,
                "state": "...",
            }
        )
        order = list(range(k))
        rng.shuffle(order)
        pred_lines.append(
            {
                "id": f"r{i}",
                "option_ids": [option_ids[j] for j in order],
                "option_logits": [z[j] for j in order],
                "decision": "x",
            }
        )
    rng.shuffle(pred_lines)
    gold = write(tmp_path, "\n".join(json.dumps(r) for r in gold_lines) + "\n", "authored.jsonl")
    preds = write(tmp_path, "\n".join(json.dumps(r) for r in pred_lines) + "\n", "preds.jsonl")
    return gold, preds, right / n


def test_calibrate_remaps_shuffled_options_and_prints_a_pasteable_entry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gold, preds, accuracy = write_fixtures(tmp_path, n=900, t_true=2.0, seed=21)
    out = tmp_path / "report.json"
    argv = ["--gold", str(gold), "--predictions", str(preds), "--workload", "authored144"]
    assert run_calibrate([*argv, "--json", str(out)]) == 0
    entry = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(entry) == ["authored144"]
    assert 1.6 < entry["authored144"] < 2.5
    report = json.loads(out.read_text())
    assert report["n"] == 900
    assert report["accuracy"] == pytest.approx(accuracy)  # wrong remapping would be near 1/k
    assert report["missing_predictions"] == 0 and report["missing_gold"] == 0
    # The printed entry is a valid calibration file.
    table = load_calibration(write(tmp_path, json.dumps(entry)))
    assert table.temperature("authored144", "single").source == "single"


def test_calibrate_counts_rows_missing_on_either_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gold, preds, _ = write_fixtures(tmp_path, n=60, t_true=1.0, seed=2)
    lines = preds.read_text().splitlines()
    extra = {"id": "stranger", "option_ids": ["a", "b"], "option_logits": [0.0, 1.0]}
    preds.write_text("\n".join([*lines[1:], json.dumps(extra)]) + "\n")
    out = tmp_path / "report.json"
    argv = ["--gold", str(gold), "--predictions", str(preds), "--json", str(out)]
    assert run_calibrate(argv) == 0
    report = json.loads(out.read_text())
    assert (report["n"], report["missing_predictions"], report["missing_gold"]) == (59, 1, 1)
    assert report["workload"] == "authored"  # defaults to the gold file's stem
    capsys.readouterr()


def test_calibrate_in_rotations_mode_reads_combined_probabilities(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gold, preds, _ = write_fixtures(tmp_path, n=300, t_true=2.0, seed=9)
    rows = [json.loads(line) for line in preds.read_text().splitlines()]
    for row in rows:
        # Sharpen the averaged output to T=0.5 of the raw logits; the junk logits must be ignored.
        probs = softmax_by_hand(row["option_logits"], 0.5)
        row["combined"] = {
            "mode": "rotations",
            "probabilities": dict(zip(row["option_ids"], probs, strict=True)),
        }
        row["option_logits"] = [0.0] * len(probs)
    preds.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    argv = ["--gold", str(gold), "--predictions", str(preds), "--mode", "rotations"]
    assert run_calibrate([*argv, "--workload", "wanli256"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    entry = json.loads(printed[-1])
    # log(softmax(z / 0.5)) = 2z + c, so the fitted T is about 4 (2.0 / 0.5).
    assert 3.0 < entry["wanli256"]["rotations"] < 5.0
    assert any("single" in line for line in printed[:-1])


def test_a_malformed_line_exits_2_naming_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gold, preds, _ = write_fixtures(tmp_path, n=10, t_true=1.0, seed=4)
    lines = preds.read_text().splitlines()
    lines[2] = "{not json"
    preds.write_text("\n".join(lines) + "\n")
    assert run_calibrate(["--gold", str(gold), "--predictions", str(preds)]) == 2
    err = capsys.readouterr().err
    assert "line 3" in err and "preds.jsonl" in err


def test_a_gold_label_out_of_range_exits_2_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gold, preds, _ = write_fixtures(tmp_path, n=10, t_true=1.0, seed=4)
    lines = [json.loads(line) for line in gold.read_text().splitlines()]
    lines[4]["label"] = 9
    gold.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    assert run_calibrate(["--gold", str(gold), "--predictions", str(preds)]) == 2
    assert "line 5" in capsys.readouterr().err


def test_no_joined_rows_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gold, _, _ = write_fixtures(tmp_path, n=10, t_true=1.0, seed=4)
    other = write(
        tmp_path, json.dumps({"id": "zz", "option_ids": ["a"], "option_logits": [1]}), "other.jsonl"
    )
    assert run_calibrate(["--gold", str(gold), "--predictions", str(other)]) == 2
    assert "no gold row" in capsys.readouterr().err


def test_bad_arguments_exit_2_without_raising(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_calibrate(["--gold", "x.jsonl"]) == 2
    assert "semif-serve calibrate" in capsys.readouterr().err


def with_combined(preds: Path, mode: str | None) -> list[dict]:
    """The predictions with a `combined` block of `mode` (its probabilities: softmax of the logits)."""
    rows = [json.loads(line) for line in preds.read_text().splitlines()]
    for row in rows:
        if mode is not None:
            probs = softmax_by_hand(row["option_logits"], 1.0)
            row["combined"] = {
                "mode": mode,
                "probabilities": dict(zip(row["option_ids"], probs, strict=True)),
            }
    preds.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return rows


@pytest.mark.parametrize("mode", ["rotations", "all"])
def test_a_rotations_or_all_fit_on_single_read_predictions_is_refused_naming_combined(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    gold, preds, _ = write_fixtures(tmp_path, n=200, t_true=2.0, seed=9)
    out = tmp_path / "report.json"
    argv = ["--gold", str(gold), "--predictions", str(preds), "--mode", mode, "--json", str(out)]
    assert run_calibrate(argv) == 2
    captured = capsys.readouterr()
    assert "preds.jsonl line 1" in captured.err
    assert "`combined`" in captured.err and "combined.probabilities" in captured.err
    assert f"--orderings {mode}" in captured.err
    assert captured.out == "" and not out.exists()  # no entry to paste, no report


def test_predictions_averaged_over_other_orderings_are_refused_naming_combined_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gold, preds, _ = write_fixtures(tmp_path, n=200, t_true=2.0, seed=9)
    with_combined(preds, "rotations")
    assert run_calibrate(["--gold", str(gold), "--predictions", str(preds), "--mode", "all"]) == 2
    err = capsys.readouterr().err
    assert 'combined.mode is "rotations", not "all"' in err


def test_a_single_fit_reads_option_logits_even_when_combined_is_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gold, preds, _ = write_fixtures(tmp_path, n=300, t_true=2.0, seed=9)
    argv = ["--gold", str(gold), "--predictions", str(preds), "--workload", "w"]
    assert run_calibrate(argv) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = with_combined(preds, "rotations")
    for row in rows:  # a combined answer unlike the single read: a single fit must not see it
        row["combined"]["probabilities"] = {i: 1 / len(rows[0]["option_ids"]) for i in row["option_ids"]}
    preds.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert run_calibrate(argv) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == plain


def relabel_to_the_least_likely_option(gold: Path, preds: Path) -> None:
    """Every gold label becomes the option with the lowest logit: a model that is always wrong."""
    logits = {}
    for line in preds.read_text().splitlines():
        row = json.loads(line)
        logits[row["id"]] = dict(zip(row["option_ids"], row["option_logits"], strict=True))
    rows = [json.loads(line) for line in gold.read_text().splitlines()]
    for row in rows:
        by_id = logits[row["id"]]
        scores = [by_id[o["id"]] for o in row["options"]]
        row["label"] = scores.index(min(scores))
    gold.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def top_label_ece_by_hand(gold: Path, preds: Path, temperature: float) -> float:
    """ECE (10 equal-width bins, top label), written out from the files, not from the command."""
    labels = {}
    for line in gold.read_text().splitlines():
        row = json.loads(line)
        labels[row["id"]] = row["options"][row["label"]]["id"]
    bins: dict[int, list[tuple[float, bool]]] = {}
    for line in preds.read_text().splitlines():
        row = json.loads(line)
        probs = softmax_by_hand(row["option_logits"], temperature)
        top = probs.index(max(probs))
        bins.setdefault(min(int(probs[top] * 10), 9), []).append(
            (probs[top], row["option_ids"][top] == labels[row["id"]])
        )
    total = sum(len(b) for b in bins.values())
    return sum(abs(sum(ok for _, ok in b) - sum(c for c, _ in b)) for b in bins.values()) / total


def test_24_rows_that_fit_the_bound_warn_and_print_ece_before_and_after(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gold, preds, _ = write_fixtures(tmp_path, n=24, t_true=1.0, seed=6)
    relabel_to_the_least_likely_option(gold, preds)
    out = tmp_path / "report.json"
    assert run_calibrate(["--gold", str(gold), "--predictions", str(preds), "--json", str(out)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1]) == {"authored": 20.0}
    warnings = [line for line in captured.err.splitlines() if "warning:" in line]
    assert any("only 24 rows" in w and "150" in w for w in warnings), captured.err
    assert any("T = 20 is the upper bound of [0.05, 20]" in w for w in warnings), captured.err
    report = json.loads(out.read_text())
    assert len(report["warnings"]) == len(warnings)
    ece_before = top_label_ece_by_hand(gold, preds, 1.0)
    ece_after = top_label_ece_by_hand(gold, preds, 20.0)
    in_sample = next(line for line in captured.out.splitlines() if "(in-sample)" in line)
    assert f"T=1 {ece_before:.4f}" in in_sample and f"fitted {ece_after:.4f}" in in_sample
    out_of_fold = next(line for line in captured.out.splitlines() if "(out-of-fold" in line)
    assert f"T=1 {ece_before:.4f}" in out_of_fold
    assert f"fitted {report['ece_out_of_fold']:.4f}" in out_of_fold


def test_a_lower_bound_fit_warns_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gold, preds, _ = write_fixtures(tmp_path, n=200, t_true=1.0, seed=6)
    rows = [json.loads(line) for line in preds.read_text().splitlines()]
    labels = {json.loads(line)["id"]: json.loads(line) for line in gold.read_text().splitlines()}
    for row in rows:  # the gold option gets the largest logit by a wide margin: always right
        gold_id = labels[row["id"]]["options"][labels[row["id"]]["label"]]["id"]
        row["option_logits"] = [3.0 if i == gold_id else 0.0 for i in row["option_ids"]]
    preds.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert run_calibrate(["--gold", str(gold), "--predictions", str(preds)]) == 0
    err = capsys.readouterr().err
    assert "T = 0.05 is the lower bound" in err and "only" not in err


def test_a_well_fitted_workload_prints_no_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gold, preds, _ = write_fixtures(tmp_path, n=900, t_true=2.0, seed=21)
    assert run_calibrate(["--gold", str(gold), "--predictions", str(preds)]) == 0
    captured = capsys.readouterr()
    assert "warning" not in captured.err
    assert "(in-sample)" in captured.out and "(out-of-fold" in captured.out


# --- the reliability diagram --------------------------------------------------------------


def bin_accuracies_by_hand(gold: Path, preds: Path, temperature: float) -> dict[int, float]:
    labels = {}
    for line in gold.read_text().splitlines():
        row = json.loads(line)
        labels[row["id"]] = row["options"][row["label"]]["id"]
    hits: dict[int, list[bool]] = {}
    for line in preds.read_text().splitlines():
        row = json.loads(line)
        probs = softmax_by_hand(row["option_logits"], temperature)
        top = probs.index(max(probs))
        hits.setdefault(min(int(probs[top] * 10), 9), []).append(row["option_ids"][top] == labels[row["id"]])
    return {b: sum(h) / len(h) for b, h in hits.items()}


def test_plot_writes_a_png_whose_bars_are_the_bin_accuracies_before_and_after(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from PIL import Image

    from semif_serve.tools import reliability_plot

    drawn = []
    real = reliability_plot.reliability_figure

    def spy(*args):
        drawn.append(real(*args))
        return drawn[-1]

    monkeypatch.setattr(reliability_plot, "reliability_figure", spy)
    gold, preds, _ = write_fixtures(tmp_path, n=900, t_true=2.0, seed=21)
    out, plot = tmp_path / "report.json", tmp_path / "reliability.png"
    argv = ["--gold", str(gold), "--predictions", str(preds), "--json", str(out), "--plot", str(plot)]
    assert run_calibrate(argv) == 0
    capsys.readouterr()
    report = json.loads(out.read_text())
    with Image.open(plot) as image:
        assert image.format == "PNG" and image.width > 400 and image.height > 200
        texts = image.text
    assert f"ECE {report['ece_before']:.4f}" in texts["Title"]
    assert f"ECE {report['ece_after']:.4f}" in texts["Title"]
    (figure,) = drawn
    for axes, temperature in zip(figure.axes, [1.0, report["temperature"]], strict=True):
        expected = bin_accuracies_by_hand(gold, preds, temperature)
        bars = {round(bar.get_x() * 10): bar.get_height() for bar in axes.patches}
        assert set(bars) == set(expected)
        for b, accuracy in expected.items():
            assert bars[b] == pytest.approx(accuracy, abs=1e-9), (temperature, b)


def test_plot_without_matplotlib_exits_2_saying_how_to_get_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # an import of it now fails
    gold, preds, _ = write_fixtures(tmp_path, n=60, t_true=1.0, seed=2)
    argv = ["--gold", str(gold), "--predictions", str(preds), "--plot", str(tmp_path / "x.png")]
    assert run_calibrate(argv) == 2
    assert "--extra plot" in capsys.readouterr().err


def test_plot_to_an_unwritable_path_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gold, preds, _ = write_fixtures(tmp_path, n=60, t_true=1.0, seed=2)
    argv = ["--gold", str(gold), "--predictions", str(preds), "--plot", str(tmp_path / "no" / "x.png")]
    assert run_calibrate(argv) == 2
    assert "x.png" in capsys.readouterr().err
