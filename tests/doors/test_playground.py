"""The playground page in a real browser (Debian's headless Chromium through Selenium) against a live
service: the numbers it shows are the ones the API returns for the same request, errors read as the
service words them, copied snippets run, and the page talks to no other origin."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from harness.server import LoopbackServer
from semif_serve.app import create_app
from semif_serve.playground import ASSETS, FILES
from tests.support import TOKEN

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
TEMPLATES = json.loads((ASSETS / "templates.json").read_text())["templates"]
# Shown with 4 decimals; the API's own repeat may differ by 1e-5 (a cached state, fp32 on CPU).
SHOWN = 0.5e-4 + 2e-5
PHONE = (390, 844)
SVG_NAMESPACE = (
    "http://www.w3.org/2000/svg"  # the SVG namespace: a name in the favicon and the script, never fetched
)
LAPTOP = (1366, 900)

needs_browser = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="Debian's chromium and chromium-driver are not installed (.ci/run installs them)",
)


@pytest.fixture(scope="module")
def server(service):
    with LoopbackServer(create_app(service)) as running:
        yield running


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    """Where the screenshots go: PLAYGROUND_SCREENSHOT_DIR, or a fresh tmp dir (printed)."""
    chosen = os.environ.get("PLAYGROUND_SCREENSHOT_DIR")
    path = Path(chosen) if chosen else tmp_path_factory.mktemp("playground-screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for the whole file, with its network log on."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service as DriverService

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument(f"--window-size={LAPTOP[0]},{LAPTOP[1]}")
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    # The driver's path is given: Selenium Manager never runs, nothing is downloaded.
    driver = webdriver.Chrome(service=DriverService(str(CHROMEDRIVER)), options=options)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


class Page:
    """The playground as a user drives it."""

    def __init__(self, driver, url: str) -> None:
        from selenium.webdriver.support.ui import WebDriverWait

        self.driver = driver
        self.url = url
        self.wait = lambda seconds=120: WebDriverWait(driver, seconds)
        driver.set_window_size(*LAPTOP)
        driver.get(f"{url}/playground")
        self.wait(20).until(
            lambda d: d.find_element("tag name", "body").get_attribute("data-ready") == "true"
        )

    def find(self, selector: str):
        return self.driver.find_element("css selector", selector)

    def choose(self, select_id: str, value: str) -> None:
        from selenium.webdriver.support.ui import Select

        Select(self.find(f"#{select_id}")).select_by_value(value)

    def type_token(self, token: str) -> None:
        field = self.find("#token")
        field.clear()
        field.send_keys(token)

    def edit(self, area_id: str, text: str) -> None:
        area = self.find(f"#{area_id}")
        area.clear()
        area.send_keys(text)

    def runs(self) -> int:
        return int(self.find("body").get_attribute("data-runs") or 0)

    def run(self, by_keyboard: bool = False) -> None:
        before = self.runs()
        if by_keyboard:
            from selenium.webdriver.common.keys import Keys

            self.find("#questions").send_keys(Keys.CONTROL, Keys.ENTER)
        else:
            self.find("#run").click()
        self.wait().until(lambda d: self.runs() == before + 1)

    def columns(self) -> list[dict]:
        """Each result column as shown: its title, each question's shown numbers, the footer, errors."""
        return self.driver.execute_script(
            """
            const fields = (root) => Object.fromEntries(
              [...root.querySelectorAll('.num')].map((n) => [n.dataset.field, n.textContent]));
            return [...document.querySelectorAll('#results .column')].map((column) => ({
              title: column.querySelector('h2').textContent,
              cards: Object.fromEntries([...column.querySelectorAll('.card')].map(
                (card) => [card.dataset.question, fields(card)])),
              footer: column.querySelector('.footer') ? fields(column.querySelector('.footer')) : null,
              error: column.querySelector('.error-box') ? {
                title: column.querySelector('.error-title').textContent,
                items: [...column.querySelectorAll('.error-box li')].map((li) => li.textContent),
              } : null,
            }));
            """
        )

    def copied(self, column: int, kind: str) -> str:
        buttons = self.driver.find_elements("css selector", f'#results .column .copy[data-kind="{kind}"]')
        buttons[column].click()
        areas = self.driver.find_elements("css selector", "#results .column .snippet")
        self.wait(10).until(lambda d: areas[column].get_attribute("data-kind") == kind)
        return areas[column].get_attribute("value")

    def screenshot(self, path: Path, width: int, height: int) -> Path:
        self.driver.set_window_size(width, height)
        full = self.driver.execute_script("return document.documentElement.scrollHeight")
        self.driver.set_window_size(width, min(full + 120, 8000))
        self.driver.execute_script("window.scrollTo(0, 0)")
        self.driver.save_screenshot(str(path))
        print(f"playground screenshot: {path}")
        return path


