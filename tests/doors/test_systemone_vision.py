"""System One with images on the demo's checkpoint (the tiny Qwen3.5 WITH a vision tower),
through the real app and through the official SDK against a live service: every answer equals
an independent full forward of the vision-language model on the whole prompt
(tests/support/vision_reference.py), base64 and multipart read the same, images are told apart, and the
image tokens are counted."""

from __future__ import annotations

import base64
import hashlib
import json

import pytest
from typesafe_sdk import Box, Choice, Image, Noul, TypeSafeClient

from harness.server import LoopbackServer
from semif_serve.app import create_app
from semif_serve.domain.requests import Defaults
from semif_serve.doors.systemone.mapping import asked_question
from semif_serve.doors.systemone.schemas import SystemOneRequest
from semif_serve.service.methods.semif import core_question, core_questions
from tests.support import TOKEN, in_process_client, make_settings
from tests.support.vision_reference import expected_row, noise_png

TOL = 1e-5
PHOTO = "<image:0123456789abcdef0123456789abcdef>"
CHOICE = {
    "type": "choice",
    "instructions": "Which colour dominates the photo?",
    "criteria": {"red": "Mostly red.", "blue": "Mostly blue.", "green": "Mostly green."},
}


@pytest.fixture(scope="module")
def app(vision_service):
    return create_app(vision_service)


@pytest.fixture(scope="module")
def client(app):
    return in_process_client(app)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def request_body(state, questions, images: dict[str, bytes]) -> dict:
    body = {"model": "jev-latest", "state": state, "questions": questions}
    if images:
        body["assets"] = {
            name: {"type": "image", "format": "png", "data_base64": b64(data)}
            for name, data in images.items()
        }
    return body


def expected_answers(service, body: dict, images: dict[str, bytes], reference) -> dict:
    """Each question's slot logits from the reference forward of the prompt the door builds
    (the door's mapping to a question, SemIf's rendering, the caller's order)."""
    parsed = SystemOneRequest.model_validate(body)
    settings = service.settings
    defaults = Defaults(settings.systemone_orderings, settings.systemone_workloads)
    out = {}
    for qid, question in parsed.questions.items():
        domain = core_question(asked_question(qid, question), defaults)
        descriptions = [o.description for o in domain.options]
        text = service.engine.codec.render_prompt(parsed.state, domain.text, descriptions)
        out[qid] = (domain, expected_row(reference, text, len(descriptions), images))
    return out


def assert_answers_match(reply: dict, expected: dict) -> None:
    for qid, (domain, (logits, _, tokens)) in expected.items():
        semif = reply["answers"][qid]["x_semif"]
        got = [semif["option_logits"][o.id] for o in domain.options]
        assert max(abs(a - b) for a, b in zip(got, logits, strict=True)) < TOL, (got, logits)
        assert semif["input_tokens"] == tokens


def test_an_image_in_the_state_is_read_and_equals_the_full_forward_of_its_prompt(
    client, vision_service, vision_reference
):
    images = {PHOTO: noise_png(21)}
    body = request_body({"photo": PHOTO, "caption": "a product"}, {"c": CHOICE}, images)
    reply = client.post("/v1/systemone", json=body)
    assert reply.status_code == 200, reply.text
    assert_answers_match(reply.json(), expected_answers(vision_service, body, images, vision_reference))


def test_images_in_an_instruction_and_in_a_criterion_are_read_where_they_stand(
    client, vision_service, vision_reference
):
    other = "<image:fedcba9876543210fedcba9876543210>"
    images = {PHOTO: noise_png(22), other: noise_png(23, size=(24, 32))}
    questions = {
        "n": {"type": "noul", "instructions": f"Does {PHOTO} show a cat?"},
        "c": {**CHOICE, "criteria": {"like": f"Like {other}.", "unlike": "Unlike it."}},
    }
    body = request_body("Two photos.", questions, images)
    reply = client.post("/v1/systemone", json=body)
    assert reply.status_code == 200, reply.text
    assert_answers_match(reply.json(), expected_answers(vision_service, body, images, vision_reference))


