"""PEFT adapters named in SEMIF_MODELS, served through both doors by the real app: a request
naming a model (or an alias, or a workload calibrated on it) is read by that adapter, exactly as
PEFT's own forward reads the prompt; `/v1/models` lists each model with its method, adapter,
scale and calibration; bad names and bad adapters are refused, naming the field or the key."""

from __future__ import annotations

import json

import pytest
import torch

from semif_serve.app import create_app
from semif_serve.domain.requests import RowsRequest
from semif_serve.domain.types import ConfigurationError, PromptRow
from semif_serve.service.startup import Service
from semif_serve.tools.demo import DEMO_REVISION
from tests.engine.test_adapter_rows import triage_and_routing
from tests.engine.test_adapters import peft_logits
from tests.support import in_process_client, make_settings

BASE = f"Qwen/Qwen3.5-4B@{DEMO_REVISION}"
STATE = "Ticket 4411: the payment page times out since the last release."
QUESTION = "Which queue handles this ticket?"
OPTIONS = [
    {"id": "billing", "description": "The billing team."},
    {"id": "platform", "description": "The platform team."},
]


@pytest.fixture(scope="module")
def adapter_dirs(checkpoint, tmp_path_factory):
    return triage_and_routing(checkpoint, tmp_path_factory.mktemp("door-adapters"), 21, suffix="-lora")