@pytest.fixture
def page(browser, server):
    browser.get_log("performance")  # start each test's network log afresh
    return Page(browser, server.url)


def api(server, body: dict, token: str = TOKEN) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/systemone", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=120
    )


def request_of(template: dict, questions: dict | None = None) -> dict:
    return {
        "model": "jev-latest",
        "state": template["state"],
        "questions": questions or template["questions"],
    }


def template(template_id: str) -> dict:
    return next(t for t in TEMPLATES if t["id"] == template_id)


def assert_shown(text: str, value: float) -> None:
    assert abs(float(text) - value) <= SHOWN, (text, value)


def assert_column_shows(column: dict, reply: dict) -> None:
    """Every number of the column is the API's for the same request."""
    assert set(column["cards"]) == set(reply["answers"])
    for qid, answer in reply["answers"].items():
        shown = column["cards"][qid]
        semif = answer["x_semif"]
        if answer["type"] == "noul":
            finals = {"true": answer["noul"], "false": 1 - answer["noul"]}
            assert_shown(shown["noul"], answer["noul"])
            assert_shown(shown["bar:true"], answer["noul"])
        else:
            finals = answer["probabilities"]
            assert_shown(shown["confidence"], answer["confidence"])
            for name, p in finals.items():
                assert_shown(shown[f"bar:{name}"], p)
        if answer["type"] == "choice":
            assert shown["choice"] == answer["choice"]
        if answer["type"] == "score":
            assert_shown(shown["score"], answer["score"])
        for name, p in finals.items():
            assert_shown(shown[f"final:{name}"], p)
        assert len(semif["readings"]) == semif["rows"]
        for i, reading in enumerate(semif["readings"]):
            for name, p in reading["probabilities"].items():
                assert_shown(shown[f"reading{i}:{name}"], p)
        assert not any(key.startswith(f"reading{semif['rows']}:") for key in shown)
        assert (shown["orderings"], shown["rows"]) == (semif["orderings"], str(semif["rows"]))
        assert_shown(shown["agreement"], semif["agreement"])
        assert shown["workload"] == (semif["workload"] or "none")
        if semif["temperature"] is None:
            assert shown["temperature"] == "none (1)"
        else:
            assert float(shown["temperature"]) == semif["temperature"]
    footer = column["footer"]
    assert footer["input_tokens"] == str(reply["usage"]["input_tokens"])
    assert footer["prefill"] in ("fresh", "extended", "cached")
    assert re.fullmatch(r"\d+\.\d ms", footer["total_ms"])
    assert footer["model"] == reply["model"]


# -- served as a page of this origin only --------------------------------------------------------------


def test_the_page_and_its_files_are_open_with_a_policy_that_allows_only_this_origin(server):
    for path in ["/playground", *(f"/playground/{name}" for name in FILES)]:
        reply = httpx.get(f"{server.url}{path}")
        assert reply.status_code == 200, path
        policy = dict(d.strip().split(" ", 1) for d in reply.headers["content-security-policy"].split(";"))
        assert policy["default-src"] == "'none'"
        assert {policy[d] for d in ("script-src", "style-src", "connect-src", "img-src")} == {"'self'"}
        assert reply.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(f"{server.url}/playground/__init__.py").status_code == 404
    assert httpx.get(f"{server.url}/playground/").status_code == 404


