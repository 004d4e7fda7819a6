"""The playground's images, boxes, models and workload evaluation in a real browser (headless Chromium
through Selenium) against a live service whose checkpoint reads images: an image picked in the page
is answered as the SDK's multipart request is, a box is drawn where the API's numbers say, the model
picker lists what /v1/models lists, an evaluation shows what `semif-serve calibrate` prints for the
same rows, cancel stops sending, and the page talks to its own origin only."""

from __future__ import annotations

import base64
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from typesafe_sdk import Box, Image, Noul, TypeSafeClient

from harness.server import LoopbackServer
from semif_serve.app import create_app
from semif_serve.tools.cli import main
from tests.doors.test_playground import (  # noqa: F401 - `browser` and `artifacts` are fixtures used by name
    LAPTOP,
    PHONE,
    Page,
    api,
    artifacts,
    assert_column_shows,
    assert_shown,
    browser,
    needs_browser,
    request_of,
    template,
)
from tests.support import TOKEN
from tests.support.vision_reference import noise_png

pytestmark = needs_browser

EDGES = ("top", "bottom", "left", "right")
QUESTIONS = {
    "red": {"type": "noul", "instructions": "Is the photo mostly red?"},
    "where": {"type": "box", "instructions": "the brightest patch"},
}
TASK_QUESTIONS = {
    "team": {
        "type": "choice",
        "instructions": "Which team should handle this ticket",
        "criteria": {"billing": "Payments and refunds", "technical": "Bugs and outages", "sales": "Pricing"},
    },
    "urgent": {"type": "noul", "instructions": "The customer is blocked right now"},
    "frustration": {
        "type": "score",
        "instructions": "How frustrated the customer is",
        "criteria": ["calm", "annoyed", "angry"],
    },
}
# Question ids that are Object.prototype's names: a plain object keyed by them breaks or drops them.
PROTOTYPE_QUESTIONS = {
    "constructor": TASK_QUESTIONS["team"],
    "toString": TASK_QUESTIONS["urgent"],
    "__proto__": TASK_QUESTIONS["frustration"],
}
TICKETS = [
    "My card was charged twice for the October invoice.",
    "The API returns a 500 on every POST; checkout is down.",
    "What is the difference between the Team and Business plans?",
    "Password reset emails never arrive.",
    "Third time writing about the same billing error. Cancel my account.",
    "Does the Enterprise plan include SSO?",
    "Webhooks stopped firing at 03:00 UTC; we launch at 09:00.",
    "How much do 10 more seats cost?",
    "Rate limiting returns 429 under the quota; traffic is dropped.",
]


@pytest.fixture(scope="module")
def server(vision_service):
    with LoopbackServer(create_app(vision_service)) as running:
        yield running


@pytest.fixture
def page(browser, server):  # noqa: F811 - the imported fixture, by name
    browser.get_log("performance")  # start each test's network log afresh
    browser.get_log("browser")
    return Page(browser, server.url)


def enter_token(page: Page) -> None:
    from selenium.webdriver.common.keys import Keys

    page.type_token(TOKEN)
    page.find("#token").send_keys(Keys.TAB)  # the change event lists the models
    page.wait(20).until(lambda d: page.find("#token-status").text.startswith("Token accepted"))


def pick_image(page: Page, path: Path, images: int) -> None:
    page.find("#image-file").send_keys(str(path))
    page.wait(20).until(lambda d: page.find("body").get_attribute("data-images") == str(images))


def state_with_cursor_before_its_closing_quote(page: Page, text: str) -> None:
    from selenium.webdriver.common.keys import Keys

    page.edit("state", json.dumps(text))
    page.find("#state").send_keys(Keys.END, Keys.ARROW_LEFT)


def sent(page: Page) -> list[dict]:
    """The requests the page sent (from Chromium's network log), each once."""
    messages = [json.loads(entry["message"])["message"] for entry in page.driver.get_log("performance")]
    return [m["params"]["request"] for m in messages if m["method"] == "Network.requestWillBeSent"]