@pytest.fixture(scope="module")
def files(adapter_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("door-models")
    models = root / "models.toml"
    models.write_text(
        f'[models.triage]\nadapter = "{adapter_dirs["triage"]}"\nscale = 0.5\n'
        f'[models.routing]\nadapter = "{adapter_dirs["routing"]}"\n'
        '[aliases]\nlocal = "triage"\n'
    )
    calibration = root / "calibration.json"
    calibration.write_text(json.dumps({"tickets": {"single": 1.5, "model": "local"}, "plain": 2.0}))
    return {"models": models, "calibration": calibration}


@pytest.fixture(scope="module")
def service(engine, checkpoint, files):
    settings = make_settings(checkpoint, models=files["models"], calibration=files["calibration"])
    started = Service.start(settings, engine=engine)
    yield started
    started.engine.adapters.close()  # the session's engine reads the plain base again


@pytest.fixture(scope="module")
def client(service):
    return in_process_client(create_app(service))


def decide(client, **fields):
    body = {"id": "q", "state": STATE, "question": QUESTION, "options": OPTIONS, **fields}
    return client.post("/decide", json=body)


def peft_option_logits(service, checkpoint, adapter_dir, scale: float = 1.0) -> tuple[torch.Tensor, str]:
    """PEFT's own forward of the prompt the service reads (its ids and digest from the engine's
    encoder), at the answer slots; a serving scale is written into B, as PEFT would serve it."""
    row = PromptRow(QUESTION, tuple(o["description"] for o in OPTIONS))
    prompt = service.engine.prepare(
        RowsRequest.of(STATE, [row], shared=False, max_input_tokens=4096)
    ).prompts[0]
    if scale != 1.0:
        adapter_dir = scaled_copy(adapter_dir, scale)
    logits = peft_logits(checkpoint, adapter_dir, torch.tensor([prompt.ids]))[0, -1]
    return logits[service.engine.slot_ids[: len(OPTIONS)]].float(), prompt.sha256


def scaled_copy(adapter_dir, scale: float):
    from safetensors.torch import load_file, save_file

    target = adapter_dir.parent / f"{adapter_dir.name}-x{scale}"
    if not target.exists():
        target.mkdir()
        (target / "adapter_config.json").write_text((adapter_dir / "adapter_config.json").read_text())
        tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
        save_file(
            {k: v * scale if ".lora_B." in k else v for k, v in tensors.items()},
            str(target / "adapter_model.safetensors"),
        )
    return target


def test_a_decision_naming_an_adapter_is_read_by_peft_s_forward_of_it(
    client, service, checkpoint, adapter_dirs
):
    reply = decide(client, model="routing")
    assert reply.status_code == 200, reply.text
    result = reply.json()
    expected, sha = peft_option_logits(service, checkpoint, adapter_dirs["routing"])
    assert result["prompt_sha256"] == sha
    torch.testing.assert_close(torch.tensor(result["option_logits"]), expected, atol=1e-5, rtol=0)
    assert result["model"]["adapter"] == "routing"
    base = decide(client).json()
    assert "adapter" not in base["model"]
    assert max(abs(a - b) for a, b in zip(base["option_logits"], result["option_logits"], strict=True)) > 1e-3


def test_an_alias_reads_its_model_at_the_operator_s_scale(client, service, checkpoint, adapter_dirs):
    result = decide(client, model="local").json()
    expected, _ = peft_option_logits(service, checkpoint, adapter_dirs["triage"], scale=0.5)
    torch.testing.assert_close(torch.tensor(result["option_logits"]), expected, atol=1e-5, rtol=0)
    assert result["model"]["adapter"] == "triage"


def test_a_workload_calibrated_on_an_adapter_picks_it_and_refuses_another(client):
    calibrated = decide(client, workload="tickets").json()
    assert calibrated["model"]["adapter"] == "triage"
    assert calibrated["calibrated"]["temperature"] == 1.5
    plain = decide(client, model="triage").json()[
        "option_logits"
    ]  # its state kept by the first: rounding apart
    assert calibrated["option_logits"] == pytest.approx(plain, abs=1e-6)
    refused = decide(client, model="routing", workload="tickets")
    assert refused.status_code == 422
    error = refused.json()["error"]
    assert error["code"] == "workload_model" and error["field"] == "workload"
    assert "'triage'" in error["message"] and "'routing'" in error["message"]
    assert "adapter" not in decide(client, workload="plain").json()["model"]  # no model named: the base


def test_shared_decisions_of_an_adapter_equal_its_lone_decisions(client):
    decisions = [
        {"id": "a", "question": QUESTION, "options": OPTIONS},
        {"id": "b", "question": "Is this urgent?", "options": OPTIONS, "orderings": "rotations"},
    ]
    shared = client.post("/decide/shared", json={"state": STATE, "decisions": decisions, "model": "triage"})
    assert shared.status_code == 200, shared.text
    first = shared.json()["results"][0]
    lone = decide(client, model="triage").json()
    torch.testing.assert_close(
        torch.tensor(first["option_logits"]), torch.tensor(lone["option_logits"]), atol=1e-5, rtol=0
    )
    assert first["model"]["adapter"] == "triage"


def test_an_unknown_model_is_a_422_on_the_native_door_and_a_400_on_system_one(client):
    native = decide(client, model="nobody")
    assert native.status_code == 422
    assert native.json()["error"]["code"] == "unknown_model" and native.json()["error"]["field"] == "model"
    body = {"model": "nobody", "state": STATE, "questions": {"ok": {"type": "noul", "name": "ok"}}}
    systemone = client.post("/v1/systemone", json=body)
    assert systemone.status_code == 400
    assert f"'{BASE}', 'triage', 'routing'" in systemone.text and "local" in systemone.text


def test_system_one_reads_the_model_it_names_and_echoes_it(client):
    body = {
        "state": STATE,
        "questions": {
            "queue": {"type": "choice", "name": "queue", "criteria": {"billing": "b", "platform": "p"}}
        },
    }
    replies = {
        name: client.post("/v1/systemone", json={**body, "model": name}).json()
        for name in ("triage", "local", BASE)
    }
    assert replies["triage"]["model"] == "triage" and replies[BASE]["model"] == BASE
    assert replies["triage"]["answers"] == replies["local"]["answers"]
    assert replies["triage"]["answers"] != replies[BASE]["answers"]


def test_models_are_listed_with_method_adapter_scale_and_calibration(client):
    listed = {m["name"]: m for m in client.get("/v1/models").json()["models"]}
    assert list(listed) == [BASE, "triage", "routing", "jev-latest", "jev-preview", "local"]
    triage = listed["triage"]
    assert triage["x_method"] == "semif" and triage["x_scale"] == 0.5
    assert triage["x_adapter"] == {
        "name": "triage-lora",
        "rank": 8,
        "modules": triage["x_adapter"]["modules"],
        "factor": 1.0,
    }
    assert triage["x_adapter"]["modules"] > 0
    assert triage["x_calibration"] == ["tickets"]
    assert listed[BASE]["x_calibration"] == [] and listed[BASE]["x_method"] == "semif"
    assert listed["routing"]["x_adapter"]["factor"] == 2.0 and listed["routing"]["x_scale"] == 1.0
    assert listed["local"]["x_alias_of"] == "triage" and listed["jev-latest"]["x_alias_of"] == BASE


def test_a_bad_adapter_refuses_to_start_naming_the_models_key_and_its_file(engine, checkpoint, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{}")
    (broken / "adapter_model.safetensors").write_bytes(b"")
    models = tmp_path / "models.toml"
    models.write_text(f'[models.triage]\nadapter = "{broken}"\n')
    with pytest.raises(ConfigurationError, match=r"models\.triage\.adapter: .*adapter_config\.json"):
        Service.start(make_settings(checkpoint, models=models), engine=engine)


def test_a_workload_naming_no_served_model_refuses_to_start(engine, checkpoint, tmp_path):
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"tickets": {"single": 1.5, "model": "nobody"}}))
    with pytest.raises(
        ConfigurationError,
        match=r'calibration\.json: workload "tickets": model \'nobody\' is not a served model',
    ):
        Service.start(make_settings(checkpoint, calibration=calibration), engine=engine)


def test_the_model_that_read_a_request_is_in_its_log_line_and_the_metrics(client):
    from tests.http.test_operations import metric
    from tests.support import request_log_lines

    before = client.get("/metrics").text
    with request_log_lines() as lines:
        decide(client, model="routing", id="routed")
        base = decide(client).json()["model"]["source"]  # the base, named as its results name it
    assert [(line.get("model"), line.get("decision_method")) for line in lines] == [
        ("routing", "semif"),
        (base, "semif"),
    ]
    after = client.get("/metrics").text
    counted = "semif_model_requests_total"
    assert metric(after, counted, model="routing") == metric(before, counted, model="routing") + 1
    assert metric(after, counted, model="(base)") == metric(before, counted, model="(base)") + 1
