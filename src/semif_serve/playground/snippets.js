// The copied requests (curl, Python, JavaScript): every string they embed is escaped for the
// language it lands in, comments included, so no file name or text of a request runs as code.
// Loaded before playground.js (which calls `semifSnippets`), and by tests/doors/test_snippets.py in node.
"use strict";

(() => {
  // A string literal valid in JSON, Python and JavaScript, on one line: JSON's escapes, plus the two
  // line terminators (U+2028, U+2029) JSON leaves raw and a JavaScript comment would end at.
  const codeString = (text) => JSON.stringify(String(text)).replace(/\u2028/g, "\\u2028").replace(/\u2029/g, "\\u2029");
  // One shell word, whatever it holds: single-quoted, each ' closed, escaped and reopened.
  const shellQuoted = (text) => `'${String(text).replace(/'/g, "'\\''")}'`;
  // A file name in curl's -F syntax: double-quoted, its \ and " escaped, so `;` or `,` in it is no option.
  const curlFileName = (text) => `"${String(text).replace(/[\\"]/g, (c) => `\\${c}`)}"`;

  // The snippets over the page's own JSON writer (`toJson(value, indent)`), its object entries
  // (`entriesOf`), its multipart asset map (`partsOf`), this origin and path, and the token's variable.
  function semifSnippets({ toJson, entriesOf, partsOf, origin, path, tokenVariable }) {
    const pretty = (value) => toJson(value, 2);
    const indented = (text, spaces) => text.split("\n").join(`\n${" ".repeat(spaces)}`);
    function pyLiteral(value, depth) {
      const pad = "    ".repeat(depth + 1);
      const end = "    ".repeat(depth);
      if (value === null) return "None";
      if (value === true) return "True";
      if (value === false) return "False";
      if (typeof value === "number") return JSON.stringify(value);
      if (typeof value === "string") return codeString(value);
      if (Array.isArray(value)) {
        if (!value.length) return "[]";
        return `[\n${value.map((v) => pad + pyLiteral(v, depth + 1)).join(",\n")},\n${end}]`;
      }
      const entries = entriesOf(value);
      if (!entries.length) return "{}";
      return `{\n${entries.map(([k, v]) => `${pad}${codeString(k)}: ${pyLiteral(v, depth + 1)}`).join(",\n")},\n${end}}`;
    }
    // JSON as JavaScript source: JSON's own text with U+2028/U+2029 escaped (valid either way, one line).
    const jsLiteral = (value) => pretty(value).replace(/\u2028/g, "\\u2028").replace(/\u2029/g, "\\u2029");

    return {
      curl: (body, used) => {
        const start = [`curl -s ${shellQuoted(origin + path)} \\`, `  -H "Authorization: Bearer $${tokenVariable}" \\`];
        if (!used.length) {
          return [...start, `  -H "Content-Type: application/json" \\`, "  --data-binary @- <<'JSON'", pretty(body), "JSON"].join("\n");
        }
        return [
          ...start,
          `  -F "request=<-;type=application/json" \\`,
          ...used.map((image, i) => `  -F ${shellQuoted(`asset-${i}=@${curlFileName(image.name)};filename=asset-${i};type=${image.type}`)} \\`),
          "  <<'JSON'",
          pretty({ ...body, assets: partsOf(used) }),
          "JSON",
        ].join("\n");
      },
      python: (body, used) =>
        [
          "import os",
          ...(used.length ? ["from pathlib import Path"] : []),
          "",
          `from typesafe_sdk import ${used.length ? "Image, " : ""}TypeSafeClient`,
          "",
          `with TypeSafeClient(api_key=os.environ[${codeString(tokenVariable)}], base_url=${codeString(origin)}) as client:`,
          "    result = client.system_one(",
          `        model=${codeString(body.model)},`,
          `        state=${indented(pyLiteral(body.state, 0), 8)},`,
          `        questions=${indented(pyLiteral(body.questions, 0), 8)},`,
          ...(used.length
            ? ["        assets={", ...used.map((image) => `            ${codeString(image.placeholder)}: Image(Path(${codeString(image.name)})),`), "        },"]
            : []),
          "    )",
          "print(result.model_dump_json(indent=2))",
        ].join("\n"),
      javascript: (body, used) =>
        [
          ...used.map((image) => `// ${codeString(image.placeholder)} names the file ${codeString(image.name)}: attach it as an asset of this request`),
          'import { TypeSafeClient } from "@typesafe-ai/sdk";',
          "",
          "const client = new TypeSafeClient({",
          `  apiKey: process.env.${tokenVariable},`,
          `  baseURL: ${codeString(origin)},`,
          "});",
          "const response = await client.systemOne({",
          `  model: ${codeString(body.model)},`,
          `  state: ${indented(jsLiteral(body.state), 2)},`,
          `  questions: ${indented(jsLiteral(body.questions), 2)},`,
          "});",
          "console.log(JSON.stringify(response, null, 2));",
        ].join("\n"),
    };
  }

  globalThis.semifSnippets = semifSnippets;
})();