def assert_only_own_origin_and_nothing_kept(page: Page, server, requests: list[dict]) -> None:
    urls = {r["url"] for r in requests}
    assert urls and {u for u in urls if not u.startswith(f"{server.url}/")} == set()
    resources = page.driver.execute_script(
        "return performance.getEntriesByType('resource').map((e) => e.name)"
    )
    assert all(u.startswith(f"{server.url}/") for u in resources)
    assert all(TOKEN not in u for u in urls | set(resources))
    assert page.driver.execute_script("return [localStorage.length, sessionStorage.length]") == [0, 0]
    assert page.driver.execute_script("return document.cookie") == ""
    assert [e for e in page.driver.get_log("browser") if e.get("source") == "console-api"] == []


def drawn_box(page: Page, question: str) -> dict:
    """The box's rectangle and every edge bar, as the SVG's attributes say, with the viewBox."""
    return page.driver.execute_script(
        """
        const card = document.querySelector(`#results .card[data-question="${arguments[0]}"]`);
        const overlay = card.querySelector('svg.box-overlay');
        const box = overlay.querySelector('rect.box');
        const attrs = (r, names) => Object.fromEntries(names.map((n) => [n, Number(r.getAttribute(n))]));
        return {
          view: overlay.getAttribute('viewBox').split(' ').map(Number),
          box: attrs(box, ['x', 'y', 'width', 'height']),
          edges: [...overlay.querySelectorAll('rect.edge')].map((r) => ({
            edge: r.dataset.edge, position: r.dataset.position, p: Number(r.dataset.p),
            ...attrs(r, ['x', 'y', 'width', 'height'])})),
          canvas: [card.querySelector('canvas').width, card.querySelector('canvas').height],
        };
        """,
        question,
    )