def test_the_page_names_no_other_origin_and_has_no_inline_script_or_style():
    html = (ASSETS / "index.html").read_text()
    for name in ["index.html", *FILES]:
        text = (ASSETS / name).read_text().replace(SVG_NAMESPACE, "")  # a name, never fetched
        assert not re.search(r"(https?:)?//[a-z0-9]", text, re.I), name
    scripts = re.findall(r"<script\b[^>]*>(.*?)</script>", html, re.S)
    assert scripts and all(body.strip() == "" for body in scripts)
    assert not re.search(r"\s(style|on[a-z]+)=", html)


def test_the_page_script_never_stores_anything():
    script = (ASSETS / "playground.js").read_text()
    banned = ("localStorage", "sessionStorage", "indexedDB", "document.cookie", "location.hash")
    assert [name for name in banned if name in script] == []


def test_the_page_script_passes_node_check():
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    result = subprocess.run([node, "--check", str(ASSETS / "playground.js")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# -- in the browser ---------------------------------------------------------------------------------


@needs_browser
@pytest.mark.parametrize("template_id", [t["id"] for t in TEMPLATES if t["questions"]])
def test_each_template_shows_the_numbers_the_api_returns(page, server, template_id):
    page.type_token(TOKEN)
    page.choose("template", template_id)
    page.run()
    (column,) = page.columns()
    assert column["error"] is None
    reply = api(server, request_of(template(template_id)))
    assert reply.status_code == 200
    assert_column_shows(column, reply.json())


@needs_browser
def test_the_empty_template_shows_the_services_422_field_and_rule(page, server):
    page.type_token(TOKEN)
    page.choose("template", "empty")
    page.run()
    (column,) = page.columns()
    reply = api(server, request_of(template("empty")))
    assert reply.status_code == 422
    expected = [
        f"{' › '.join(map(str, d['loc'][1:]))}: {d['msg']} ({d['type']})" for d in reply.json()["detail"]
    ]
    assert column["error"] == {"title": "422 validation error", "items": expected}
    assert "questions" in expected[0]


@needs_browser
def test_two_orderings_policies_run_side_by_side_each_as_the_api_answers(page, server):
    chosen = template("guardrail")
    page.type_token(TOKEN)
    page.choose("template", chosen["id"])
    page.choose("compare", "orderings")
    page.choose("orderings-a", "none")
    page.choose("orderings-b", "reversal")
    page.run()
    first, second = page.columns()
    assert (first["title"], second["title"]) == ("A: x_orderings: none", "B: x_orderings: reversal")
    for column, mode in ((first, "none"), (second, "reversal")):
        questions = {qid: {**q, "x_orderings": mode} for qid, q in chosen["questions"].items()}
        reply = api(server, request_of(chosen, questions)).json()
        assert_column_shows(column, reply)
        assert {card["orderings"] for card in column["cards"].values()} == {mode}


@needs_browser
def test_two_phrasings_run_side_by_side_each_as_the_api_answers(page, server):
    chosen = template("deployment-check")
    page.type_token(TOKEN)
    page.choose("template", chosen["id"])
    page.choose("compare", "phrasings")
    page.run()
    first, second = page.columns()
    assert_column_shows(first, api(server, request_of(chosen)).json())
    assert_column_shows(second, api(server, request_of(chosen, chosen["phrasing_b"])).json())


@needs_browser
def test_an_invalid_json_edit_shows_the_parse_error_next_to_the_field_and_sends_nothing(page):
    page.type_token(TOKEN)
    page.edit("questions", '{"team": {"type": "choice",')
    error = page.find("#questions-error").text
    assert error.startswith("Invalid JSON:") and "JSON" in error[len("Invalid JSON:") :]
    assert page.find("#questions").get_attribute("aria-invalid") == "true"
    page.find("#run").click()
    assert page.find("#run-status").text.startswith("Fix the JSON first")
    assert page.find("#results").text == ""
    page.edit("state", "[1, 2")
    assert page.find("#state-error").text.startswith("Invalid JSON:")
    page.edit("questions", '{"q": {"type": "noul"}}')
    assert page.find("#questions-error").text == ""
    assert page.find("#questions").get_attribute("aria-invalid") == "false"
    page.edit("questions", '["not", "an", "object"]')
    assert "object" in page.find("#questions-error").text


@needs_browser
def test_a_wrong_token_shows_the_services_401_message(page, server):
    reply = api(server, request_of(template("ticket-triage")), token="not-the-token")
    assert reply.status_code == 401
    message = reply.json()["detail"]["message"]
    page.type_token("not-the-token")
    page.run()
    (column,) = page.columns()
    assert column["error"] == {"title": "401 authentication_error", "items": [message]}
    assert page.find("#token-status").text == f"401 authentication_error: {message}"


@needs_browser
def test_the_copied_snippets_carry_a_placeholder_and_run_to_the_same_answers(page, server, tmp_path):
    chosen = template("ticket-triage")
    page.type_token(TOKEN)
    page.run()
    (column,) = page.columns()
    expected = api(server, request_of(chosen)).json()["answers"]
    env = {**os.environ, "SEMIF_API_TOKEN": TOKEN}
    snippets = {kind: page.copied(0, kind) for kind in ("curl", "python", "javascript")}
    for kind, text in snippets.items():
        assert TOKEN not in text, kind
        assert "SEMIF_API_TOKEN" in text, kind
    curl = subprocess.run(
        ["bash", "-c", snippets["curl"]], env=env, capture_output=True, text=True, timeout=120
    )
    assert curl.returncode == 0, curl.stderr
    assert json.loads(curl.stdout)["answers"]["team"]["probabilities"] == pytest.approx(
        expected["team"]["probabilities"], abs=1e-5
    )
    python = subprocess.run(
        [sys.executable, "-c", snippets["python"]], env=env, capture_output=True, text=True, timeout=120
    )
    assert python.returncode == 0, python.stderr
    parsed = json.loads(python.stdout)["answers"]
    assert parsed["urgency"]["choice"] == expected["urgency"]["choice"]
    assert parsed["team"]["probabilities"] == pytest.approx(expected["team"]["probabilities"], abs=1e-5)
    node = shutil.which("node")
    if node is not None:
        script = tmp_path / "snippet.mjs"
        script.write_text(snippets["javascript"])
        check = subprocess.run([node, "--check", str(script)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
    assert (
        'new TypeSafeClient({\n  apiKey: process.env.SEMIF_API_TOKEN,\n  baseURL: "' in snippets["javascript"]
    )
    assert f"baseURL: {json.dumps(server.url)}" in snippets["javascript"]


# Option names that look like integers: a JavaScript object lists them first, ascending ("1", "2", "10").
WRITTEN_ORDER = ["10", "2", "b", "1"]
INTEGER_LIKE_QUESTIONS = (
    '{"seats": {"type": "choice", "instructions": "How many seats the customer asks for",'
    ' "criteria": {"10": "ten or more", "2": "two", "b": "it is a billing question", "1": "one"}}}'
)


@needs_browser
def test_options_named_like_integers_are_sent_shown_and_copied_in_the_written_order(page, server):
    state = "Please add seats for our two new hires."
    page.type_token(TOKEN)
    page.edit("state", json.dumps(state))
    page.edit("questions", INTEGER_LIKE_QUESTIONS)
    page.run()
    (column,) = page.columns()
    # The service's answer to the same JSON text, sent as written (httpx does not reorder it).
    text = f'{{"model": "jev-latest", "state": {json.dumps(state)}, "questions": {INTEGER_LIKE_QUESTIONS}}}'
    reply = httpx.post(
        f"{server.url}/v1/systemone",
        content=text,
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        timeout=120,
    ).json()
    answer = reply["answers"]["seats"]
    assert list(answer["probabilities"]) == WRITTEN_ORDER
    assert [reading["order"] for reading in answer["x_semif"]["readings"]][0] == WRITTEN_ORDER
    assert_column_shows(column, reply)
    drawn = page.driver.execute_script(
        """const card = document.querySelector('#results .card[data-question="seats"]');
           return [[...card.querySelectorAll('.bar-row')].map((row) => row.dataset.option),
                   [...card.querySelectorAll('.readings tbody th')].map((th) => th.textContent),
                   [...card.querySelectorAll('.readings thead th[title]')].map((th) => th.title)]"""
    )
    assert drawn == [
        WRITTEN_ORDER,
        WRITTEN_ORDER,
        [f"asked in the order {', '.join(r['order'])}" for r in answer["x_semif"]["readings"]],
    ]
    curl = page.copied(0, "curl")
    body = json.loads(curl.split("<<'JSON'\n", 1)[1].rsplit("\nJSON", 1)[0])
    assert list(body["questions"]["seats"]["criteria"]) == WRITTEN_ORDER
    python = page.copied(0, "python")
    assert python.index('"10": ') < python.index('"2": ') < python.index('"b": ') < python.index('"1": ')


@needs_browser
def test_every_control_is_labelled_and_a_run_works_from_the_keyboard(page, server):
    unlabelled = page.driver.execute_script(
        """
        return [...document.querySelectorAll('input, select, textarea, button')].filter((c) => {
          if (c.closest('[hidden]')) return false;
          const label = c.id && document.querySelector(`label[for="${c.id}"]`);
          const named = (label && label.textContent.trim()) || c.getAttribute('aria-label');
          return !named && !c.textContent.trim();
        }).map((c) => c.outerHTML);
        """
    )
    assert unlabelled == []
    page.type_token(TOKEN)
    page.run(by_keyboard=True)
    (column,) = page.columns()
    assert_column_shows(column, api(server, request_of(template("ticket-triage"))).json())


@needs_browser
def test_the_page_reads_at_phone_and_laptop_width_and_requests_only_its_own_origin(page, server, artifacts):
    page.type_token(TOKEN)
    page.choose("template", "guardrail")
    page.choose("compare", "orderings")
    page.run()
    page.copied(0, "curl")
    for name, (width, height) in {"laptop": LAPTOP, "phone": PHONE}.items():
        shot = page.screenshot(artifacts / f"playground-{name}.png", width, height)
        assert shot.stat().st_size > 10_000
        overflow = page.driver.execute_script(
            "return document.documentElement.scrollWidth - document.documentElement.clientWidth"
        )
        assert overflow <= 0, (name, overflow)
    sent = [json.loads(entry["message"])["message"] for entry in page.driver.get_log("performance")]
    urls = {m["params"]["request"]["url"] for m in sent if m["method"] == "Network.requestWillBeSent"}
    assert f"{server.url}/v1/systemone" in urls and f"{server.url}/playground/playground.js" in urls
    assert {u for u in urls if not u.startswith(f"{server.url}/")} == set()
    resources = page.driver.execute_script(
        "return performance.getEntriesByType('resource').map((e) => e.name)"
    )
    assert resources and all(u.startswith(f"{server.url}/") for u in resources)
    assert all(TOKEN not in u for u in urls | set(resources))
    assert page.driver.execute_script("return [localStorage.length, sessionStorage.length]") == [0, 0]
    logged = [e for e in page.driver.get_log("browser") if e.get("source") == "console-api"]
    assert logged == []


# -- the API pages (/docs) under the same kind of policy ----------------------------------------------


def test_the_api_pages_carry_a_policy_that_forbids_framing_and_sniffing(server):
    for path in [
        "/docs",
        "/openapi.json",
        "/docs/assets/swagger-ui-bundle.js",
        "/docs/assets/swagger-ui.css",
    ]:
        reply = httpx.get(f"{server.url}{path}")
        assert reply.status_code == 200, path
        policy = dict(d.strip().split(" ", 1) for d in reply.headers["content-security-policy"].split(";"))
        assert policy["frame-ancestors"] == "'none'" and policy["default-src"] == "'none'", path
        assert "unsafe-inline" not in reply.headers["content-security-policy"]
        assert reply.headers["x-content-type-options"] == "nosniff", path


@needs_browser
def test_swagger_ui_renders_every_operation_under_its_policy_with_no_violation(browser, server):
    from selenium.webdriver.support.ui import WebDriverWait

    operations = sum(
        len(methods) for methods in httpx.get(f"{server.url}/openapi.json").json()["paths"].values()
    )
    browser.get_log("browser")  # start with an empty console
    browser.get(f"{server.url}/docs")
    WebDriverWait(browser, 30).until(lambda d: len(d.find_elements("css selector", ".opblock")) == operations)
    browser.find_element("css selector", ".btn.authorize").click()
    WebDriverWait(browser, 10).until(lambda d: d.find_elements("css selector", ".modal-ux input"))
    console = [entry["message"] for entry in browser.get_log("browser")]
    assert [m for m in console if "Content Security Policy" in m] == [], console
