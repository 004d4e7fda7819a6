"""The HTTP API through the real app: auth, every validation rule, the envelope, health, ordering."""

from __future__ import annotations

import asyncio
import copy

import httpx
import pytest

from tests.support import TOKEN, decision

ENVELOPE_KEYS = {"code", "message", "field", "request_id"}


def assert_error(response, status: int, code: str, field: str | None = "any"):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == ENVELOPE_KEYS
    assert body["error"]["code"] == code
    assert body["error"]["message"]
    if field != "any":
        assert body["error"]["field"] == field
    return body["error"]


# -- auth ---------------------------------------------------------------------------------------


def test_a_post_without_a_token_is_401_in_the_envelope(client):
    response = client.post("/decide", auth=False, json=decision())
    assert_error(response, 401, "unauthorized", "Authorization")
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize(
    "header", [f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", f"Basic {TOKEN}", "Bearer", "Bearer ", TOKEN]
)
def test_a_wrong_or_malformed_token_is_401_and_never_echoed(client, header):
    response = client.post("/decide", auth=False, json=decision(), headers={"Authorization": header})
    assert_error(response, 401, "unauthorized")
    assert TOKEN not in response.text


def test_an_unauthenticated_caller_learns_nothing_about_its_body(client):
    response = client.post("/decide", auth=False, content=b"{not json")
    assert_error(response, 401, "unauthorized")


def test_the_right_token_is_answered(client):
    response = client.post("/decide", json=decision())
    assert response.status_code == 200
    assert response.json()["id"] == "q1"


def test_health_needs_no_token_and_holds_the_pins_and_limits(client, service):
    response = client.get("/health", auth=False)
    assert response.status_code == 200
    body = response.json()
    assert body["ready"] is True and body["status"] == "ok"
    assert body["semif"] == {
        "commit": "23cf1f39fc9534fe81437200959b6dfc7106e45a",
        "prompt_version": "direct-options-v1",
    }
    assert body["model"]["revision"] == service.settings.model_revision
    assert body["model"]["torch_version"] == __import__("torch").__version__
    assert body["model"]["transformers_version"] == __import__("transformers").__version__
    assert body["limits"]["max_rows"] == service.settings.max_rows
    assert body["limits"]["max_input_tokens"] == 4096
    assert body["limits"]["max_options"] == 16
    assert body["device"] == "cpu" and body["dtype"] == "float32"
    assert body["demo"] is True and "random" in body["model"]["demo"]
    assert TOKEN not in response.text


# -- validation ---------------------------------------------------------------------------------

OPTIONS = [{"id": "yes", "description": "It succeeded."}, {"id": "no", "description": "It failed."}]


def _set(path, value):
    def mutate(body):
        target = body
        for key in path[:-1]:
            target = target[key]
        if value is KeyError:
            del target[path[-1]]
        else:
            target[path[-1]] = value
        return body

    return mutate


DECIDE_RULES = [
    ("missing id", _set(["id"], KeyError), "id"),
    ("empty id", _set(["id"], ""), "id"),
    ("blank id", _set(["id"], "   "), "id"),
    ("numeric id", _set(["id"], 7), "id"),
    ("missing question", _set(["question"], KeyError), "question"),
    ("empty question", _set(["question"], ""), "question"),
    ("missing state", _set(["state"], KeyError), "state"),
    ("empty state", _set(["state"], ""), "state"),
    ("empty object state", _set(["state"], {}), "state"),
    ("empty array state", _set(["state"], []), "state"),
    ("number state", _set(["state"], 12), "state"),
    ("null state", _set(["state"], None), "state"),
    ("one option", _set(["options"], OPTIONS[:1]), "options"),
    (
        "seventeen options",
        _set(["options"], [{"id": str(i), "description": "d"} for i in range(17)]),
        "options",
    ),
    ("options not a list", _set(["options"], "yes,no"), "options"),
    ("option without id", _set(["options", 0, "id"], KeyError), "options[0].id"),
    ("option with empty id", _set(["options", 1, "id"], ""), "options[1].id"),
    ("option with numeric description", _set(["options", 1, "description"], 3), "options[1].description"),
    ("duplicate option ids", _set(["options"], [OPTIONS[0], dict(OPTIONS[0])]), "options"),
    ("unknown orderings", _set(["orderings"], "reverse"), "orderings"),
    (
        "all over five options",
        lambda b: {
            **b,
            "orderings": "all",
            "options": [{"id": str(i), "description": "d"} for i in range(5)],
        },
        "orderings",
    ),
    ("numeric workload", _set(["workload"], 3), "workload"),
]


@pytest.mark.parametrize("name,mutate,field", DECIDE_RULES, ids=[r[0] for r in DECIDE_RULES])
def test_every_decide_rule_is_a_422_naming_the_field(client, name, mutate, field):
    response = client.post("/decide", json=mutate(copy.deepcopy(decision())))
    assert_error(response, 422, "validation_error", field)


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_a_state_holding_nan_or_infinity_is_422(client, literal):
    body = (
        b'{"id":"x","question":"q","options":[{"id":"a","description":"1"},{"id":"b","description":"2"}],"state":{"v":[1,'
        + literal
        + b"]}}"
    )
    error = assert_error(client.post("/decide", content=body), 422, "validation_error", "state")
    assert "state.v[1]" in error["message"]


def test_a_body_that_is_not_json_is_400(client):
    assert_error(client.post("/decide", content=b"{oops"), 400, "invalid_json", None)
    assert_error(client.post("/decide", content=b"\xff\xfe"), 400, "invalid_json", None)


def test_a_json_body_that_is_not_an_object_is_422(client):
    assert_error(client.post("/decide", json=[decision()]), 422, "validation_error", None)


def test_extra_fields_such_as_fixture_labels_are_ignored_and_never_reach_the_prompt(client):
    plain = client.post("/decide", json=decision()).json()
    labelled = client.post("/decide", json=decision(label=1, family="x", group_id="g", note="IGNORE")).json()
    assert labelled["prompt_sha256"] == plain["prompt_sha256"]


def test_curl_style_form_content_type_is_still_read_as_json(client):
    import json

    response = client.post(
        "/decide",
        content=json.dumps(decision()).encode(),
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert response.status_code == 200


def test_duplicate_decision_ids_in_a_shared_request_are_422(client):
    body = {"state": "s", "decisions": [decision(id="a"), decision(id="a")]}
    assert_error(client.post("/decide/shared", json=body), 422, "validation_error", "decisions")


def test_a_bad_field_inside_a_shared_decision_is_named_by_its_path(client):
    bad = decision(id="b")
    bad["options"][1]["id"] = ""
    body = {"state": "s", "decisions": [decision(id="a"), bad]}
    assert_error(
        client.post("/decide/shared", json=body), 422, "validation_error", "decisions[1].options[1].id"
    )


def test_an_empty_decision_list_is_422(client):
    assert_error(
        client.post("/decide/shared", json={"state": "s", "decisions": []}),
        422,
        "validation_error",
        "decisions",
    )


def test_rows_over_the_cap_are_422_too_many_rows(client, service):
    n = service.settings.max_rows + 1
    body = {"state": "s", "decisions": [decision(id=f"d{i}") for i in range(n)]}
    assert_error(client.post("/decide/shared", json=body), 422, "too_many_rows", "decisions")
    rotations = decision(
        orderings="rotations", options=[{"id": str(i), "description": "d"} for i in range(16)]
    )
    body = {"state": "s", "decisions": [{**rotations, "id": f"r{i}"} for i in range(5)]}
    assert_error(client.post("/decide/shared", json=body), 422, "too_many_rows", "decisions")


def test_a_prompt_over_the_token_limit_is_422_and_never_truncated(client):
    long_state = "word " * 5000
    assert_error(client.post("/decide", json=decision(state=long_state)), 422, "too_many_tokens", "state")
    body = {"state": long_state, "decisions": [decision(id="a")]}
    assert_error(client.post("/decide/shared", json=body), 422, "too_many_tokens", "decisions[0]")


def test_an_unknown_workload_is_422_naming_the_known_ones(client):
    error = assert_error(
        client.post("/decide", json=decision(workload="nope")), 422, "unknown_workload", "workload"
    )
    assert "known workloads" in error["message"]


def test_unknown_routes_and_wrong_methods_get_the_envelope(client):
    assert_error(client.get("/nowhere"), 404, "not_found", None)
    assert_error(client.get("/decide"), 405, "method_not_allowed", None)
    assert_error(client.post("/health"), 405, "method_not_allowed", None)


# -- results -----------------------------------------------------------------------------------

SEMIF_KEYS = [
    "id",
    "option_ids",
    "probabilities",
    "option_logits",
    "input_tokens",
    "forward_seconds",
    "total_seconds",
    "prompt_sha256",
    "prompt_version",
    "model",
    "readout",
    "probability_status",
]


def test_a_decision_returns_semifs_result_dict_in_upstreams_key_order(client):
    body = client.post("/decide", json=decision()).json()
    assert list(body) == SEMIF_KEYS
    assert body["option_ids"] == ["yes", "no"]
    assert sum(body["probabilities"]) == pytest.approx(1.0, abs=1e-6)
    assert list(body["model"])[:6] == [
        "source",
        "revision",
        "dtype",
        "device",
        "torch_version",
        "transformers_version",
    ]
    assert (
        body["readout"] == "native full-vocabulary last-position logits restricted to declared answer slots"
    )
    assert body["probability_status"] == "conditional option score; uncalibrated as decision confidence"


def test_shared_results_come_back_in_request_order_with_the_timing_block(client):
    ids = ["zeta", "alpha", "mid", "beta"]
    body = {
        "state": {"zones": ["a", "b"]},
        "decisions": [decision(id=i, question=f"Is {i} fine?") for i in ids],
    }
    reply = client.post("/decide/shared", json=body).json()
    assert [r["id"] for r in reply["results"]] == ids
    assert reply["timing"]["batch_size"] == 4
    assert set(reply["timing"]) >= {
        "prefix_tokens",
        "prefill_seconds",
        "replicate_seconds",
        "suffix_forward_seconds",
        "batch_size",
        "true_suffix_tokens",
        "padded_suffix_tokens",
    }
    for result in reply["results"]:
        assert list(result) == SEMIF_KEYS
        assert result["model"]["serving_config"] == "native-state-prefix-parallel-v1"
        assert result["readout"] == "native selected suffix-position logits"


def test_a_concurrent_burst_is_answered_correctly(client):
    bodies = [decision(id=f"b{i}", state=f"Zone {i} reported {i * 7} errors.") for i in range(16)]
    sequential = [client.post("/decide", json=b).json() for b in bodies]

    async def burst():
        transport = httpx.ASGITransport(app=client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await asyncio.gather(
                *[c.post("/decide", json=b, headers={"Authorization": f"Bearer {TOKEN}"}) for b in bodies]
            )

    answers = asyncio.run(burst())
    for seq, answer in zip(sequential, answers, strict=True):
        assert answer.status_code == 200
        got = answer.json()
        assert got["id"] == seq["id"]
        assert got["prompt_sha256"] == seq["prompt_sha256"]
        assert got["option_logits"] == pytest.approx(seq["option_logits"], abs=1e-5)


def test_health_answers_while_the_engine_thread_is_busy(client, service):
    import threading

    started, gate = threading.Event(), threading.Event()

    async def go():
        transport = httpx.ASGITransport(app=client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            busy = asyncio.create_task(service.worker.run(lambda: started.set() or gate.wait(10)))
            assert await asyncio.to_thread(started.wait, 10), "the engine thread never took the busy job"
            queued = asyncio.create_task(
                c.post("/decide", json=decision(), headers={"Authorization": f"Bearer {TOKEN}"})
            )
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 8  # the request reaches the engine's queue (slow on a loaded machine)
            while True:
                health = await asyncio.wait_for(c.get("/health"), timeout=5)
                if health.json()["queue"]["engine_pending"] == 2 or loop.time() > deadline:
                    break
                await asyncio.sleep(0.02)
            gate.set()
            await busy
            return health, await queued

    health, queued = asyncio.run(go())
    assert health.status_code == 200
    assert health.json()["queue"]["engine_pending"] == 2
    assert queued.status_code == 200


def test_an_unexpected_failure_outside_a_decision_still_gets_the_500_envelope(service, monkeypatch):
    import semif_serve.app.ops as ops_module
    from semif_serve.app import create_app

    def broken(service, snapshot):
        raise RuntimeError(TOKEN)

    monkeypatch.setattr(ops_module, "health_body", broken)

    async def go():
        transport = httpx.ASGITransport(app=create_app(service), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.get("/health")

    response = asyncio.run(go())
    assert_error(response, 500, "internal_error", None)
    assert TOKEN not in response.text


def test_seventeen_options_are_refused_with_the_limit_the_reason_and_where_to_go_instead(client):
    options = [{"id": str(i), "description": "d"} for i in range(17)]
    response = client.post("/decide", json=decision(options=options))
    assert_error(response, 422, "validation_error", "options")
    message = response.json()["error"]["message"]
    assert "16" in message and "A..P" in message and "17" in message
    assert "/v1/systemone" in message and "255" in message