def test_a_picked_image_is_answered_as_the_sdks_multipart_request_and_its_box_drawn_where_the_api_says(
    page, server, tmp_path
):
    data = noise_png(7, size=(48, 32))
    path = tmp_path / "photo.png"
    path.write_bytes(data)
    enter_token(page)
    state_with_cursor_before_its_closing_quote(page, "A photo: ")
    pick_image(page, path, images=1)
    placeholder = page.find("#image-list li").get_attribute("data-placeholder")
    assert json.loads(page.find("#state").get_attribute("value")) == f"A photo: {placeholder}"
    assert (
        page.find("#image-list canvas").get_attribute("width") == "48"
    )  # the thumbnail, drawn from the file
    page.edit("questions", json.dumps(QUESTIONS))
    page.run()
    (column,) = page.columns()
    assert column["error"] is None

    image = Image(data)
    with TypeSafeClient(api_key=TOKEN, base_url=server.url) as sdk, sdk.attach_assets(image):
        answer = sdk.system_one(
            model="jev-latest",
            state=f"A photo: {image}",
            questions={
                "red": Noul(instructions=QUESTIONS["red"]["instructions"]),
                "where": Box(instructions="the brightest patch"),
            },
        )
    red, where = answer.answers["red"], answer.answers["where"]
    assert_shown(column["cards"]["red"]["noul"], red.noul)
    for edge in EDGES:
        assert_shown(column["cards"]["where"][f"box:{edge}"], getattr(where.box, edge))

    # The page's request went as the SDK sends one: multipart, the JSON as `request`, the image as asset-0.
    requests = sent(page)  # the log is read once: a second read has only what came since
    (posted,) = [r for r in requests if r["url"].endswith("/v1/systemone")]
    assert posted["headers"]["Content-Type"].startswith("multipart/form-data; boundary=")
    if "postData" in posted:
        assert (
            'name="request"' in posted["postData"]
            and 'name="asset-0"; filename="asset-0"' in posted["postData"]
        )

    # The box and each edge's distribution are drawn where the API's numbers say, in the image's pixels.
    reply = httpx.post(
        f"{server.url}/v1/systemone",
        json={
            "model": "jev-latest",
            "state": f"A photo: {placeholder}",
            "questions": QUESTIONS,
            "assets": {
                placeholder: {
                    "type": "image",
                    "format": "png",
                    "data_base64": base64.b64encode(data).decode(),
                }
            },
        },
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=120,
    ).json()["answers"]["where"]
    drawn = drawn_box(page, "where")
    assert drawn["view"] == [0, 0, 48, 32] and drawn["canvas"] == [48, 32]
    box = reply["box"]
    expected = {
        "x": box["left"] * 48,
        "y": box["top"] * 32,
        "width": (box["right"] - box["left"]) * 48,
        "height": (box["bottom"] - box["top"]) * 32,
    }
    assert drawn["box"] == pytest.approx(expected, abs=1e-6)
    for edge in EDGES:
        bars = {b["position"]: b for b in drawn["edges"] if b["edge"] == edge}
        ordered = reply["x_edges"][edge]["ordered"]
        assert set(bars) == set(ordered)
        peak = max(ordered.values())  # the likeliest position's bar reaches a quarter of the image
        for position, p in ordered.items():
            bar = bars[position]
            # A second request of the same body: the engine may run it on another thread count
            # (engine.threads), which moves float32 sums in their last bits (contract: within 1e-5).
            assert bar["p"] == pytest.approx(p, abs=1e-6)
            if edge in ("top", "bottom"):  # bars from the left side, at the position's height
                assert bar["y"] + bar["height"] / 2 == pytest.approx(float(position) * 32, abs=1e-6)
                assert bar["width"] == pytest.approx(p / peak * 48 * 0.25, abs=1e-6)
            else:  # bars from the top, at the position's width
                assert bar["x"] + bar["width"] / 2 == pytest.approx(float(position) * 48, abs=1e-6)
                assert bar["height"] == pytest.approx(p / peak * 32 * 0.25, abs=1e-6)
    assert_only_own_origin_and_nothing_kept(page, server, requests)

    # The copied curl and typesafe-sdk snippets send the image from its file, multipart, to the same answers.
    env = {**os.environ, "SEMIF_API_TOKEN": TOKEN}
    for kind, command in (("curl", ["bash", "-c"]), ("python", [sys.executable, "-c"])):
        snippet = page.copied(0, kind)
        assert TOKEN not in snippet and "photo.png" in snippet, kind
        ran = subprocess.run(
            [*command, snippet], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        assert ran.returncode == 0, (kind, ran.stderr)
        answers = json.loads(ran.stdout)["answers"]
        assert answers["red"]["noul"] == pytest.approx(red.noul, abs=1e-5), kind
        assert answers["where"]["box"] == pytest.approx(reply["box"], abs=1e-5), kind


def test_an_image_over_the_services_pixel_limit_or_not_an_image_is_refused_in_the_page(
    page, server, tmp_path
):
    from PIL import Image as PILImage

    limits = httpx.get(f"{server.url}/health").json()["images"]
    enter_token(page)
    text = tmp_path / "notes.png"
    text.write_bytes(b"not an image at all")
    page.find("#image-file").send_keys(str(text))
    page.wait(10).until(lambda d: "not a PNG or JPEG" in page.find("#image-error").text)
    side = int(limits["max_image_pixels"] ** 0.5) + 1  # one pixel row over the limit, a small file
    wide = tmp_path / "wide.png"
    PILImage.new("RGB", (side, side), (10, 20, 30)).save(wide, format="PNG")
    page.find("#image-file").send_keys(str(wide))
    words = f"is {side}x{side} pixels, over the service's {limits['max_image_pixels']} (max_image_pixels)"
    page.wait(60).until(lambda d: words in page.find("#image-error").text)
    assert page.find("#image-list").text == ""
    assert page.find("#state").get_attribute("value").count("<image:") == 0
    fine = tmp_path / "fine.png"
    fine.write_bytes(noise_png(3, size=(8, 8)))
    pick_image(page, fine, images=1)
    assert page.find("#image-error").text == ""


@pytest.fixture(scope="module")
def text_server(service):
    """A live service whose checkpoint has no vision tower."""
    with LoopbackServer(create_app(service)) as running:
        yield running


def test_an_image_sent_to_a_model_that_reads_none_shows_the_services_refusal(browser, text_server, tmp_path):  # noqa: F811
    data = noise_png(9)
    path = tmp_path / "photo.png"
    path.write_bytes(data)
    page = Page(browser, text_server.url)
    enter_token(page)
    assert "reads no images" in page.find("#image-warning").text
    state_with_cursor_before_its_closing_quote(page, "A photo: ")
    pick_image(page, path, images=1)
    placeholder = page.find("#image-list li").get_attribute("data-placeholder")
    page.edit("questions", json.dumps({"red": QUESTIONS["red"]}))
    page.run()
    (column,) = page.columns()
    asset = {"type": "image", "format": "png", "data_base64": base64.b64encode(data).decode()}
    reply = api(
        text_server,
        {
            **request_of(template("ticket-triage")),
            "state": f"A photo: {placeholder}",
            "questions": {"red": QUESTIONS["red"]},
            "assets": {placeholder: asset},
        },
    )
    assert reply.status_code == 400
    detail = reply.json()["detail"]
    assert column["error"] == {"title": f"400 {detail['error_type']}", "items": [detail["message"]]}
    assert "does not read images" in detail["message"]


def test_the_model_picker_lists_what_v1_models_lists_and_two_models_run_side_by_side(page, server):
    listed = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {TOKEN}"}).json()[
        "models"
    ]
    names = [m["name"] for m in listed]
    enter_token(page)
    for select in ("model", "model-a", "model-b"):
        shown = page.driver.execute_script(
            "return [...document.querySelectorAll(`#${arguments[0]} option`)].map((o) => o.value)", select
        )
        assert shown == names, select
    rows = page.driver.execute_script(
        """return [...document.querySelectorAll('#model-table tbody tr')].map((tr) => [tr.dataset.model,
             Object.fromEntries([...tr.querySelectorAll('td')].map((td) => [td.dataset.key,
                                                                             td.textContent]))])"""
    )
    real = next(m for m in listed if "x_alias_of" not in m)
    assert [name for name, _ in rows] == names
    for name, cells in rows:
        entry = next(m for m in listed if m["name"] == name)
        assert cells["x_alias_of"] == entry.get("x_alias_of", "none")
        assert cells["x_reads_images"] == (
            "yes" if real["x_reads_images"] else "no"
        )  # an alias reads what it names
        assert cells["x_max_options"] == str(real["x_max_options"])
    page.choose("compare", "models")
    page.choose("model-a", real["name"])
    page.choose("model-b", "jev-preview")
    page.run()
    first, second = page.columns()
    assert (first["title"], second["title"]) == (f"A: {real['name']}", "B: jev-preview")
    chosen = template("ticket-triage")
    for column, model in ((first, real["name"]), (second, "jev-preview")):
        reply = api(server, {**request_of(chosen), "model": model})
        assert reply.status_code == 200
        assert_column_shows(column, reply.json())


