// The playground: edit a System One request, send it to this service, draw its answers.
// The bearer token lives in `token` below and nowhere else: never stored, never in a URL, never logged.
"use strict";

(() => {
  const SYSTEMONE_PATH = "/v1/systemone";
  const MODELS_PATH = "/v1/models";
  const TEMPLATES_PATH = "/playground/templates.json";
  const DEFAULT_MODEL = "jev-latest";
  const TOKEN_PLACEHOLDER = "SEMIF_API_TOKEN"; // what copied snippets read instead of the typed token
  const ORDERINGS = [
    ["", "as written (the service's default unless x_orderings is set)"],
    ["none", "none: asked once, in the written order"],
    ["rotations", "rotations: every cyclic order"],
    ["shifts", "shifts: up to 4 cyclic orders"],
    ["reversal", "reversal: the written order and its reverse"],
    ["all", "all: every order (at most 4 options)"],
  ];
  const DIGITS = 4;

  let token = "";
  let templates = [];

  const byId = (id) => document.getElementById(id);
  const fmt = (x) => Number(x).toFixed(DIGITS);

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (key === "text") node.textContent = value;
      else if (key === "dataset") Object.assign(node.dataset, value);
      else node.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children) {
      if (child !== null && child !== undefined) node.append(child);
    }
    return node;
  }

  // A number the page shows; `field` names it for readers of the DOM (tests, scripts).
  function num(field, value, text) {
    return el("span", { class: "num", dataset: { field }, text: text === undefined ? fmt(value) : text });
  }

  // -- editing ---------------------------------------------------------------------------------

  function isObject(value) {
    return value !== null && typeof value === "object" && !Array.isArray(value);
  }

  function checkState(value) {
    return typeof value === "string" || typeof value === "object" && value !== null
      ? ""
      : "the state is a JSON string, object or array";
  }

  function checkQuestions(value) {
    if (!isObject(value)) return "the questions are a JSON object: question id → question";
    for (const [id, question] of Object.entries(value)) {
      if (!isObject(question)) return `question ${JSON.stringify(id)} is not an object`;
      if (typeof question.type !== "string") {
        return `question ${JSON.stringify(id)} needs a "type" ("noul", "choice" or "score")`;
      }
    }
    return "";
  }

  // Parse a JSON editor, showing what is wrong next to it; returns {ok, value}.
  function readEditor(id, check) {
    const area = byId(id);
    const error = byId(`${id}-error`);
    let message = "";
    let value;
    try {
      value = JSON.parse(area.value);
      message = check(value);
    } catch (exc) {
      message = `Invalid JSON: ${exc.message}`;
    }
    error.textContent = message;
    area.setAttribute("aria-invalid", message ? "true" : "false");
    return { ok: !message, value };
  }

  const EDITORS = {
    state: checkState,
    questions: checkQuestions,
    "questions-b": checkQuestions,
  };

  function pretty(value) {
    return JSON.stringify(value, null, 2);
  }

  // -- talking to the service -------------------------------------------------------------------

  function describeError(status, data, text) {
    const detail = data && data.detail;
    if (Array.isArray(detail)) {
      return {
        title: `${status} validation error`,
        items: detail.map((item) => {
          const where = (item.loc || []).slice(1).join(" › ") || "body";
          return `${where}: ${item.msg} (${item.type})`;
        }),
      };
    }
    if (isObject(detail)) return { title: `${status} ${detail.error_type}`, items: [detail.message] };
    if (data && isObject(data.error)) {
      const field = data.error.field ? ` (field ${data.error.field})` : "";
      return { title: `${status} ${data.error.code}`, items: [data.error.message + field] };
    }
    return { title: `${status} error`, items: [text ? text.slice(0, 500) : "the reply had no body"] };
  }

  async function call(method, path, body) {
    const headers = { Authorization: `Bearer ${token}` };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const started = performance.now();
    let response;
    try {
      response = await fetch(path, {
        method,
        headers,
        body: body === undefined ? undefined : JSON.stringify(body),
        cache: "no-store",
        credentials: "omit",
        referrerPolicy: "no-referrer",
      });
    } catch (exc) {
      return { ok: false, error: { title: "The service could not be reached", items: [String(exc.message)] } };
    }
    const text = await response.text();
    let data = null;
    try {
      data = JSON.parse(text);
    } catch (exc) {
      data = null;
    }
    const milliseconds = performance.now() - started;
    if (response.ok && data !== null) return { ok: true, data, milliseconds };
    return { ok: false, error: describeError(response.status, data, text) };
  }

  async function loadModels() {
    const status = byId("token-status");
    if (!token) {
      status.textContent = "";
      return;
    }
    const reply = await call("GET", MODELS_PATH);
    if (!reply.ok) {
      status.textContent = `${reply.error.title}: ${reply.error.items.join("; ")}`;
      status.className = "status bad";
      return;
    }
    const select = byId("model");
    const current = select.value;
    const names = reply.data.models.map((m) => m.name);
    const about = Object.fromEntries(reply.data.models.map((m) => [m.name, m.description]));
    const described = (m) => (m.x_alias_of && about[m.x_alias_of] ? `${m.description} ${about[m.x_alias_of]}` : m.description);
    select.replaceChildren(...reply.data.models.map((m) => el("option", { value: m.name, title: described(m), text: m.name })));
    select.value = names.includes(current) ? current : names.includes(DEFAULT_MODEL) ? DEFAULT_MODEL : names[0];
    describeModel();
    status.textContent = `Token accepted: ${names.length} model names.`;
    status.className = "status good";
  }

  function describeModel() {
    const option = byId("model").selectedOptions[0];
    if (option && option.title) byId("model-hint").textContent = option.title;
  }

  // -- the requests a run sends -------------------------------------------------------------------

  function withOrderings(questions, mode) {
    if (!mode) return questions;
    const out = {};
    for (const [id, question] of Object.entries(questions)) out[id] = { ...question, x_orderings: mode };
    return out;
  }

  function orderingsLabel(mode) {
    return mode ? `x_orderings: ${mode}` : "orderings as written";
  }

  // [{label, body}] for the run, or null when an editor holds an error (it says which).
  function plannedRequests() {
    const state = readEditor("state", checkState);
    const questions = readEditor("questions", checkQuestions);
    const compare = byId("compare").value;
    const second = compare === "phrasings" ? readEditor("questions-b", checkQuestions) : { ok: true };
    for (const [id, parsed] of [["state", state], ["questions", questions], ["questions-b", second]]) {
      if (!parsed.ok) {
        byId(id).focus();
        return null;
      }
    }
    const base = { model: byId("model").value, state: state.value };
    if (compare === "orderings") {
      return ["a", "b"].map((side) => {
        const mode = byId(`orderings-${side}`).value;
        return {
          label: `${side.toUpperCase()}: ${orderingsLabel(mode)}`,
          body: { ...base, questions: withOrderings(questions.value, mode) },
        };
      });
    }
    if (compare === "phrasings") {
      return [
        { label: "A: first phrasing", body: { ...base, questions: questions.value } },
        { label: "B: second phrasing", body: { ...base, questions: second.value } },
      ];
    }
    return [{ label: "Result", body: { ...base, questions: questions.value } }];
  }

  // -- drawing the answers --------------------------------------------------------------------------

  function bar(field, label, p, title, top) {
    const fill = el("span", { class: "fill" });
    fill.style.width = `${Math.max(0, Math.min(1, p)) * 100}%`;
    return el(
      "li",
      { class: top ? "bar-row top" : "bar-row", dataset: { option: label } },
      el("span", { class: "bar-label", title: title || label, text: label }),
      el("span", { class: "track", "aria-hidden": "true" }, fill),
      num(field, p),
    );
  }

  function scoreScale(score, levels) {
    const marker = el("span", { class: "marker" });
    marker.style.left = `${(score / (levels - 1)) * 100}%`;
    return el(
      "div",
      { class: "scale", "aria-hidden": "true" },
      el("span", { class: "scale-line" }, marker),
      el("span", { class: "scale-ends", text: `0 … ${levels - 1}` }),
    );
  }

  // Every ordering's reading beside the final probabilities, one row per option (caller's order).
  function readingsTable(answer, names, finals) {
    const readings = answer.x_semif.readings || [];
    const head = el(
      "tr",
      {},
      el("th", { scope: "col", text: "option" }),
      el("th", { scope: "col", text: "answer" }),
      ...readings.map((r, i) => el("th", { scope: "col", title: `asked in the order ${r.order.join(", ")}`, text: `order ${i + 1}` })),
    );
    const rows = names.map((name, k) =>
      el(
        "tr",
        {},
        el("th", { scope: "row", text: name }),
        el("td", {}, num(`final:${name}`, finals[k])),
        ...readings.map((r, i) => el("td", {}, num(`reading${i}:${name}`, r.probabilities[name]))),
      ),
    );
    return el(
      "div",
      { class: "table-wrap", tabindex: "0", role: "region", "aria-label": "Each ordering's probabilities" },
      el(
        "table",
        { class: "readings" },
        el("caption", { text: "Each ordering's probabilities" }),
        el("thead", {}, head),
        el("tbody", {}, ...rows),
      ),
    );
  }

  function answerCard(id, answer) {
    const semif = answer.x_semif || {};
    const card = el("article", { class: "card", dataset: { question: id } });
    card.append(el("h3", {}, el("span", { text: id }), el("span", { class: "badge", text: answer.type })));
    let names;
    let finals;
    const bars = el("ul", { class: "bars" });
    if (answer.type === "noul") {
      names = ["true", "false"];
      finals = [answer.noul, 1 - answer.noul];
      card.append(el("p", { class: "answer" }, "P(true) ", num("noul", answer.noul)));
      bars.append(bar("bar:true", "P(true)", answer.noul));
    } else if (answer.type === "choice") {
      names = Object.keys(answer.probabilities);
      finals = names.map((n) => answer.probabilities[n]);
      card.append(el("p", { class: "answer" }, "answer ", el("strong", { class: "num", dataset: { field: "choice" }, text: answer.choice })));
      names.forEach((n, k) => bars.append(bar(`bar:${n}`, n, finals[k], n, n === answer.choice)));
    } else if (answer.type !== "score") {
      // An answer type this page does not draw yet: shown as the service sent it.
      card.append(el("pre", { class: "raw", text: pretty(answer) }));
      return card;
    } else {
      names = Object.keys(answer.probabilities);
      finals = names.map((n) => answer.probabilities[n]);
      card.append(el("p", { class: "answer" }, "expected score ", num("score", answer.score), ` of 0 … ${names.length - 1}`));
      card.append(scoreScale(answer.score, names.length));
      names.forEach((n, k) => bars.append(bar(`bar:${n}`, `${n}: ${answer.legend[n]}`, finals[k], answer.legend[n])));
    }
    card.append(bars);
    const facts = el("dl", { class: "facts" });
    const fact = (term, ...value) => facts.append(el("dt", { text: term }), el("dd", {}, ...value));
    if (answer.confidence !== undefined) fact("confidence", num("confidence", answer.confidence));
    fact("orderings", num("orderings", 0, semif.orderings), " · ", num("rows", 0, String(semif.rows)), semif.rows === 1 ? " row" : " rows");
    fact("agreement", num("agreement", semif.agreement));
    fact("workload", num("workload", 0, semif.workload === null ? "none" : semif.workload));
    fact("temperature", num("temperature", 0, semif.temperature === null ? "none (1)" : String(semif.temperature)));
    card.append(facts, readingsTable(answer, names, finals));
    return card;
  }

  function footer(data, milliseconds) {
    const timing = data.x_timing || {};
    const seconds = timing.total_seconds;
    return el(
      "footer",
      { class: "footer" },
      el("span", {}, "tokens evaluated ", num("input_tokens", 0, String(data.usage.input_tokens))),
      el("span", {}, "prefill ", num("prefill", 0, timing.prefill || "unknown")),
      el("span", { title: "x_timing.total_seconds: tokenizing and forwards, without queueing" }, "engine time ", num("total_ms", 0, seconds === undefined ? "unknown" : `${(seconds * 1000).toFixed(1)} ms`)),
      el("span", {}, "round trip ", num("round_trip_ms", 0, `${milliseconds.toFixed(1)} ms`)),
      el("span", {}, "model ", num("model", 0, data.model)),
    );
  }

  function errorBox(error) {
    return el(
      "div",
      { class: "error-box", role: "alert" },
      el("p", { class: "error-title", text: error.title }),
      el("ul", {}, ...error.items.map((item) => el("li", { text: item }))),
    );
  }

  // -- copying the request ----------------------------------------------------------------------------

  function pyLiteral(value, depth) {
    const pad = "    ".repeat(depth + 1);
    const end = "    ".repeat(depth);
    if (value === null) return "None";
    if (value === true) return "True";
    if (value === false) return "False";
    if (typeof value === "number" || typeof value === "string") return JSON.stringify(value);
    if (Array.isArray(value)) {
      if (!value.length) return "[]";
      return `[\n${value.map((v) => pad + pyLiteral(v, depth + 1)).join(",\n")},\n${end}]`;
    }
    const entries = Object.entries(value);
    if (!entries.length) return "{}";
    return `{\n${entries.map(([k, v]) => `${pad}${JSON.stringify(k)}: ${pyLiteral(v, depth + 1)}`).join(",\n")},\n${end}}`;
  }

  function indented(text, spaces) {
    return text.split("\n").join(`\n${" ".repeat(spaces)}`);
  }

  const SNIPPETS = {
    curl: (body) =>
      [
        `curl -s ${window.location.origin}${SYSTEMONE_PATH} \\`,
        `  -H "Authorization: Bearer $${TOKEN_PLACEHOLDER}" \\`,
        `  -H "Content-Type: application/json" \\`,
        "  --data-binary @- <<'JSON'",
        pretty(body),
        "JSON",
      ].join("\n"),
    python: (body) =>
      [
        "import os",
        "",
        "from typesafe_sdk import TypeSafeClient",
        "",
        `with TypeSafeClient(api_key=os.environ["${TOKEN_PLACEHOLDER}"], base_url=${JSON.stringify(window.location.origin)}) as client:`,
        "    result = client.system_one(",
        `        model=${JSON.stringify(body.model)},`,
        `        state=${indented(pyLiteral(body.state, 0), 8)},`,
        `        questions=${indented(pyLiteral(body.questions, 0), 8)},`,
        "    )",
        "print(result.model_dump_json(indent=2))",
      ].join("\n"),
    javascript: (body) =>
      [
        'import { TypeSafeClient } from "@typesafe-ai/sdk";',
        "",
        "const client = new TypeSafeClient({",
        `  apiKey: process.env.${TOKEN_PLACEHOLDER},`,
        `  baseURL: ${JSON.stringify(window.location.origin)},`,
        "});",
        "const response = await client.systemOne({",
        `  model: ${JSON.stringify(body.model)},`,
        `  state: ${indented(pretty(body.state), 2)},`,
        `  questions: ${indented(pretty(body.questions), 2)},`,
        "});",
        "console.log(JSON.stringify(response, null, 2));",
      ].join("\n"),
  };
  const SNIPPET_NAMES = { curl: "curl", python: "Python (typesafe-sdk)", javascript: "JavaScript (@typesafe-ai/sdk)" };

  async function copyText(area, status) {
    area.hidden = false;
    try {
      await navigator.clipboard.writeText(area.value);
      status.textContent = "Copied to the clipboard.";
    } catch (exc) {
      area.focus();
      area.select();
      status.textContent = "The clipboard is not available here: the text is selected, copy it with Ctrl+C.";
    }
  }

  function copyPanel(body, column) {
    const area = el("textarea", { class: "snippet", readonly: true, rows: "12", spellcheck: "false", "aria-label": "Copied request", hidden: true });
    const status = el("p", { class: "status", role: "status", "aria-live": "polite" });
    const buttons = Object.keys(SNIPPETS).map((kind) => {
      const button = el("button", { type: "button", class: "copy", dataset: { kind }, text: `Copy as ${SNIPPET_NAMES[kind]}` });
      button.addEventListener("click", () => {
        area.value = SNIPPETS[kind](body);
        area.dataset.kind = kind;
        copyText(area, status);
      });
      return button;
    });
    return el("div", { class: "copy-panel", "aria-label": `Copy the request of ${column}` }, el("div", { class: "copy-buttons" }, ...buttons), status, area);
  }

  // -- a run -----------------------------------------------------------------------------------------

  async function run() {
    const planned = plannedRequests();
    const status = byId("run-status");
    if (planned === null) {
      status.textContent = "Fix the JSON first (the error is shown next to the field).";
      return;
    }
    if (!byId("token").value) {
      status.textContent = "Enter the bearer token first (semif-serve demo prints it).";
      byId("token").focus();
      return;
    }
    token = byId("token").value;
    const button = byId("run");
    const results = byId("results");
    button.disabled = true;
    results.setAttribute("aria-busy", "true");
    status.textContent = "Running…";
    try {
      results.replaceChildren(...(await columnsFor(planned)));
      results.className = `results cols-${planned.length}`;
      status.textContent = "Done.";
    } catch (exc) {
      results.replaceChildren(errorBox({ title: "The page could not draw the reply", items: [String(exc.message)] }));
      status.textContent = "Failed.";
    } finally {
      results.removeAttribute("aria-busy");
      button.disabled = false;
      document.body.dataset.runs = String(Number(document.body.dataset.runs || 0) + 1);
    }
  }

  async function columnsFor(planned) {
    const columns = [];
    for (const request of planned) {
      const reply = await call("POST", SYSTEMONE_PATH, request.body);
      const column = el("section", { class: "column", "aria-label": request.label }, el("h2", { text: request.label }));
      if (reply.ok) {
        for (const [id, answer] of Object.entries(reply.data.answers)) column.append(answerCard(id, answer));
        column.append(footer(reply.data, reply.milliseconds));
      } else {
        column.append(errorBox(reply.error));
      }
      column.append(copyPanel(request.body, request.label));
      columns.push(column);
    }
    return columns;
  }

  // -- setting up the page ---------------------------------------------------------------------------

  function showTemplate(template) {
    byId("state").value = pretty(template.state);
    byId("questions").value = pretty(template.questions);
    byId("questions-b").value = pretty(template.phrasing_b || template.questions);
    byId("template-description").textContent = template.description;
    for (const [id, check] of Object.entries(EDITORS)) readEditor(id, check);
  }

  function showCompare() {
    const mode = byId("compare").value;
    byId("questions-b-editor").hidden = mode !== "phrasings";
    byId("policies").hidden = mode !== "orderings";
  }

  async function start() {
    for (const side of ["a", "b"]) {
      const select = byId(`orderings-${side}`);
      select.replaceChildren(...ORDERINGS.map(([value, text]) => el("option", { value, text })));
      select.value = side === "a" ? "none" : "";
    }
    for (const [id, check] of Object.entries(EDITORS)) {
      byId(id).addEventListener("input", () => readEditor(id, check));
    }
    byId("token").addEventListener("input", (event) => {
      token = event.target.value;
    });
    byId("token").addEventListener("change", loadModels);
    byId("compare").addEventListener("change", showCompare);
    byId("model").addEventListener("change", describeModel);
    byId("run").addEventListener("click", run);
    document.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
        event.preventDefault();
        if (!byId("run").disabled) run();
      }
    });
    showCompare();
    const reply = await fetch(TEMPLATES_PATH, { cache: "no-store", credentials: "omit" });
    templates = (await reply.json()).templates;
    const picker = byId("template");
    picker.replaceChildren(...templates.map((t) => el("option", { value: t.id, text: t.name })));
    picker.addEventListener("change", () => showTemplate(templates.find((t) => t.id === picker.value)));
    showTemplate(templates[0]);
    document.body.dataset.ready = "true";
  }

  start();
})();
