"""`semif-serve presentation-checks` on the demo's checkpoint: every number of its report equals
the metric computed here by hand from the service's own replies (SemIf's method through `/decide`,
lev's through `/v1/systemone` and lev's per-row forward), by URL against a real uvicorn it
reports what it reports in process, `--compare` against the committed report names each metric a
regression moves (tests/docs/test_readme.py compares this tree clean), and bad input is one line
and exit 2 before any model loads."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from pathlib import Path

import pytest

from semif_serve.app import create_app
from semif_serve.domain.lev.calibration import UNCALIBRATED
from semif_serve.domain.lev.types import LevChoice
from semif_serve.service.startup import Service
from semif_serve.tools import presentation_checks as checks
from semif_serve.tools.cli import main
from semif_serve.tools.demo import DEMO_REVISION, demo_lev_directory, ensure_demo_models
from tests.support import TOKEN, in_process_client, make_settings

ROOT = Path(__file__).resolve().parents[2]
CALIBRATION = ROOT / "conf" / "calibration.json"
COMMITTED = ROOT / "conf" / "presentation-report.json"
WORKLOAD, T = "authored144", 1.2342  # conf/calibration.json: one T for every mode
STATES = ["Customer says they were charged twice for the March invoice.", "The login page returns 500."]
CLOSE = 1e-4  # /decide and System One batch rows differently: float32 logits agree within 1e-5


@pytest.fixture(scope="module")
def service(vision_engine, vision_checkpoint, tmp_path_factory):
    """The demo's checkpoint and lev release (served as lev-demo, and again as lev-rotations with its
    scores read in every rotation) and the shipped calibration, over the session's engine."""
    release = demo_lev_directory(vision_checkpoint) / "lev-demo"
    ensure_demo_models(vision_checkpoint)
    models = tmp_path_factory.mktemp("presentation") / "models.toml"
    models.write_text(
        f'[models.lev-demo]\nrelease = "{release}"\n'
        f'[models.lev-rotations]\nrelease = "{release}"\nscore_order_average = "rotations"\n'
    )
    started = Service.start(
        make_settings(vision_checkpoint, models=models, calibration=CALIBRATION), engine=vision_engine
    )
    yield started
    started.engine.adapters.close()


def run(service, states, model=None, workloads=None):
    target = checks.in_process_target(service.settings, model, None, workloads or {}, None)
    measured, _ = checks.run_in_process(service, target, states)
    return checks.build_report(target, states, measured, {"via": "in-process"})


@pytest.fixture(scope="module")
def semif_report(service):
    return run(service, STATES, workloads=dict.fromkeys(("choice", "score", "noul"), WORKLOAD))


@pytest.fixture(scope="module")
def lev_report(service):
    return run(service, STATES, model="lev-demo")


# -- the metrics by hand ------------------------------------------------------------------------