# -- evaluating and calibrating a workload ---------------------------------------------------------------


def drawn_label(rng: random.Random, question: dict):
    if question["type"] == "choice":
        return rng.choice(list(question["criteria"]))
    if question["type"] == "noul":
        return rng.random() < 0.5
    return rng.randrange(len(question["criteria"]))


def levbench_file(
    tmp_path: Path, items: int, seed: int, questions: dict = TASK_QUESTIONS
) -> tuple[Path, list[dict]]:
    """A task file in levbench's format, with labels drawn at random."""
    rng = random.Random(seed)
    rows = [
        {
            "state": TICKETS[i % len(TICKETS)] + f" (ticket {i})",
            "labels": {qid: drawn_label(rng, question) for qid, question in questions.items()},
        }
        for i in range(items)
    ]
    path = tmp_path / "tickets.json"
    path.write_text(json.dumps({"questions": questions, "items": rows}))
    return path, rows


def label_id(question: dict, value) -> str:
    if question["type"] == "noul":
        return "true" if value else "false"
    return str(value)


def cli_reports(
    server, tmp_path: Path, rows: list[dict], questions: dict = TASK_QUESTIONS
) -> tuple[dict[str, dict], dict[str, list[dict]]]:
    """Each question's `semif-serve calibrate --json` report on the API's single reads of the same
    items, and those reads (each item's option logits, by question)."""
    reads = [
        api(server, {"model": "jev-latest", "state": row["state"], "questions": questions}).json()["answers"]
        for row in rows
    ]
    reports = {}
    for n, (qid, question) in enumerate(questions.items()):
        gold, preds, out = (
            tmp_path / f"q{n}.jsonl",
            tmp_path / f"q{n}-preds.jsonl",
            tmp_path / f"q{n}.json",
        )
        lines_gold, lines_pred = [], []
        for i, (row, answers) in enumerate(zip(rows, reads, strict=True)):
            logits = answers[qid]["x_semif"]["option_logits"]
            ids = list(logits)
            options = [{"id": k} for k in ids]
            label = ids.index(label_id(question, row["labels"][qid]))
            lines_gold.append(json.dumps({"id": i, "group_id": i, "options": options, "label": label}))
            lines_pred.append(
                json.dumps({"id": i, "option_ids": ids, "option_logits": [logits[k] for k in ids]})
            )
        gold.write_text("\n".join(lines_gold) + "\n")
        preds.write_text("\n".join(lines_pred) + "\n")
        assert main(["calibrate", "--gold", str(gold), "--predictions", str(preds), "--json", str(out)]) == 0
        reports[qid] = json.loads(out.read_text())
    return reports, {
        qid: [answers[qid]["x_semif"]["option_logits"] for answers in reads] for qid in questions
    }