def test_the_same_image_as_base64_and_as_a_multipart_part_gives_identical_answers(client):
    data = noise_png(24)
    body = request_body({"photo": PHOTO}, {"c": CHOICE}, {PHOTO: data})
    as_json = client.post("/v1/systemone", json=body).json()
    parted = {**body, "assets": {PHOTO: {"type": "image", "part": "asset-0"}}}
    boundary = "b0undary"
    content = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="request"\r\n'
        "Content-Type: application/json\r\n\r\n"
    ).encode() + json.dumps(parted).encode()
    content += (
        f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="asset-0"\r\n'
        "Content-Type: image/png\r\n\r\n"
    ).encode() + data
    content += f"\r\n--{boundary}--\r\n".encode()
    as_part = client.post(
        "/v1/systemone",
        content=content,
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
    )
    assert as_part.status_code == 200, as_part.text
    # The second reads the state the first kept, in a forward of another shape: float32 rounding apart.
    got, want = as_part.json()["answers"]["c"], as_json["answers"]["c"]
    assert got["choice"] == want["choice"]
    assert got["probabilities"] == pytest.approx(want["probabilities"], abs=1e-6)


def test_two_images_give_different_answers_and_prompt_digests(client):
    replies = [
        client.post(
            "/v1/systemone", json=request_body({"photo": PHOTO}, {"c": CHOICE}, {PHOTO: noise_png(s)})
        )
        for s in (25, 26)
    ]
    a, b = (r.json()["answers"]["c"]["x_semif"] for r in replies)
    assert a["prompt_sha256"] != b["prompt_sha256"]
    assert max(abs(a["option_logits"][k] - b["option_logits"][k]) for k in a["option_logits"]) > 1e-4


def test_the_prompt_digest_is_the_texts_with_each_image_in_its_slot_then_each_images(client, vision_service):
    data = noise_png(27)
    body = request_body({"photo": PHOTO}, {"c": CHOICE}, {PHOTO: data})
    reply = client.post("/v1/systemone", json=body).json()
    ((domain, _),) = expected_answers_without_forward(vision_service, body)
    sha = hashlib.sha256(data).hexdigest()
    slot = f"<image:0:{sha}>"  # the contract's slot: the image's position in `assets`, its digest
    text = vision_service.engine.codec.render_prompt(
        {"photo": slot}, domain.text, [o.description for o in domain.options]
    )
    digest = hashlib.sha256(text.encode() + sha.encode()).hexdigest()
    assert reply["answers"]["c"]["x_semif"]["prompt_sha256"] == digest


def read_the_same(a, b) -> None:
    """Two replies to requests that show the model the same prompt and images."""
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    x, y = a.json()["answers"]["c"]["x_semif"], b.json()["answers"]["c"]["x_semif"]
    assert (x["prompt_sha256"], x["input_tokens"]) == (y["prompt_sha256"], y["input_tokens"])
    assert x["option_logits"] == pytest.approx(y["option_logits"], abs=TOL)


def test_an_asset_key_of_plain_words_is_placed_only_in_the_callers_strings(client):
    data = noise_png(70)
    plain = request_body({"x": "evidence"}, {"c": CHOICE}, {"evidence": data})
    tagged = request_body({"x": PHOTO}, {"c": CHOICE}, {PHOTO: data})
    # "evidence" is also a key of SemIf's own JSON; only the caller's string shows the image.
    read_the_same(client.post("/v1/systemone", json=plain), client.post("/v1/systemone", json=tagged))


def test_the_sdks_random_placeholders_do_not_change_the_prompt(client):
    data = noise_png(71)
    one = request_body({"x": PHOTO}, {"c": CHOICE}, {PHOTO: data})
    other = "<image:99999999999999999999999999999999>"
    two = request_body({"x": other}, {"c": CHOICE}, {other: data})
    read_the_same(client.post("/v1/systemone", json=one), client.post("/v1/systemone", json=two))