def orders_of(mode: str, n: int) -> list[list[int]]:
    """contract.md's orders: the caller's first; rotations n, shifts min(n, 4) from k*n//count."""
    ident = list(range(n))
    if mode == "none":
        return [ident]
    if mode == "reversal":
        return [ident, ident[::-1]]
    if mode == "rotations":
        return [[(s + i) % n for i in range(n)] for s in range(n)]
    if mode == "shifts":
        count = min(n, 4)
        return [[(k * n // count + i) % n for i in range(n)] for k in range(count)]
    return [list(p) for p in itertools.permutations(ident)]


def softmax(values, temperature=1.0):
    top = max(values)
    exps = [math.exp((v - top) / temperature) for v in values]
    return [e / sum(exps) for e in exps]


def lean(p):
    logs = [math.log(x) for x in p]
    return logs[0] - sum(logs) / len(logs)


def loo(values):
    n = len(values)
    means = [(sum(values) - v) / (n - 1) for v in values]
    return [min(means), max(means)]


def by_hand(per_state):
    """Both checks from each state's (identical: {config: p}, permuted: [(order, p)])."""
    leans = [sum(lean(p) for p in ident.values()) / len(ident) for ident, _ in per_state]
    out = {"identical": (sum(leans) / len(leans), loo(leans))}
    if per_state[0][1]:
        rates, consistent = [], 0
        for _, permuted in per_state:
            picks, firsts = set(), []
            for order, p in permuted:
                top = [i for i, x in enumerate(p) if x == max(p)]
                firsts.append(1 / len(top) if 0 in top else 0.0)
                picks.add(frozenset(order[i] for i in top))
            rates.append(sum(firsts) / len(firsts))
            consistent += len(picks) == 1
        out["first_slot"] = (sum(rates) / len(rates), loo(rates), consistent / len(per_state))
    return out


def assert_matches(reported, hand, where):
    ident = reported["identical"]
    assert ident["metric"] == pytest.approx(hand["identical"][0], abs=CLOSE), where
    assert ident["leave_one_out"] == pytest.approx(hand["identical"][1], abs=CLOSE), where
    if "first_slot" in hand:
        first = reported["first_slot"]
        assert first["metric"] == pytest.approx(hand["first_slot"][0], abs=1e-6), where
        assert first["leave_one_out"] == pytest.approx(hand["first_slot"][1], abs=1e-6), where
        assert first["consistent"] == pytest.approx(hand["first_slot"][2], abs=1e-6), where
    else:
        assert reported["first_slot"] is None, where


# The probe as an operator would write it (lev's English wording, the noul ours).
PROBE = {
    "choice": ("Which team should handle this message?", ("a team", "a request"),
               ["payments, refunds, invoices", "bugs, outages, errors", "plans, contracts, quotes"],
               ["Billing", "Technical", "Sales"]),
    "score": ("How urgent is this request?", ("moderate", "a request"),
              ["Not urgent", "Soon", "Work is blocked"], ["0", "1", "2"]),
    "noul": ("Does this message need an answer today?", ("a request", "moderate"), None, None),
}  # fmt: skip


def decide_logits(client, state):
    """Each prompt the probe can show, read once through `/decide/shared`: the identical options
    (every order of them is one prompt) and every order of the three real options."""
    decisions = []
    for kind, (question, texts, options, _) in PROBE.items():
        for text in texts:
            for k in (2,) if kind == "noul" else (3, 4, 5):
                shown = [{"id": f"o{i}", "description": text} for i in range(k)]
                decisions.append({"id": f"{kind}|{text}|{k}", "question": question, "options": shown})
        for perm in itertools.permutations(range(3)) if options else ():
            shown = [{"id": f"o{i}", "description": options[i]} for i in perm]
            decisions.append(
                {"id": f"{kind}|{''.join(map(str, perm))}", "question": question, "options": shown}
            )
    reply = client.post("/decide/shared", json={"state": state, "decisions": decisions})
    assert reply.status_code == 200, reply.text
    return {d["id"]: r["option_logits"] for d, r in zip(decisions, reply.json()["results"], strict=True)}


def semif_by_hand(kind, mode, temperature, logits_per_state):
    """The kind's metrics under `mode`: each option's logit averaged over the orders it was shown
    in (the reads above), then softmax (at `temperature`), read back in the probe's order."""
    _, texts, options, _ = PROBE[kind]
    per_state = []
    for logits in logits_per_state:
        ident = {}
        for text in texts:
            for k in (2,) if kind == "noul" else (3, 4, 5):
                if mode == "all" and k > 4:
                    continue
                slots = logits[f"{kind}|{text}|{k}"]
                mean = [0.0] * k
                for order in orders_of(mode, k):
                    for j, option in enumerate(order):
                        mean[option] += slots[j] / len(orders_of(mode, k))
                ident[f"{text}|{k}"] = softmax(mean, temperature)
        permuted = []
        for shown in itertools.permutations(range(3)) if options else ():
            mean = [0.0] * 3  # by the base option's index
            for order in orders_of(mode, 3):
                prompt = [shown[o] for o in order]
                slots = logits[f"{kind}|{''.join(map(str, prompt))}"]
                for j, base in enumerate(prompt):
                    mean[base] += slots[j] / len(orders_of(mode, 3))
            p = softmax(mean, temperature)
            permuted.append((shown, [p[i] for i in shown]))
        per_state.append((ident, permuted))
    return by_hand(per_state)


def test_every_semif_number_equals_the_metric_computed_by_hand_from_decide_replies(service, semif_report):
    client = in_process_client(create_app(service))
    logits = [decide_logits(client, state) for state in STATES]
    measured = 0
    for kind, orderings in semif_report["checks"].items():
        assert (
            list(orderings)
            == {
                "choice": ["none", "reversal", "shifts", "rotations", "all"],
                "score": ["none", "reversal"],
                "noul": ["none", "reversal", "rotations"],
            }[kind]
        )
        for mode, entry in orderings.items():
            assert entry["temperature"] == T
            assert_matches(entry["raw"], semif_by_hand(kind, mode, 1.0, logits), f"{kind} {mode} raw")
            assert_matches(entry["calibrated"], semif_by_hand(kind, mode, T, logits), f"{kind} {mode} T")
            measured += 1
    assert measured == 10
    assert semif_report["settings"]["workloads"] == dict.fromkeys(("choice", "score", "noul"), WORKLOAD)


def test_calibration_scales_the_identical_lean_by_one_over_t_and_leaves_the_first_slot_rate(semif_report):
    for kind, orderings in semif_report["checks"].items():
        for mode, entry in orderings.items():
            raw, calibrated = entry["raw"], entry["calibrated"]
            # log-probabilities are the (mean) logits / T less a constant: the lean shrinks by 1/T
            assert calibrated["identical"]["metric"] == pytest.approx(
                raw["identical"]["metric"] / T, abs=2e-6
            )
            if raw["first_slot"] is not None:
                assert calibrated["first_slot"]["metric"] == raw["first_slot"]["metric"], (kind, mode)


def systemone_answers(client, model, state, questions):
    reply = client.post("/v1/systemone", json={"model": model, "state": state, "questions": questions})
    assert reply.status_code == 200, reply.text
    return reply.json()["answers"]


def lev_questions(kind):
    """The probe's lev questions by id: (id, shown order or None, config or None, question)."""
    question, texts, options, names = PROBE[kind]
    found = []
    for text in texts:
        for k in (3, 4, 5):
            criteria = [text] * k if kind == "score" else {str(i + 1): text for i in range(k)}
            found.append(
                (f"{text}|{k}", None, {"type": kind, "instructions": question, "criteria": criteria})
            )
    for shown in itertools.permutations(range(3)):
        criteria = [options[i] for i in shown] if kind == "score" else {names[i]: options[i] for i in shown}
        found.append((None, shown, {"type": kind, "instructions": question, "criteria": criteria}))
    return found


def lev_by_hand(kind, answers_per_state):
    """The kind's metrics from each state's answers in the questions' order (probabilities as shown)."""
    per_state = []
    for answers in answers_per_state:
        ident, permuted = {}, []
        for (config, shown, _), p in zip(lev_questions(kind), answers, strict=True):
            if config is not None:
                ident[config] = p
            else:
                permuted.append((shown, p))
        per_state.append((ident, permuted))
    return by_hand(per_state)


def test_a_lev_release_reports_levs_definitions_from_its_own_replies_and_per_row_forwards(
    service, lev_report
):
    from tests.support.lev_oracle import lev_per_row

    assert lev_report["settings"]["method"] == "lev" and lev_report["settings"]["kinds"] == [
        "choice",
        "score",
    ]
    assert lev_report["settings"]["orderings"] == {
        "choice": ["none", "reversal"],
        "score": ["none", "reversal", "rotations"],
    }
    client = in_process_client(create_app(service))
    # As served (choice as given and reversed; scores once, or in every rotation; the release's
    # temperatures): its System One replies.
    for kind, ordering, model in (("choice", "reversal", "lev-demo"), ("score", "none", "lev-demo"),
                                  ("score", "rotations", "lev-rotations")):  # fmt: skip
        answers = []
        for state in STATES:
            asked = {str(i): q for i, (_, _, q) in enumerate(lev_questions(kind))}
            got = systemone_answers(client, model, state, asked)
            answers.append([list(got[str(i)]["probabilities"].values()) for i in range(len(asked))])
        assert_matches(lev_report["checks"][kind][ordering]["calibrated"], lev_by_hand(kind, answers), kind)
    # lev's own single read at T = 1, which it does not serve: lev's per-row forward of each row.
    release = service.methods["lev"].releases["lev-demo"]
    options = dataclasses.replace(release.options, order_average=False)
    single = dataclasses.replace(release, options=options, calibration=UNCALIBRATED)
    answers = []
    for state in STATES:
        questions = {
            str(i): LevChoice(criteria=dict(q["criteria"]), instructions=q["instructions"])
            for i, (_, _, q) in enumerate(lev_questions("choice"))
        }
        reply = lev_per_row(single, service.engine.model, service.engine.adapters, state, questions)
        answers.append([list(reply.answers[str(i)].probabilities) for i in range(len(questions))])
    assert_matches(
        lev_report["checks"]["choice"]["none"]["raw"], lev_by_hand("choice", answers), "choice none"
    )
    assert lev_report["recommend"]["setting"].startswith('[models.lev-demo] score_order_average = "')


def test_by_url_against_a_real_uvicorn_it_reports_what_it_reports_in_process(
    service, semif_report, tmp_path, capsys
):
    from tests.http.test_hardening import HardenedServer

    states = tmp_path / "states.txt"
    states.write_text("\n".join(STATES) + "\n")
    out = tmp_path / "report.json"
    with HardenedServer(create_app(service)) as server:
        workloads = f"choice={WORKLOAD},score={WORKLOAD},noul={WORKLOAD}"
        code = main(
            ["presentation-checks", "--url", server.url, "--token", TOKEN, "--states", str(states),
             "--workloads", workloads, "--out", str(out), "--recommend"]
        )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0
    report = json.loads(out.read_text())
    assert report["run"]["via"] == "url" and report["settings"] == semif_report["settings"]
    for kind, orderings in semif_report["checks"].items():
        for mode, entry in orderings.items():
            for scores in ("calibrated", "raw"):
                for check in ("identical", "first_slot"):
                    want, got = entry[scores][check], report["checks"][kind][mode][scores][check]
                    if want is None:
                        assert got is None
                        continue
                    assert got["metric"] == pytest.approx(want["metric"], abs=1e-5), (
                        kind,
                        mode,
                        scores,
                        check,
                    )
    assert report["recommend"] == semif_report["recommend"]
    assert "identical raw" in printed and report["recommend"]["setting"] in printed


@pytest.fixture
def command_env(monkeypatch, vision_checkpoint):
    """The environment `semif-serve presentation-checks` reads: the demo's checkpoint, no other SEMIF_*."""
    import os

    for name in [n for n in os.environ if n.startswith("SEMIF_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SEMIF_MODEL_PATH", str(vision_checkpoint))
    monkeypatch.setenv("SEMIF_MODEL_REVISION", DEMO_REVISION)
    monkeypatch.setenv("SEMIF_DEVICE", "cpu")
    return monkeypatch


def test_compare_names_each_metric_a_tree_whose_reversal_stopped_reversing_moves(
    command_env, vision_engine, capsys
):
    """The committed report (tests/docs/test_readme.py compares it clean through the README's
    line) against this tree with one regression: `reversal` asks the caller's order twice."""
    from semif_serve.service import core
    from semif_serve.tools import cli

    real = core.option_orders

    def unreversed(n, mode):
        return [tuple(range(n))] * 2 if mode == "reversal" else real(n, mode)

    command_env.setattr(core, "option_orders", unreversed)
    command_env.setattr(cli, "start_service", lambda settings: Service.start(settings, engine=vision_engine))
    code = main(["presentation-checks", "--compare", str(COMMITTED), "--progress", "plain"])
    err = capsys.readouterr().err
    assert code == checks.EXIT_DRIFT, err
    moved = {line.split(":")[0].strip() for line in err.splitlines() if ": " in line and "->" in line}
    assert moved and all(".reversal." in name for name in moved), moved
    for name in (
        "choice.reversal.raw.identical",
        "score.reversal.raw.identical",
        "noul.reversal.raw.identical",
    ):
        assert name in moved


BAD_INPUT = {
    "an empty states file": (["--states", "{empty}"], "holds no states"),
    "a missing states file": (["--states", "{missing}"], "cannot read"),
    "a JSONL line without a state": (["--states", "{nostate}"], 'line 2: a JSONL line is an object with a'),
    "an unknown kind": (["--kinds", "choice,box"], "--kinds: box"),
    "an unknown model": (["--model", "gpt-5"], "unknown model 'gpt-5'"),
    "a report from another checkpoint": (["--compare", "{other}"], "checkpoint_revision (report: 'other"),
    "a report that is not one": (["--compare", "{empty}"], "not a JSON report"),
    "an unknown workload": (["--workloads", "choice=nope"], "nope not in the calibration file"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_and_exit_2_before_any_model_loads(case, command_env, tmp_path, capsys):
    from semif_serve.tools import cli

    def never(settings):
        raise AssertionError("the model was started")

    command_env.setattr(cli, "start_service", never)
    (tmp_path / "empty").write_text("\n  \n")
    (tmp_path / "nostate.jsonl").write_text('{"state": "a"}\n{"text": "b"}\n')
    other = json.loads(COMMITTED.read_text())
    other["settings"]["checkpoint_revision"] = "other-rev"
    (tmp_path / "other.json").write_text(json.dumps(other))
    paths = {"empty": tmp_path / "empty", "missing": tmp_path / "missing.txt",
             "nostate": tmp_path / "nostate.jsonl", "other": tmp_path / "other.json"}  # fmt: skip
    flags, message = BAD_INPUT[case]
    code = main(["presentation-checks", *(flag.format(**paths) for flag in flags)])
    err = capsys.readouterr().err.strip()
    assert code == checks.EXIT_INPUT, err
    assert len(err.splitlines()) == 1 and err.startswith("presentation-checks: ") and message in err, err
    assert "Traceback" not in err


def test_a_model_whose_method_has_no_probing_is_refused_naming_it_before_any_model_loads(
    command_env, tmp_path, capsys
):
    from semif_serve.tools import cli
    from tests.support.served_models import THIRD_METHOD, THIRD_METHOD_PLUG_IN

    def never(settings):
        raise AssertionError("the model was started")

    command_env.setattr(cli, "start_service", never)
    models = tmp_path / "models.toml"
    models.write_text(f'[models.{THIRD_METHOD.model}]\nmethod = "{THIRD_METHOD.method}"\n')
    command_env.setenv("SEMIF_METHODS", THIRD_METHOD_PLUG_IN)
    command_env.setenv("SEMIF_MODELS", str(models))
    code = main(["presentation-checks", "--model", THIRD_METHOD.model])
    err = capsys.readouterr().err.strip()
    assert code == checks.EXIT_INPUT, err
    assert len(err.splitlines()) == 1 and f"its method {THIRD_METHOD.method!r} has no probing" in err, err


def test_a_method_this_process_does_not_know_is_refused_naming_it():
    """By URL the tool knows a model's method only by `/v1/models`' `x_method`."""
    from semif_serve.service.methods import MethodRegistry

    with pytest.raises(checks.Refused, match="its method 'yes-no' is not one known here"):
        checks.probing_of(MethodRegistry.of(), "yes-no", "yes-no")


def test_the_tool_names_no_method():
    """What is a method's own (its orderings, question fields, reading, setting) is its probing's
    (service/methods/probing.py): the tool branches on no method's name."""
    for path in sorted((ROOT / "src" / "semif_serve" / "tools").glob("presentation_*.py")):
        assert not re.search(r'"lev"|"semif"|\bLEV\b|\bSEMIF\b', path.read_text()), path
