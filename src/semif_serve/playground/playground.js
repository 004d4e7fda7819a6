// The playground: edit a System One request (with images), send it to this service, draw its answers;
// evaluate a labelled task file and fit its temperatures through POST /calibrate.
// The bearer token lives in `token` below and nowhere else: never stored, never in a URL, never logged.
// A loaded task file lives in `evalTasks` and goes nowhere but this service's own routes.
"use strict";

(() => {
  const SYSTEMONE_PATH = "/v1/systemone";
  const MODELS_PATH = "/v1/models";
  const TEMPLATES_PATH = "/playground/templates.json";
  const CALIBRATE_PATH = "/calibrate";
  const HEALTH_PATH = "/health";
  const MAX_IN_FLIGHT = 8;
  const THUMBNAIL_PIXELS = 96;
  const FIGURE_PIXELS = 640;
  const EDGE_BAR_SHARE = 0.25; // an edge's most likely position's bar reaches this share of the image
  const SVG = "http://www.w3.org/2000/svg";
  // The formats System One reads, by their first bytes (the service checks the bytes too).
  const SIGNATURES = [
    ["image/png", [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]],
    ["image/jpeg", [0xff, 0xd8, 0xff]],
  ];
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
  let models = []; // GET /v1/models entries, in the service's order
  let healthImages = null; // GET /health `images`: the limits before a token is typed
  let images = []; // {placeholder, name, type, bytes, width, height, bitmap}
  let lastEditor = "state";
  let evalTasks = null; // the parsed task file
  let evaluation = null; // the running evaluation: {controller, cancelled}

  const byId = (id) => document.getElementById(id);
  const fmt = (x) => Number(x).toFixed(DIGITS);

  function el(tag, attrs, ...children) {
    return fill(document.createElement(tag), attrs, children);
  }

  function svg(tag, attrs, ...children) {
    return fill(document.createElementNS(SVG, tag), attrs, children);
  }

  function fill(node, attrs, children) {
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

  // A JSON object as its entries in the written order: a JS object puts integer-like keys ("10", "2")
  // first and treats `__proto__` apart, and SemIf's answer depends on the options' order, so what the
  // page sends, copies and reads keeps the order of the text it came from.
  class Ordered {
    constructor(entries) {
      this.entries = [];
      for (const [key, value] of entries) this.set(key, value);
    }
    // A repeated key keeps its first place and takes the last value (as Python's json reads it).
    set(key, value) {
      const found = this.entries.find(([k]) => k === key);
      if (found) found[1] = value;
      else this.entries.push([key, value]);
    }
    get(key) {
      const found = this.entries.find(([k]) => k === key);
      return found ? found[1] : undefined;
    }
    has(key) {
      return this.entries.some(([k]) => k === key);
    }
    keys() {
      return this.entries.map(([k]) => k);
    }
  }

  const JSON_TOKEN = /\s*(?:("(?:[^"\\]|\\.)*")|(-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)|(true|false|null)|([{}[\],:]))/y;

  // JSON text as values whose objects are Ordered; throws JSON.parse's SyntaxError on text that is not JSON.
  function parseOrdered(text) {
    JSON.parse(text);
    let at = 0;
    const next = () => {
      JSON_TOKEN.lastIndex = at;
      const match = JSON_TOKEN.exec(text);
      at = JSON_TOKEN.lastIndex;
      return match;
    };
    const value = (t) => {
      if (t[1] !== undefined || t[3] !== undefined) return JSON.parse(t[1] ?? t[3]);
      if (t[2] !== undefined) return Number(t[2]);
      if (t[4] === "[") {
        const items = [];
        for (let u = next(); u[4] !== "]"; u = next()) {
          if (u[4] === ",") continue;
          items.push(value(u));
        }
        return items;
      }
      const object = new Ordered([]);
      for (let u = next(); u[4] !== "}"; u = next()) {
        if (u[4] === ",") continue;
        next(); // the colon
        object.set(JSON.parse(u[1]), value(next()));
      }
      return object;
    };
    return value(next());
  }

  // JSON text of a value whose objects may be Ordered or Maps, in their order (`indent` spaces a level).
  function toJson(value, indent = 0, depth = 0) {
    const pad = indent ? `\n${" ".repeat(indent * (depth + 1))}` : "";
    const end = indent ? `\n${" ".repeat(indent * depth)}` : "";
    if (Array.isArray(value)) {
      if (!value.length) return "[]";
      return `[${value.map((v) => pad + (v === undefined ? "null" : toJson(v, indent, depth + 1))).join(",")}${end}]`;
    }
    let entries = null;
    if (value instanceof Ordered) entries = value.entries;
    else if (value instanceof Map) entries = [...value.entries()];
    else if (isObject(value)) entries = Object.entries(value);
    if (entries === null) return JSON.stringify(value);
    const kept = entries.filter(([, v]) => v !== undefined);
    if (!kept.length) return "{}";
    return `{${kept.map(([k, v]) => `${pad}${JSON.stringify(String(k))}:${indent ? " " : ""}${toJson(v, indent, depth + 1)}`).join(",")}${end}}`;
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
    let tree;
    try {
      value = JSON.parse(area.value);
      message = check(value);
      if (!message) tree = parseOrdered(area.value);
    } catch (exc) {
      message = `Invalid JSON: ${exc.message}`;
    }
    error.textContent = message;
    area.setAttribute("aria-invalid", message ? "true" : "false");
    return { ok: !message, value, tree };
  }

  const EDITORS = {
    state: checkState,
    questions: checkQuestions,
    "questions-b": checkQuestions,
  };

  function pretty(value) {
    return toJson(value, 2);
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

  // One request to this service; `raw` is a body already encoded ({contentType, body}), `signal` aborts it.
  async function call(method, path, body, { raw, signal } = {}) {
    const headers = { Authorization: `Bearer ${token}` };
    let payload;
    if (raw) {
      headers["Content-Type"] = raw.contentType;
      payload = raw.body;
    } else if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      payload = toJson(body);
    }
    const started = performance.now();
    let response;
    let text;
    try {
      response = await fetch(path, {
        method,
        headers,
        body: payload,
        signal,
        cache: "no-store",
        credentials: "omit",
        referrerPolicy: "no-referrer",
      });
      text = await response.text(); // an abort may come while the body is read, too
    } catch (exc) {
      if (exc.name === "AbortError") return { ok: false, aborted: true, error: { title: "Cancelled", items: [] } };
      return { ok: false, error: { title: "The service could not be reached", items: [String(exc.message)] } };
    }
    let data = null;
    let tree = null;
    try {
      data = JSON.parse(text);
      tree = parseOrdered(text);
    } catch (exc) {
      data = null;
    }
    const milliseconds = performance.now() - started;
    if (response.ok && data !== null) return { ok: true, data, tree, milliseconds };
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
    models = reply.data.models;
    const names = models.map((m) => m.name);
    const about = new Map(models.map((m) => [m.name, m.description]));
    const described = (m) => (m.x_alias_of && about.has(m.x_alias_of) ? `${m.description} ${about.get(m.x_alias_of)}` : m.description);
    const defaults = { model: DEFAULT_MODEL, "model-a": DEFAULT_MODEL, "model-b": names.find((n) => n !== DEFAULT_MODEL) };
    for (const [id, fallback] of Object.entries(defaults)) {
      const select = byId(id);
      const kept = select.dataset.listed === "true" && names.includes(select.value) ? select.value : null;
      select.replaceChildren(...models.map((m) => el("option", { value: m.name, title: described(m), text: m.name })));
      select.value = kept || (names.includes(fallback) ? fallback : names[0]);
      select.dataset.listed = "true";
    }
    byId("model-table").replaceChildren(byId("model-table").querySelector("caption"), ...modelTable());
    describeModel();
    status.textContent = `Token accepted: ${names.length} model names.`;
    status.className = "status good";
  }

  // A listed name's own entry, with what its alias target reads where it is an alias.
  function modelEntry(name) {
    const entry = models.find((m) => m.name === name);
    if (!entry || !entry.x_alias_of) return entry;
    return { ...models.find((m) => m.name === entry.x_alias_of), ...entry };
  }

  const yesNo = (value) => (value === undefined || value === null ? "not listed" : value ? "yes" : "no");
  const listed = (value) => (value === undefined || value === null ? "not listed" : String(value));
  // What the table shows of each entry: names, aliases and what each reads (any further x_ field too).
  const MODEL_COLUMNS = [
    ["name", "name", (m) => m.name],
    ["alias of", "x_alias_of", (m) => m.x_alias_of || "none"],
    ["reads images", "x_reads_images", (m) => yesNo(m.x_reads_images)],
    ["method", "x_method", (m) => listed(m.x_method)],
    ["adapter", "x_adapter", (m) => listed(m.x_adapter)],
    ["options", "x_max_options", (m) => listed(m.x_max_options)],
    ["tokens", "x_max_input_tokens", (m) => listed(m.x_max_input_tokens)],
  ];

  function modelTable() {
    const known = new Set(MODEL_COLUMNS.map(([, key]) => key));
    const extra = [...new Set(models.flatMap((m) => Object.keys(m).filter((k) => k.startsWith("x_") && !known.has(k))))];
    const columns = [...MODEL_COLUMNS, ...extra.map((key) => [key, key, (m) => listed(m[key])])];
    const head = el("thead", {}, el("tr", {}, ...columns.map(([title]) => el("th", { scope: "col", text: title }))));
    const rows = models.map((m) => {
      const entry = modelEntry(m.name);
      return el(
        "tr",
        { dataset: { model: m.name } },
        ...columns.map(([, key, show], i) => el(i ? "td" : "th", i ? { dataset: { key } } : { scope: "row" }, show(i ? entry : m))),
      );
    });
    return [head, el("tbody", {}, ...rows)];
  }

  function describeModel() {
    const option = byId("model").selectedOptions[0];
    if (option && option.title) byId("model-hint").textContent = option.title;
    const entry = modelEntry(byId("model").value);
    const blind = entry && entry.x_reads_images === false;
    byId("image-warning").textContent = blind ? `${entry.name} reads no images: the service refuses a request with one, and says why.` : "";
  }

  // -- the requests a run sends -------------------------------------------------------------------

  function withOrderings(questions, mode) {
    if (!mode) return questions;
    return new Ordered(questions.entries.map(([id, question]) => [id, new Ordered([...question.entries, ["x_orderings", mode]])]));
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
    const base = { model: byId("model").value, state: state.tree };
    if (compare === "orderings") {
      return ["a", "b"].map((side) => {
        const mode = byId(`orderings-${side}`).value;
        return {
          label: `${side.toUpperCase()}: ${orderingsLabel(mode)}`,
          body: { ...base, questions: withOrderings(questions.tree, mode) },
        };
      });
    }
    if (compare === "models") {
      return ["a", "b"].map((side) => {
        const model = byId(`model-${side}`).value;
        return { label: `${side.toUpperCase()}: ${model}`, body: { ...base, model, questions: questions.tree } };
      });
    }
    if (compare === "phrasings") {
      return [
        { label: "A: first phrasing", body: { ...base, questions: questions.tree } },
        { label: "B: second phrasing", body: { ...base, questions: second.tree } },
      ];
    }
    return [{ label: "Result", body: { ...base, questions: questions.tree } }];
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

  // `tree`: the answer as Ordered (its options in the request's order, as the service writes them).
  function answerCard(id, answer, tree, image) {
    const semif = answer.x_semif || {};
    const card = el("article", { class: "card", dataset: { question: id } });
    card.append(el("h3", {}, el("span", { text: id }), el("span", { class: "badge", text: answer.type })));
    if (answer.type === "box") return boxCard(card, answer, image);
    let names;
    let finals;
    const bars = el("ul", { class: "bars" });
    if (answer.type === "noul") {
      names = ["true", "false"];
      finals = [answer.noul, 1 - answer.noul];
      card.append(el("p", { class: "answer" }, "P(true) ", num("noul", answer.noul)));
      bars.append(bar("bar:true", "P(true)", answer.noul));
    } else if (answer.type === "choice") {
      names = tree.get("probabilities").keys();
      finals = names.map((n) => answer.probabilities[n]);
      card.append(el("p", { class: "answer" }, "answer ", el("strong", { class: "num", dataset: { field: "choice" }, text: answer.choice })));
      names.forEach((n, k) => bars.append(bar(`bar:${n}`, n, finals[k], n, n === answer.choice)));
    } else if (answer.type !== "score") {
      // An answer type this page does not draw yet: shown as the service sent it.
      card.append(el("pre", { class: "raw", text: pretty(tree) }));
      return card;
    } else {
      names = tree.get("probabilities").keys();
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

  // -- box answers, drawn on their image ---------------------------------------------------------

  const EDGES = ["top", "bottom", "left", "right"];

  // A canvas showing `image` at most `pixels` wide (drawn from its decoded bitmap: no image URL).
  function imageCanvas(image, pixels, label) {
    const scale = Math.min(1, pixels / image.width);
    const canvas = el("canvas", {
      width: Math.max(1, Math.round(image.width * scale)),
      height: Math.max(1, Math.round(image.height * scale)),
      role: "img",
      "aria-label": label,
    });
    canvas.getContext("2d").drawImage(image.bitmap, 0, 0, canvas.width, canvas.height);
    return canvas;
  }

  // The box over the image in its pixels, and each edge's distribution (after the pair rule) along its side:
  // top and bottom as bars from the left side at their heights, left and right from the top at their widths.
  function boxOverlay(answer, width, height) {
    const box = answer.box;
    const overlay = svg("svg", {
      class: "box-overlay",
      viewBox: `0 0 ${width} ${height}`,
      preserveAspectRatio: "none",
      "aria-hidden": "true",
    });
    for (const edge of EDGES) {
      const along = edge === "top" || edge === "bottom" ? height : width;
      const across = edge === "top" || edge === "bottom" ? width : height;
      const step = along / 20;
      const ordered = answer.x_edges[edge].ordered;
      const peak = Math.max(...Object.values(ordered)) || 1;
      for (const [position, p] of Object.entries(ordered)) {
        const at = Number(position) * along;
        const reach = (p / peak) * across * EDGE_BAR_SHARE;
        const vertical = edge === "left" || edge === "right";
        overlay.append(
          svg("rect", {
            class: `edge edge-${edge}`,
            dataset: { edge, position, p: String(p) },
            x: vertical ? at - step / 4 : 0,
            y: vertical ? 0 : at - step / 4,
            width: vertical ? step / 2 : reach,
            height: vertical ? reach : step / 2,
          }),
        );
      }
    }
    overlay.append(
      svg("rect", {
        class: "box",
        dataset: { field: "box" },
        x: box.left * width,
        y: box.top * height,
        width: (box.right - box.left) * width,
        height: (box.bottom - box.top) * height,
        "vector-effect": "non-scaling-stroke",
      }),
    );
    return overlay;
  }

  function boxCard(card, answer, image) {
    const box = answer.box;
    const facts = el("dl", { class: "facts" });
    for (const edge of EDGES) facts.append(el("dt", { text: edge }), el("dd", {}, num(`box:${edge}`, box[edge])));
    facts.append(
      el("dt", { text: "confidence" }),
      el("dd", {}, answer.confidence === null ? num("confidence", 0, "none") : num("confidence", answer.confidence)),
    );
    const width = image ? image.width : 1;
    const height = image ? image.height : 1;
    const stage = el("div", { class: "box-stage" });
    if (image) stage.append(imageCanvas(image, FIGURE_PIXELS, `${image.name}, with the box drawn on it`));
    stage.append(boxOverlay(answer, width, height));
    const figure = el(
      "figure",
      { class: "box-figure" },
      stage,
      el("figcaption", { class: "hint", text: "The box (fractions of the height from the top, of the width from the left); the bars show each edge's distribution along its side." }),
    );
    card.append(el("div", { class: "box-layout" }, figure, facts));
    return card;
  }

  // -- images ---------------------------------------------------------------------------------------

  function randomHex(bytes) {
    return [...crypto.getRandomValues(new Uint8Array(bytes))].map((b) => b.toString(16).padStart(2, "0")).join("");
  }

  function sniff(bytes) {
    const found = SIGNATURES.find(([, signature]) => signature.every((b, i) => bytes[i] === b));
    return found ? found[0] : null;
  }

  // The selected model's image limits from /v1/models, else the service's from /health.
  function imageLimits() {
    const entry = modelEntry(byId("model").value);
    if (entry && entry.x_max_images) {
      return { max_images: entry.x_max_images, max_image_bytes: entry.x_max_image_bytes, max_image_pixels: entry.x_max_image_pixels };
    }
    return healthImages;
  }

  async function addImage(file) {
    const bytes = new Uint8Array(await file.arrayBuffer());
    const type = sniff(bytes);
    const limits = imageLimits();
    if (!type) throw new Error(`${file.name} is not a PNG or JPEG image (by its first bytes)`);
    if (limits && images.length >= limits.max_images) {
      throw new Error(`${file.name}: a request carries at most ${limits.max_images} images (max_images)`);
    }
    if (limits && bytes.length > limits.max_image_bytes) {
      throw new Error(`${file.name} is ${bytes.length} bytes, over the service's ${limits.max_image_bytes} per image (max_image_bytes)`);
    }
    let bitmap;
    try {
      bitmap = await createImageBitmap(new Blob([bytes], { type }));
    } catch (exc) {
      throw new Error(`${file.name} could not be decoded as ${type}`);
    }
    if (limits && bitmap.width * bitmap.height > limits.max_image_pixels) {
      throw new Error(`${file.name} is ${bitmap.width}x${bitmap.height} pixels, over the service's ${limits.max_image_pixels} (max_image_pixels)`);
    }
    const image = { placeholder: `<image:${randomHex(16)}>`, name: file.name, type, bytes, width: bitmap.width, height: bitmap.height, bitmap };
    images.push(image);
    insertAtCursor(lastEditor, image.placeholder);
    showImages();
  }

  async function addImages(files) {
    const error = byId("image-error");
    error.textContent = "";
    for (const file of files) {
      try {
        await addImage(file);
      } catch (exc) {
        error.textContent = exc.message;
      }
    }
  }

  function insertAtCursor(id, text) {
    const area = byId(id);
    area.setRangeText(text, area.selectionStart, area.selectionEnd, "end");
    area.dispatchEvent(new Event("input"));
  }

  function showImages() {
    byId("image-list").replaceChildren(
      ...images.map((image) => {
        const insert = el("button", { type: "button", class: "copy", text: "Insert at cursor", "aria-label": `Insert ${image.placeholder} at the cursor` });
        insert.addEventListener("click", () => insertAtCursor(lastEditor, image.placeholder));
        const remove = el("button", { type: "button", class: "copy", text: "Remove", "aria-label": `Remove ${image.name}` });
        remove.addEventListener("click", () => {
          images = images.filter((i) => i !== image);
          showImages();
        });
        return el(
          "li",
          { class: "image-item", dataset: { placeholder: image.placeholder } },
          imageCanvas(image, THUMBNAIL_PIXELS, `thumbnail of ${image.name}`),
          el("span", {}, el("code", { text: image.placeholder }), el("span", { class: "hint", text: ` ${image.name}, ${image.width}x${image.height}, ${image.bytes.length} bytes` })),
          el("span", { class: "copy-buttons" }, insert, remove),
        );
      }),
    );
  }

  // The images a body's text names, in the order they were added (the SDK sends only those).
  function referencedImages(body) {
    const text = toJson(body);
    return images.filter((image) => text.includes(image.placeholder));
  }

  // The `assets` entries of a multipart body: each image named by its part, `asset-<i>`.
  function partsOf(used) {
    return new Ordered(used.map((image, i) => [image.placeholder, { type: "image", part: `asset-${i}` }]));
  }

  // typesafe-sdk's multipart body: the JSON as part `request`, then each image as part `asset-<i>`.
  function multipart(body, used) {
    const boundary = randomHex(16);
    const assets = partsOf(used);
    const head = (name, type, filename) =>
      `--${boundary}\r\nContent-Disposition: form-data; name="${name}"${filename ? `; filename="${filename}"` : ""}\r\nContent-Type: ${type}\r\n\r\n`;
    const chunks = [head("request", "application/json"), toJson({ ...body, assets }), "\r\n"];
    used.forEach((image, i) => chunks.push(head(`asset-${i}`, image.type, `asset-${i}`), image.bytes, "\r\n"));
    chunks.push(`--${boundary}--\r\n`);
    return { contentType: `multipart/form-data; boundary=${boundary}`, body: new Blob(chunks) };
  }

  // POST /v1/systemone: JSON, or multipart when the body names an image.
  function askSystemOne(body, signal) {
    const used = referencedImages(body);
    const raw = used.length ? multipart(body, used) : undefined;
    return call("POST", SYSTEMONE_PATH, body, { raw, signal });
  }

  // The image a box question is about: the first named in the question, else in the state.
  function imageOf(question, body, used) {
    const named = (value) => used.find((image) => toJson(value).includes(image.placeholder));
    return named(question) || named(body.state) || used[0];
  }

  // -- copying the request ----------------------------------------------------------------------------

  // The copied requests (snippets.js): every string they embed escaped for its language.
  const SNIPPETS = globalThis.semifSnippets({
    toJson,
    entriesOf: (value) => (value instanceof Ordered ? value.entries : Object.entries(value)),
    partsOf,
    origin: window.location.origin,
    path: SYSTEMONE_PATH,
    tokenVariable: TOKEN_PLACEHOLDER,
  });
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
        area.value = SNIPPETS[kind](body, referencedImages(body));
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
      const reply = await askSystemOne(request.body);
      const used = referencedImages(request.body);
      const column = el("section", { class: "column", "aria-label": request.label }, el("h2", { text: request.label }));
      if (reply.ok) {
        for (const [id, tree] of reply.tree.get("answers").entries) {
          column.append(answerCard(id, JSON.parse(toJson(tree)), tree, imageOf(request.body.questions.get(id), request.body, used)));
        }
        column.append(footer(reply.data, reply.milliseconds));
      } else {
        column.append(errorBox(reply.error));
      }
      column.append(copyPanel(request.body, request.label));
      columns.push(column);
    }
    return columns;
  }

  // -- evaluating and calibrating a labelled workload ----------------------------------------------

  // A label as the option name it picks in `x_semif.option_logits` (choice: a name; score: a level; noul: a bool).
  function labelKey(type, value) {
    if (type === "noul" && typeof value === "boolean") return value ? "true" : "false";
    if (type === "score" && Number.isInteger(value)) return String(value);
    if (type === "choice" && typeof value === "string") return value;
    return null;
  }

  // A task's parts are Ordered (the file's text, in its order) and Maps: question ids, option ids and
  // workload names are the file's strings, `constructor` and `__proto__` as any other.
  // levbench's task file: {questions, items: [{state, labels, group_id?}]}; one request per item.
  function levbenchTasks(data) {
    const defined = data.get("questions");
    const items = data.get("items");
    if (!(defined instanceof Ordered) || !Array.isArray(items)) throw new Error("a task file has `questions` (an object) and `items` (a list)");
    for (const [id, question] of defined.entries) {
      if (!(question instanceof Ordered) || !["noul", "choice", "score"].includes(question.get("type"))) {
        throw new Error(`question ${JSON.stringify(id)}: only noul, choice and score questions can be evaluated from labels`);
      }
    }
    return items.map((item, i) => {
      if (!(item instanceof Ordered) || !(item.get("labels") instanceof Ordered) || !item.has("state")) throw new Error(`items[${i}] needs a state and labels`);
      const labels = new Map();
      for (const [id, value] of item.get("labels").entries) {
        if (!defined.has(id)) throw new Error(`items[${i}] labels question ${JSON.stringify(id)}, which the file does not define`);
        const type = defined.get(id).get("type");
        const key = labelKey(type, value);
        if (key === null) throw new Error(`items[${i}].labels.${id}: ${JSON.stringify(value)} is not a ${type} answer`);
        labels.set(id, key);
      }
      const questions = new Ordered([...labels.keys()].map((id) => [id, defined.get(id)]));
      return { where: `items[${i}]`, state: item.get("state"), questions, labels, group: item.has("group_id") ? item.get("group_id") : i };
    });
  }

  // The project's fixture rows (JSONL): each row one choice question, all under the workload `name`.
  function fixtureTasks(text, name) {
    return text.split("\n").flatMap((line, i) => {
      if (!line.trim()) return [];
      let row;
      try {
        row = parseOrdered(line);
      } catch (exc) {
        throw new Error(`line ${i + 1}: not valid JSON: ${exc.message}`);
      }
      const options = row instanceof Ordered ? row.get("options") : undefined;
      const label = row instanceof Ordered ? row.get("label") : undefined;
      if (!Array.isArray(options) || !options.every((o) => o instanceof Ordered) || !Number.isInteger(label) || !options[label]) {
        throw new Error(`line ${i + 1}: a fixture row has options and a label that indexes them`);
      }
      // The criteria in the row's option order, as `semif-serve calibrate`'s rows list them.
      const criteria = new Ordered(options.map((o) => [String(o.get("id")), o.get("description")]));
      const question = new Ordered([["type", "choice"], ["instructions", row.get("question")], ["criteria", criteria]]);
      return [
        {
          where: `line ${i + 1}`,
          state: row.get("state"),
          questions: new Ordered([[name, question]]),
          labels: new Map([[name, String(options[label].get("id"))]]),
          group: row.has("group_id") ? row.get("group_id") : row.get("id"),
        },
      ];
    });
  }

  function parseTaskFile(fileName, text) {
    const stem = fileName.replace(/\.[^.]*$/, "") || "workload";
    const trimmed = text.trimStart();
    if (trimmed.startsWith("{")) {
      try {
        const data = parseOrdered(text);
        if (data instanceof Ordered && data.has("items")) return { format: "levbench", tasks: levbenchTasks(data) };
      } catch (exc) {
        if (!(exc instanceof SyntaxError)) throw exc;
      }
    }
    return { format: "fixture rows", tasks: fixtureTasks(text, stem) };
  }

  async function loadTaskFile() {
    const input = byId("eval-file");
    const status = byId("eval-file-status");
    evalTasks = null;
    byId("eval-run").disabled = true;
    const file = input.files[0];
    if (!file) return;
    try {
      const parsed = parseTaskFile(file.name, await file.text());
      if (!parsed.tasks.length) throw new Error("the file has no items");
      evalTasks = parsed.tasks;
      const questions = new Set(evalTasks.flatMap((t) => [...t.labels.keys()]));
      status.textContent = `${file.name}: ${parsed.format}, ${evalTasks.length} requests, questions ${[...questions].join(", ")}.`;
      status.className = "status good";
      byId("eval-run").disabled = false;
    } catch (exc) {
      status.textContent = `${file.name}: ${exc.message}`;
      status.className = "status bad";
    }
  }

  // Every task through POST /v1/systemone, at most `inFlight` at a time; each question's single reads.
  async function readAll(tasks, model, inFlight, run, progress) {
    const reads = new Map(); // question id → its rows
    let next = 0;
    let active = 0;
    let failure = null;
    const noteActive = (change) => {
      active += change;
      document.body.dataset.evalMaxInFlight = String(Math.max(active, Number(document.body.dataset.evalMaxInFlight || 0)));
    };
    async function worker() {
      while (!run.cancelled && failure === null && next < tasks.length) {
        const task = tasks[next++];
        document.body.dataset.evalSent = String(Number(document.body.dataset.evalSent || 0) + 1);
        noteActive(1);
        const reply = await askSystemOne({ model, state: task.state, questions: task.questions }, run.controller.signal);
        noteActive(-1);
        if (reply.aborted) return;
        if (!reply.ok) {
          failure = { title: `${task.where}: ${reply.error.title}`, items: reply.error.items };
          run.controller.abort();
          return;
        }
        const answers = reply.tree.get("answers");
        for (const [id, key] of task.labels) {
          const logits = answers.get(id).get("x_semif").get("option_logits");
          const names = logits.keys();
          if (!names.includes(key)) {
            failure = { title: `${task.where}: label ${JSON.stringify(key)} of ${id} is not an option`, items: [`options: ${names.join(", ")}`] };
            return;
          }
          if (!reads.has(id)) reads.set(id, []);
          reads.get(id).push({ logits: names.map((n) => logits.get(n)), label: names.indexOf(key), group: task.group });
        }
        progress();
      }
    }
    await Promise.all(Array.from({ length: inFlight }, worker));
    return { reads, failure };
  }

  // One bin set as bars over the diagonal: x is the bin's confidence range, the bar its accuracy.
  function reliabilityDiagram(id, report) {
    const chart = svg("svg", { class: "reliability", viewBox: "-12 -4 116 120", role: "img", "aria-label": `Reliability of ${id}: accuracy per confidence bin, at T=1 and at the fitted T` });
    chart.append(
      svg("rect", { class: "frame", x: 0, y: 0, width: 100, height: 100 }),
      svg("line", { class: "diagonal", x1: 0, y1: 100, x2: 100, y2: 0 }),
    );
    for (const [side, bins] of [["before", report.bins_before], ["after", report.bins_after]]) {
      for (const bin of bins) {
        if (!bin.count) continue;
        const half = side === "before" ? 0 : 5;
        chart.append(
          svg(
            "rect",
            {
              class: `bin bin-${side}`,
              dataset: { side, lower: String(bin.lower), count: String(bin.count), accuracy: String(bin.accuracy), confidence: String(bin.confidence) },
              x: bin.lower * 100 + half,
              y: 100 - bin.accuracy * 100,
              width: 5,
              height: bin.accuracy * 100,
            },
            svg("title", { text: `${side === "before" ? "T=1" : "fitted T"}: ${bin.count} rows, confidence ${fmt(bin.confidence)}, accuracy ${fmt(bin.accuracy)}` }),
          ),
        );
      }
    }
    chart.append(
      svg("text", { class: "axis", x: 50, y: 112, "text-anchor": "middle", text: "confidence" }),
      svg("text", { class: "axis", x: -4, y: 100, "text-anchor": "end", text: "0" }),
      svg("text", { class: "axis", x: -4, y: 4, "text-anchor": "end", text: "1" }),
    );
    return el("figure", { class: "reliability-figure" }, chart, el("figcaption", { class: "hint", text: "Accuracy per confidence bin: light at T=1, dark at the fitted T; the diagonal is perfect calibration." }));
  }

  function reportCard(id, report) {
    const row = (name, field, before, after) =>
      el("tr", {}, el("th", { scope: "row", text: name }), el("td", {}, before === null ? "" : num(`${field}_before`, before)), el("td", {}, num(`${field}_after`, after)));
    const table = el(
      "table",
      { class: "readings" },
      el("caption", { text: `${report.n} rows, ${report.groups} groups` }),
      el("thead", {}, el("tr", {}, el("th", { scope: "col", text: "" }), el("th", { scope: "col", text: "T = 1" }), el("th", { scope: "col", text: "fitted T" }))),
      el(
        "tbody",
        {},
        row("accuracy", "accuracy", report.accuracy, report.accuracy),
        row("log-loss", "nll", report.nll_before, report.nll_after),
        row("Brier", "brier", report.brier_before, report.brier_after),
        row("ECE (in-sample)", "ece", report.ece_before, report.ece_after),
        el("tr", {}, el("th", { scope: "row", text: "ECE (out-of-fold)" }), el("td", {}), el("td", {}, num("ece_out_of_fold", report.ece_out_of_fold, report.ece_out_of_fold === null ? "n/a" : undefined))),
      ),
    );
    return el(
      "article",
      { class: "card", dataset: { question: id } },
      el("h3", {}, el("span", { text: id }), el("span", { class: "badge", text: `workload ${report.workload}` })),
      el("p", { class: "answer" }, "fitted T ", num("temperature", report.temperature)),
      el("div", { class: "table-wrap" }, table),
      reliabilityDiagram(id, report),
      report.warnings.length ? el("ul", { class: "warnings" }, ...report.warnings.map((w) => el("li", { text: w }))) : null,
    );
  }

  function entryPanel(entries) {
    const area = el("textarea", { class: "snippet", readonly: true, rows: "6", spellcheck: "false", "aria-label": "calibration.json entries", hidden: true });
    area.value = pretty(entries);
    const status = el("p", { class: "status", role: "status", "aria-live": "polite" });
    const button = el("button", { type: "button", class: "copy", id: "eval-copy", text: "Copy the calibration.json entries" });
    button.addEventListener("click", () => copyText(area, status));
    return el("div", { class: "copy-panel" }, button, status, area);
  }

  async function evaluate() {
    const tasks = evalTasks;
    const status = byId("eval-status");
    const results = byId("eval-results");
    if (!byId("token").value) {
      status.textContent = "Enter the bearer token first (semif-serve demo prints it).";
      byId("token").focus();
      return;
    }
    token = byId("token").value;
    const inFlight = Math.max(1, Math.min(MAX_IN_FLIGHT, Math.floor(Number(byId("eval-flight").value)) || 1));
    const run = { controller: new AbortController(), cancelled: false };
    evaluation = run;
    const progress = byId("eval-progress");
    progress.max = tasks.length;
    progress.value = 0;
    document.body.dataset.evalMaxInFlight = "0";
    byId("eval-run").disabled = true;
    byId("eval-cancel").disabled = false;
    results.replaceChildren();
    status.textContent = `0 of ${tasks.length} answered…`;
    const step = () => {
      progress.value += 1;
      status.textContent = `${progress.value} of ${tasks.length} answered…`;
    };
    try {
      const { reads, failure } = await readAll(tasks, byId("model").value, inFlight, run, step);
      if (run.cancelled) {
        status.textContent = `Cancelled: ${progress.value} of ${tasks.length} answered; nothing more is sent.`;
        return;
      }
      if (failure) {
        results.replaceChildren(errorBox(failure));
        status.textContent = "Failed.";
        return;
      }
      status.textContent = "Fitting each question's temperature…";
      const entries = new Map(); // workload → its temperature
      const cards = [];
      for (const [id, rows] of reads) {
        const reply = await call("POST", CALIBRATE_PATH, { workload: id, rows });
        if (!reply.ok) {
          cards.push(errorBox({ title: `${id}: ${reply.error.title}`, items: reply.error.items }));
          continue;
        }
        for (const [workload, temperature] of reply.tree.get("entry").entries) entries.set(workload, temperature);
        cards.push(reportCard(id, reply.data));
      }
      results.replaceChildren(...cards, entryPanel(entries));
      status.textContent = `Done: ${tasks.length} requests, ${reads.size} questions fitted.`;
    } catch (exc) {
      results.replaceChildren(errorBox({ title: "The page could not finish the evaluation", items: [String(exc.message)] }));
      status.textContent = "Failed.";
    } finally {
      evaluation = null;
      byId("eval-run").disabled = false;
      byId("eval-cancel").disabled = true;
      document.body.dataset.evaluations = String(Number(document.body.dataset.evaluations || 0) + 1);
    }
  }

  function cancelEvaluation() {
    if (!evaluation) return;
    evaluation.cancelled = true;
    evaluation.controller.abort();
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
    byId("models-compare").hidden = mode !== "models";
  }

  async function loadHealth() {
    try {
      const reply = await fetch(HEALTH_PATH, { cache: "no-store", credentials: "omit" });
      healthImages = (await reply.json()).images || null;
    } catch (exc) {
      healthImages = null; // the service checks the limits anyway
    }
  }

  function acceptImages() {
    const dropped = (event) => [...(event.dataTransfer ? event.dataTransfer.files : [])];
    const zone = byId("image-drop");
    for (const target of [zone, ...Object.keys(EDITORS).map(byId)]) {
      target.addEventListener("dragover", (event) => {
        if (event.dataTransfer && [...event.dataTransfer.types].includes("Files")) event.preventDefault();
      });
      target.addEventListener("drop", (event) => {
        const files = dropped(event);
        if (!files.length) return;
        event.preventDefault();
        if (target !== zone) lastEditor = target.id;
        addImages(files);
      });
    }
    for (const id of Object.keys(EDITORS)) {
      byId(id).addEventListener("focus", () => {
        lastEditor = id;
      });
      byId(id).addEventListener("paste", (event) => {
        const files = [...event.clipboardData.files].filter((f) => f.type.startsWith("image/"));
        if (!files.length) return;
        event.preventDefault();
        lastEditor = id;
        addImages(files);
      });
    }
    byId("image-file").addEventListener("change", async (event) => {
      await addImages([...event.target.files]);
      event.target.value = "";
      document.body.dataset.images = String(images.length);
    });
  }

  async function start() {
    for (const id of ["model-a", "model-b"]) byId(id).replaceChildren(el("option", { value: DEFAULT_MODEL, text: DEFAULT_MODEL }));
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
    byId("eval-file").addEventListener("change", loadTaskFile);
    byId("eval-run").addEventListener("click", evaluate);
    byId("eval-cancel").addEventListener("click", cancelEvaluation);
    acceptImages();
    document.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
        event.preventDefault();
        if (!byId("run").disabled) run();
      }
    });
    showCompare();
    await loadHealth();
    const reply = await fetch(TEMPLATES_PATH, { cache: "no-store", credentials: "omit" });
    const listed = parseOrdered(await reply.text()).get("templates");
    templates = listed.map((t) => ({
      id: t.get("id"),
      name: t.get("name"),
      description: t.get("description"),
      state: t.get("state"),
      questions: t.get("questions"),
      phrasing_b: t.get("phrasing_b"),
    }));
    const picker = byId("template");
    picker.replaceChildren(...templates.map((t) => el("option", { value: t.id, text: t.name })));
    picker.addEventListener("change", () => showTemplate(templates.find((t) => t.id === picker.value)));
    showTemplate(templates[0]);
    document.body.dataset.ready = "true";
  }

  start();
})();