@pytest.mark.parametrize("odd", ['<image:a"b>', "<image:a\\b>", "<image:tab\tin>"])
def test_a_placeholder_json_escapes_is_read_inside_structured_instructions(client, odd):
    data = noise_png(72)
    escaped = {**CHOICE, "instructions": {"look at": odd, "then": "answer"}}
    plain = {**CHOICE, "instructions": {"look at": PHOTO, "then": "answer"}}
    read_the_same(
        client.post("/v1/systemone", json=request_body("s", {"c": escaped}, {odd: data})),
        client.post("/v1/systemone", json=request_body("s", {"c": plain}, {PHOTO: data})),
    )


def test_an_asset_whose_key_lies_only_inside_another_assets_key_is_refused(client):
    body = request_body(
        {"x": "<image:ab>"}, {"c": CHOICE}, {"<image:ab>": noise_png(73), "image:ab": noise_png(74)}
    )
    reply = client.post("/v1/systemone", json=body)
    assert reply.status_code == 422, reply.text
    assert [e["loc"] for e in reply.json()["detail"]] == [["body", "assets", "image:ab"]]


def test_an_image_only_in_an_option_name_that_has_a_description_is_refused_as_unread(client):
    choice = {**CHOICE, "criteria": {PHOTO: "the first one", "other": "the second one"}}
    reply = client.post("/v1/systemone", json=request_body("s", {"c": choice}, {PHOTO: noise_png(75)}))
    assert reply.status_code == 422, reply.text
    assert reply.json()["detail"][0]["loc"] == ["body", "assets", PHOTO]


def test_images_as_option_names_without_descriptions_are_shown_and_the_names_answer(client):
    other = "<image:fedcba9876543210fedcba9876543210>"
    choice = {
        "type": "choice",
        "instructions": "Which photo is darker?",
        "criteria": {PHOTO: None, other: None},
    }
    images = {PHOTO: noise_png(76), other: noise_png(77)}
    reply = client.post("/v1/systemone", json=request_body("two photos", {"c": choice}, images))
    assert reply.status_code == 200, reply.text
    answer = reply.json()["answers"]["c"]
    assert set(answer["probabilities"]) == {PHOTO, other} and answer["choice"] in (PHOTO, other)


def expected_answers_without_forward(service, body):
    parsed = SystemOneRequest.model_validate(body)
    settings = service.settings
    defaults = Defaults(settings.systemone_orderings, settings.systemone_workloads)
    return [(core_question(asked_question(qid, q), defaults), None) for qid, q in parsed.questions.items()]


def test_usage_counts_the_image_tokens(client, vision_service, vision_reference):
    images = {PHOTO: noise_png(28)}
    body = request_body({"photo": PHOTO}, {"c": {**CHOICE, "x_orderings": "none"}}, images)
    reply = client.post("/v1/systemone", json=body).json()
    ((_, (_, _, tokens)),) = expected_answers(vision_service, body, images, vision_reference).values()
    assert reply["usage"]["input_tokens"] == tokens  # one row: its whole prompt, image tokens included
    text_only = client.post("/v1/systemone", json=request_body({"photo": "x"}, body["questions"], {})).json()
    assert reply["usage"]["input_tokens"] > text_only["usage"]["input_tokens"] + 50  # 60 image tokens


def test_models_and_health_say_the_model_reads_images(client):
    (real, *_) = client.get("/v1/models").json()["models"]
    assert real["x_reads_images"] is True
    assert client.get("/health").json()["images"]["reads_images"] is True


def test_the_native_door_stays_text_only_and_ignores_assets_as_semif_ignores_unknown_fields(client):
    decision = {
        "id": "d",
        "state": {"photo": PHOTO},
        "question": "Is it red?",
        "options": [{"id": "y", "description": "Yes."}, {"id": "n", "description": "No."}],
    }
    assets = {PHOTO: {"type": "image", "format": "png", "data_base64": b64(noise_png(29))}}
    with_assets = client.post("/decide", json={**decision, "assets": assets})
    without = client.post("/decide", json=decision)
    assert with_assets.status_code == without.status_code == 200, with_assets.text
    for key in ("prompt_sha256", "input_tokens"):
        assert with_assets.json()[key] == without.json()[key]
    # The second may be read from the first's cached state: the same numbers within 1e-5.
    assert with_assets.json()["option_logits"] == pytest.approx(without.json()["option_logits"], abs=TOL)