def evaluate(page: Page, path: Path, in_flight: int) -> None:
    page.find("#eval-file").send_keys(str(path))
    page.wait(10).until(lambda d: page.find("#eval-run").is_enabled())
    page.edit("eval-flight", str(in_flight))
    before = int(page.find("body").get_attribute("data-evaluations") or 0)
    page.find("#eval-run").click()
    page.wait().until(lambda d: int(page.find("body").get_attribute("data-evaluations") or 0) == before + 1)


def shown_reports(page: Page) -> dict[str, dict]:
    """Each card's numbers by question id (as pairs from the page: no object keyed by the file's ids)."""
    cards = page.driver.execute_script(
        """return [...document.querySelectorAll('#eval-results .card')].map((card) => [
             card.dataset.question,
             [...card.querySelectorAll('.num')].map((n) => [n.dataset.field, n.textContent])])"""
    )
    return {qid: dict(fields) for qid, fields in cards}


def assert_evaluated_as_semif_serve_calibrate_prints(page, server, tmp_path, questions: dict) -> None:
    path, rows = levbench_file(tmp_path, items=9, seed=3, questions=questions)
    enter_token(page)
    evaluate(page, path, in_flight=3)
    assert page.find("#eval-status").text.startswith("Done: 9 requests, 3 questions fitted")
    assert 1 <= int(page.find("body").get_attribute("data-eval-max-in-flight")) <= 3
    shown = shown_reports(page)
    expected, reads = cli_reports(server, tmp_path, rows, questions)
    assert list(shown) == list(questions)
    for qid, report in expected.items():
        numbers = shown[qid]
        for field in ("accuracy", "nll", "ece"):
            assert_shown(
                numbers[f"{field}_before"], report[f"{field}_before" if field != "accuracy" else "accuracy"]
            )
            assert_shown(
                numbers[f"{field}_after"], report[f"{field}_after" if field != "accuracy" else "accuracy"]
            )
        assert_shown(numbers["temperature"], report["temperature"])
        if report["ece_out_of_fold"] is not None:
            assert_shown(numbers["ece_out_of_fold"], report["ece_out_of_fold"])
        # The accuracy, by hand: how often the single read's top option is the label.
        tops = [max(logits, key=logits.get) for logits in reads[qid]]
        labels = [label_id(questions[qid], row["labels"][qid]) for row in rows]
        assert_shown(numbers["accuracy_after"], sum(map(str.__eq__, tops, labels)) / len(rows))
    page.find("#eval-copy").click()
    entries = json.loads(page.find("#eval-results .snippet").get_attribute("value"))
    assert entries == {qid: round(report["temperature"], 4) for qid, report in expected.items()}
    requests = sent(page)
    assert len([r for r in requests if r["url"].endswith("/v1/systemone")]) == 9
    assert len([r for r in requests if r["url"].endswith("/calibrate")]) == 3
    assert_only_own_origin_and_nothing_kept(page, server, requests)


