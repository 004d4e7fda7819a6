"""No code from data: the playground's copied requests (curl, Python, JavaScript; snippets.js, the
page's own builders) run in their languages on hostile file names and texts, and each hands the
client exactly the strings it was given, running nothing of them. The clients are stand-ins that
record what they were called with (a `curl` on PATH, a `typesafe_sdk` module, an npm package)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from semif_serve.playground import ASSETS

NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")

ORIGIN = "http://127.0.0.1:8032"
PAYLOAD = "touch PWNED; globalThis.process.exitCode = 7; import os; os.system('touch PWNED')"
HOSTILE_NAMES = [
    f"a\u2028{PAYLOAD}\u2028.png",
    f"a\u2029{PAYLOAD}#.png",
    f"a\n{PAYLOAD}\n.png",
    f"a\r\n{PAYLOAD}\r\n.png",
    "a';touch PWNED;echo '.png",
    'a";type=text/html;x="$(touch PWNED)`touch PWNED`.png',
    'a\\";touch PWNED;#.png',
    "*\u2028 touch PWNED \u2029*.png",
]  # a file name holds no "/"
HOSTILE_STATE = "JSON\n'''\"\"\"\u2028$(touch PWNED)`touch PWNED`\u2029</script>\\"
PLACEHOLDER = "<image:0123456789abcdef0123456789abcdef>"

BUILD = textwrap.dedent(
    """
    require(process.argv[1]);
    const [body, used, origin] = JSON.parse(process.argv[2]);
    const toJson = (value, indent) => JSON.stringify(value, null, indent);
    const snippets = globalThis.semifSnippets({
      toJson,
      entriesOf: Object.entries,
      partsOf: (images) =>
        Object.fromEntries(images.map((im, i) => [im.placeholder, { type: "image", part: `asset-${i}` }])),
      origin,
      path: "/v1/systemone",
      tokenVariable: "SEMIF_API_TOKEN",
    });
    const out = {};
    for (const kind of Object.keys(snippets)) out[kind] = snippets[kind](body, used);
    process.stdout.write(JSON.stringify(out));
    """
)

FAKE_CURL = textwrap.dedent(
    """\
    #!{python}
    import json, sys
    print(json.dumps({{"argv": sys.argv[1:], "stdin": sys.stdin.read()}}))
    """
)

FAKE_SDK = textwrap.dedent(
    """\
    import json


    class Image:
        def __init__(self, path):
            self.path = str(path)


    class _Result:
        def __init__(self, called):
            self.called = called

        def model_dump_json(self, indent=None):
            return json.dumps(self.called)


    class TypeSafeClient:
        def __init__(self, api_key, base_url):
            self.base_url = base_url

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def system_one(self, model, state, questions, assets=None):
            images = {k: v.path for k, v in (assets or {}).items()}
            return _Result({"model": model, "state": state, "questions": questions, "images": images,
                            "base_url": self.base_url})
    """
)

FAKE_NPM_SDK = textwrap.dedent(
    """\
    export class TypeSafeClient {
      constructor(options) { this.options = options; }
      async systemOne(request) { return { ...request, baseURL: this.options.baseURL }; }
    }
    """
)


def snippets_for(name: str) -> dict[str, str]:
    body = {
        "model": "jev-latest",
        "state": f"A photo: {PLACEHOLDER} {HOSTILE_STATE}",
        "questions": {"red": {"type": "noul", "question": HOSTILE_STATE}},
    }
    used = [{"placeholder": PLACEHOLDER, "name": name, "type": "image/png"}]
    args = json.dumps([body, used, ORIGIN])
    ran = subprocess.run(
        [NODE, "-e", BUILD, str(ASSETS / "snippets.js"), args], capture_output=True, text=True, timeout=60
    )
    assert ran.returncode == 0, ran.stderr
    return {**json.loads(ran.stdout), "body": body}


@pytest.fixture(scope="module")
def clients(tmp_path_factory) -> Path:
    """A folder with the stand-in clients: bin/curl, python/typesafe_sdk, node_modules/@typesafe-ai/sdk."""
    root = tmp_path_factory.mktemp("clients")
    (root / "bin").mkdir()
    curl = root / "bin" / "curl"
    curl.write_text(FAKE_CURL.format(python=sys.executable))
    curl.chmod(0o755)
    (root / "python" / "typesafe_sdk").mkdir(parents=True)
    (root / "python" / "typesafe_sdk" / "__init__.py").write_text(FAKE_SDK)
    npm = root / "node_modules" / "@typesafe-ai" / "sdk"
    npm.mkdir(parents=True)
    (npm / "package.json").write_text(
        json.dumps({"name": "@typesafe-ai/sdk", "type": "module", "main": "index.js"})
    )
    (npm / "index.js").write_text(FAKE_NPM_SDK)
    return root


def run(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    ran = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert not (cwd / "PWNED").exists(), "a hostile string ran as code"
    return ran


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=range(len(HOSTILE_NAMES)))
def test_each_copied_request_hands_its_client_the_hostile_file_name_and_runs_none_of_it(
    clients, name, tmp_path
):
    snippets = snippets_for(name)
    body = snippets["body"]
    env = {**os.environ, "SEMIF_API_TOKEN": "t", "PATH": f"{clients / 'bin'}{os.pathsep}{os.environ['PATH']}"}

    curl = json.loads(run(["bash", "-c", snippets["curl"]], tmp_path, env).stdout)
    escaped = name.replace("\\", "\\\\").replace('"', '\\"')
    assert f'asset-0=@"{escaped}";filename=asset-0;type=image/png' in curl["argv"]
    assert json.loads(curl["stdin"])["state"] == body["state"]

    python_env = {**env, "PYTHONPATH": str(clients / "python")}
    called = json.loads(run([sys.executable, "-c", snippets["python"]], tmp_path, python_env).stdout)
    assert called["images"] == {PLACEHOLDER: name}
    assert (called["state"], called["questions"]) == (body["state"], body["questions"])

    script = clients / f"snippet-{abs(hash(name))}.mjs"  # beside node_modules, so the import resolves
    script.write_text(snippets["javascript"], encoding="utf-8")
    answered = json.loads(run([NODE, str(script)], tmp_path, env).stdout)
    assert (answered["state"], answered["questions"]) == (body["state"], body["questions"])
    assert answered["baseURL"] == ORIGIN