# -- box questions ---------------------------------------------------------------------------------------


def test_a_box_about_an_image_equals_the_pair_rule_over_full_forwards_of_its_edge_prompts(
    client, vision_service, vision_reference
):
    from tests.doors.test_systemone_boxes import EDGES, by_hand, expected_box

    images = {PHOTO: noise_png(50, size=(48, 32))}
    questions = {"where": {"type": "box", "instructions": "the brightest patch"}, "c": CHOICE}
    body = request_body({"photo": PHOTO, "caption": "a test card"}, questions, images)
    reply = client.post("/v1/systemone", json=body)
    assert reply.status_code == 200, reply.text
    answer = reply.json()["answers"]["where"]
    parsed = SystemOneRequest.model_validate(body)
    settings = vision_service.settings
    defaults = Defaults(settings.systemone_orderings, settings.systemone_workloads)
    edges = core_questions(asked_question("where", parsed.questions["where"]), defaults)
    probabilities = {}
    for edge, question in zip(EDGES, edges, strict=True):
        descriptions = [o.description for o in question.options]
        text = vision_service.engine.codec.render_prompt(parsed.state, question.text, descriptions)
        logits, _, _ = expected_row(vision_reference, text, len(descriptions), images)
        probabilities[edge] = by_hand(logits)
    box, confidence = expected_box(probabilities)
    for edge in EDGES:
        assert abs(answer["box"][edge] - box[edge]) < TOL
    assert answer["box"]["top"] < answer["box"]["bottom"] and answer["box"]["left"] < answer["box"]["right"]
    assert answer["confidence"] == pytest.approx(confidence, abs=TOL)


# -- the official SDK against a live service ----------------------------------------------------------


@pytest.fixture(scope="module")
def server(app):
    with LoopbackServer(app) as running:
        yield running


@pytest.mark.parametrize("where", ["state", "instructions", "criteria"])
def test_the_sdk_sends_an_image_and_reads_the_answer_its_base64_twin_gets(server, client, where):
    data = noise_png(30)
    image = Image(data)
    placeholder = str(image)
    state: object = {"photo": image, "caption": "a product"}
    json_state: object = {"photo": placeholder, "caption": "a product"}
    question = Choice(instructions="Which colour dominates?", criteria={"red": "Mostly red.", "blue": None})
    wire = {
        "type": "choice",
        "instructions": "Which colour dominates?",
        "criteria": {"red": "Mostly red.", "blue": None},
    }
    if where == "instructions":
        state = json_state = "A photo."
        question = Choice(
            instructions=f"Which colour dominates {image}?", criteria={"red": "Mostly red.", "blue": None}
        )
        wire = {**wire, "instructions": f"Which colour dominates {placeholder}?"}
    elif where == "criteria":
        state = json_state = "A photo."
        question = Choice(instructions="Which colour?", criteria={"red": f"Like {image}.", "blue": None})
        wire = {
            **wire,
            "instructions": "Which colour?",
            "criteria": {"red": f"Like {placeholder}.", "blue": None},
        }
    with TypeSafeClient(api_key=TOKEN, base_url=server.url) as sdk, sdk.attach_assets(image):
        answer = sdk.system_one(state=state, questions={"q": question})
    twin = client.post("/v1/systemone", json=request_body(json_state, {"q": wire}, {placeholder: data}))
    assert twin.status_code == 200, twin.text
    expected = twin.json()["answers"]["q"]
    got = answer.answers["q"]
    assert got.choice == expected["choice"]
    # The twin reads the state the SDK's request kept: equal within the cache's 1e-5, not in bits.
    assert got.probabilities == pytest.approx(expected["probabilities"], abs=TOL)


def test_the_sdk_sends_a_noul_about_an_image_from_bytes(server):
    with TypeSafeClient(api_key=TOKEN, base_url=server.url) as sdk:
        image = Image(noise_png(31))
        with sdk.attach_assets(image):
            answer = sdk.system_one(state=image, questions={"n": Noul(instructions="Is it a photo?")})
    assert 0.0 < answer.answers["n"].noul < 1.0