def test_an_evaluation_shows_the_accuracy_ece_and_temperature_semif_serve_calibrate_prints(
    page, server, tmp_path
):
    assert_evaluated_as_semif_serve_calibrate_prints(page, server, tmp_path, TASK_QUESTIONS)


def test_questions_named_as_object_prototype_names_are_each_evaluated_and_fitted(page, server, tmp_path):
    assert_evaluated_as_semif_serve_calibrate_prints(page, server, tmp_path, PROTOTYPE_QUESTIONS)


@pytest.mark.parametrize(
    "options",
    [
        [
            {"id": "yes", "description": "It succeeded."},
            {"id": "no", "description": "It failed."},
            {"id": "unsure", "description": "Cannot tell."},
        ],
        # Integer-like ids: a JS object would put them first, ascending; the rows' order is kept.
        [
            {"id": "10", "description": "It succeeded on every host."},
            {"id": "2", "description": "It failed."},
            {"id": "b", "description": "Cannot tell."},
            {"id": "1", "description": "It succeeded on some hosts."},
        ],
    ],
    ids=["named-options", "integer-like-options"],
)
def test_fixture_rows_are_evaluated_as_semif_serve_calibrate_reads_the_same_file(
    page, server, tmp_path, options
):
    rng = random.Random(11)
    rows = [
        {
            "id": f"r{i}",
            "family": "deploy",
            "group_id": f"g{i // 2}",
            "state": f"Rollout {i}: health checks {'passed' if i % 2 else 'failed'}.",
            "question": "Did the deployment succeed?",
            "options": options,
            "label": rng.randrange(len(options)),
        }
        for i in range(8)
    ]
    gold = tmp_path / "deploys.jsonl"
    gold.write_text("".join(json.dumps(r) + "\n" for r in rows))
    enter_token(page)
    evaluate(page, gold, in_flight=2)
    shown = shown_reports(page)
    assert list(shown) == ["deploys"]
    preds = tmp_path / "preds.jsonl"
    lines = []
    for row in rows:
        question = {
            "type": "choice",
            "instructions": row["question"],
            "criteria": {o["id"]: o["description"] for o in options},
        }
        reply = api(
            server, {"model": "jev-latest", "state": row["state"], "questions": {"deploys": question}}
        ).json()
        logits = reply["answers"]["deploys"]["x_semif"]["option_logits"]
        lines.append(
            json.dumps({"id": row["id"], "option_ids": list(logits), "option_logits": list(logits.values())})
        )
    preds.write_text("\n".join(lines) + "\n")
    out = tmp_path / "report.json"
    assert main(["calibrate", "--gold", str(gold), "--predictions", str(preds), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert_shown(shown["deploys"]["accuracy_before"], report["accuracy"])
    assert_shown(shown["deploys"]["ece_before"], report["ece_before"])
    assert_shown(shown["deploys"]["ece_after"], report["ece_after"])
    assert_shown(shown["deploys"]["temperature"], report["temperature"])


def test_an_evaluation_refused_by_the_service_shows_its_words_and_sends_no_more(page, server, tmp_path):
    path, rows = levbench_file(tmp_path, items=6, seed=2)
    reply = api(
        server, {"model": "jev-latest", "state": rows[0]["state"], "questions": TASK_QUESTIONS}, token="wrong"
    )
    assert reply.status_code == 401
    page.type_token("wrong")
    evaluate(page, path, in_flight=2)
    title = page.find("#eval-results .error-title").text
    assert title.startswith("items[") and title.endswith("]: 401 authentication_error"), title
    items = [li.text for li in page.driver.find_elements("css selector", "#eval-results .error-box li")]
    assert items == [reply.json()["detail"]["message"]]
    requests = sent(page)
    assert 1 <= len([r for r in requests if r["url"].endswith("/v1/systemone")]) <= 2
    assert not [r for r in requests if r["url"].endswith("/calibrate")]
    assert page.find("#eval-status").text == "Failed."


def test_cancel_stops_sending(page, server, tmp_path):
    path, _ = levbench_file(tmp_path, items=40, seed=5)
    enter_token(page)
    page.find("#eval-file").send_keys(str(path))
    page.wait(10).until(lambda d: page.find("#eval-run").is_enabled())
    page.edit("eval-flight", "1")
    page.find("#eval-run").click()
    page.wait(60).until(lambda d: float(page.find("#eval-progress").get_attribute("value")) >= 1)
    page.find("#eval-cancel").click()
    page.wait(20).until(lambda d: page.find("#eval-status").text.startswith("Cancelled"))
    count = len([r for r in sent(page) if r["url"].endswith("/v1/systemone")])
    # The page's own request after the cancel ends the window watched (the log keeps send order).
    page.driver.execute_script("fetch('/health?after-cancel')")
    since: list[dict] = []

    def marker_sent(_driver) -> bool:
        since.extend(sent(page))
        return any(r["url"].endswith("/health?after-cancel") for r in since)

    page.wait(20).until(marker_sent)
    later = len([r for r in since if r["url"].endswith("/v1/systemone")])
    assert later == 0  # the log was read once above: nothing more was sent since
    assert 1 <= count < 40
    assert page.find("body").get_attribute("data-eval-sent") == str(count)
    assert page.find("#eval-results").text == ""
    assert page.find("#eval-run").is_enabled() and not page.find("#eval-cancel").is_enabled()


def test_the_workbench_reads_at_phone_and_laptop_width(page, server, tmp_path, artifacts):  # noqa: F811
    path = tmp_path / "photo.png"
    path.write_bytes(noise_png(21, size=(64, 40)))
    enter_token(page)
    state_with_cursor_before_its_closing_quote(page, "A photo: ")
    pick_image(page, path, images=1)
    page.edit("questions", json.dumps(QUESTIONS))
    page.run()
    task, _ = levbench_file(tmp_path, items=6, seed=8)
    evaluate(page, task, in_flight=2)
    for name, (width, height) in {"laptop": LAPTOP, "phone": PHONE}.items():
        shot = page.screenshot(artifacts / f"playground-workbench-{name}.png", width, height)
        assert shot.stat().st_size > 10_000
        overflow = page.driver.execute_script(
            "return document.documentElement.scrollWidth - document.documentElement.clientWidth"
        )
        assert overflow <= 0, (name, overflow)
    assert_only_own_origin_and_nothing_kept(page, server, sent(page))