# -- memory ---------------------------------------------------------------------------------------------


def test_an_image_too_large_for_the_memory_cap_is_a_413_with_its_need_before_any_forward(
    vision_engine, vision_checkpoint
):
    from semif_serve.engine.vision import VisionTower
    from tests.engine.test_memory import service_on
    from tests.support.memory_sim import SimulatedMemory

    small, large = noise_png(40), noise_png(41, size=(224, 224))
    tower: VisionTower = vision_engine.vision
    needs = {}
    for data in (small, large):
        patches = tower.patches(list(tower.prepare([asset_of(data)]).images.values()))
        needs[data] = tower.activation_bytes(patches, vision_engine.estimate)
    assert needs[large] > 4 * needs[small]
    # Headroom (cap - baseline, the baseline holding the state cache's budget) below the large need.
    budget = make_settings(vision_checkpoint).state_cache_mib * 2**20
    memory = SimulatedMemory(floor=0, cap=budget + needs[large] - 1)
    client = in_process_client(create_app(service_on(vision_engine, vision_checkpoint, memory)))
    answered = client.post(
        "/v1/systemone", json=request_body({"photo": PHOTO}, {"c": CHOICE}, {PHOTO: small})
    )
    assert answered.status_code == 200, answered.text
    memory.fail_next = AssertionError("a forward ran")  # the refusal comes before any device work
    refused = client.post("/v1/systemone", json=request_body({"photo": PHOTO}, {"c": CHOICE}, {PHOTO: large}))
    assert memory.fail_next is not None
    memory.fail_next = None
    assert refused.status_code == 413, refused.text
    detail = refused.json()["detail"]
    assert detail["error_type"] == "request_too_large"
    assert "vision tower" in detail["message"] and "GiB" in detail["message"]


def asset_of(data: bytes):
    from semif_serve.domain.images import read_image

    return read_image(PHOTO, data, claimed="png", max_pixels=10**7)


def test_the_sdk_asks_a_box_about_an_image_and_parses_the_box(server, client):
    data = noise_png(51)
    image = Image(data)
    with TypeSafeClient(api_key=TOKEN, base_url=server.url) as sdk, sdk.attach_assets(image):
        answer = sdk.system_one(state=image, questions={"where": Box(instructions="the brightest patch")})
    twin = client.post(
        "/v1/systemone",
        json=request_body(
            str(image), {"where": {"type": "box", "instructions": "the brightest patch"}}, {str(image): data}
        ),
    ).json()["answers"]["where"]
    got = answer.answers["where"]
    # The twin reads the state the SDK's request kept: equal within the cache's 1e-5, not in bits.
    assert got.box.top == pytest.approx(twin["box"]["top"], abs=TOL)
    assert got.box.right == pytest.approx(twin["box"]["right"], abs=TOL)
    assert 0 <= got.box.top < got.box.bottom <= 1 and 0 <= got.box.left < got.box.right <= 1


def test_an_image_request_is_counted_in_the_metrics_and_its_log_line(client, app):
    from tests.http.test_operations import metric
    from tests.support import request_log_lines

    before = client.get("/metrics").text
    images = {PHOTO: noise_png(60), "<image:other>": noise_png(61)}
    with request_log_lines() as logged:
        reply = client.post(
            "/v1/systemone",
            json=request_body({"a": PHOTO, "b": "<image:other>"}, {"c": CHOICE}, images),
            headers={"X-Request-ID": "images-1"},
        )
        client.post(
            "/v1/systemone", json=request_body("text", {"c": CHOICE}, {}), headers={"X-Request-ID": "text-1"}
        )
    assert reply.status_code == 200, reply.text
    after = client.get("/metrics").text
    assert metric(after, "semif_images_read_total") == metric(before, "semif_images_read_total") + 2
    lines = {line["request_id"]: line for line in logged}
    assert lines["images-1"]["images"] == 2
    assert "images" not in lines["text-1"]
