"""The README stays true: every command block runs here, or says why it cannot.

A block preceded by `<!-- not run: reason -->` needs what this machine lacks (a GPU, the
PyTorch index, a 9 GB download); every other block is run by the test named in RUNS. Commands
written `uv run X` run as `X` in this test's own environment (the project venv uv made).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from semif_serve.service.settings import Settings, env_name
from semif_serve.tools.env_template import DEPLOYMENT_VALUES

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCK = re.compile(r"(?:<!--\s*not run:\s*(?P<reason>[^>]*?)\s*-->\s*\n)?```bash\n(?P<body>.*?)```", re.S)
DEMO_TOKEN = "demo-token"
PINNED_REVISION = DEPLOYMENT_VALUES["model_revision"]
REAL_MODEL_DIR = f"models/models--Qwen--Qwen3.5-4B/snapshots/{PINNED_REVISION}"
VENV_BIN = str(Path(sys.executable).parent)


@dataclass(frozen=True)
class Block:
    """One ```bash block of the README and, when it is marked, why it is not run."""

    body: str
    reason: str | None

    @property
    def first_line(self) -> str:
        return self.body.splitlines()[0]


def blocks() -> list[Block]:
    return [Block(m["body"], m["reason"]) for m in BLOCK.finditer(README)]


# The test that runs each unmarked block, keyed by the start of the block's first line.
RUNS = {
    "uv run semif-serve demo ": "test_the_start_here_block_serves_the_demo_and_is_what_ci_runs",
    "SEMIF_API_TOKEN=demo-token SEMIF_PORT=": "test_the_demo_honours_the_documented_settings",
    "T=demo-token": "test_the_curl_examples_answer_against_the_demo",
    "SEMIF_API_TOKEN=demo-token uv run python examples/native_client.py": (
        "test_the_python_client_example_answers_against_the_demo"
    ),
    "export TYPESAFE_BASE_URL=": "test_the_typesafe_sdk_example_answers_against_the_demo",
    'curl -s -H "Authorization: Bearer demo-token" http://127.0.0.1:8032/v1/systemone': (
        "test_the_systemone_curl_example_answers_against_the_demo"
    ),
    "IMG=$(base64": "test_the_image_curl_example_is_answered_by_the_demo",
    "TYPESAFE_BASE_URL=http://127.0.0.1:8032 TYPESAFE_API_KEY": (
        "test_the_sdk_image_example_prints_the_demos_answer"
    ),
    "curl -s http://127.0.0.1:8032/v1/systemone -H": "test_the_lev_curl_example_is_answered",
    "TYPESAFE_DEFAULT_MODEL=local": "test_the_sdk_reaches_the_demos_lev_release_by_its_alias",
    "CUDA_ONLY=": "test_the_cpu_only_sync_leaves_torch_and_the_cuda_libraries_out",
    "uv run semif-serve check-model ": "test_check_model_on_the_demo_checkpoint_says_complete",
    "cat > tickets.jsonl": "test_the_batch_block_scores_its_file_as_the_demo_answers_each_line",
    "uv run semif-serve manifest ": "test_the_manifest_block_pins_and_verifies_the_demo_checkpoint",
    "uv run semif-serve presentation-checks --demo": (
        "test_the_presentation_checks_line_measures_the_demo_within_the_committed_report"
    ),
}


def block(key: str) -> str:
    (found,) = [b.body for b in blocks() if b.reason is None and b.first_line.startswith(key)]
    return found


def marked(key: str) -> str:
    (found,) = [b.body for b in blocks() if b.reason is not None and key in b.body]
    return found


def here(script: str) -> str:
    """`uv run X` as `X` in this environment (the venv uv made for the tests)."""
    return script.replace("uv run ", "")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without SEMIF_* settings, the venv first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEMIF_")}
    env["PATH"] = VENV_BIN + os.pathsep + env.get("PATH", "")
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the demo exited with {process.returncode}")
        try:
            health = httpx.get(f"{url}/health", timeout=2)
            if health.status_code == 200 and health.json().get("ready"):
                return health.json()
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError("the demo did not become ready")


def stop(process: subprocess.Popen, grace: float = 60) -> None:
    """SIGTERM to the process's group, SIGKILL after `grace` seconds."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def demo(vision_checkpoint, tmp_path_factory):
    """The demo as the README starts it with fixed settings (on a free port), in its own session,
    on the demo's checkpoint (with a vision tower) built once for the test session."""
    port = free_port()
    log = (tmp_path_factory.mktemp("demo") / "demo.log").open("w")
    script = here(block("SEMIF_API_TOKEN=demo-token SEMIF_PORT=")).replace(
        "SEMIF_PORT=8032", f"SEMIF_PORT={port}"
    )
    process = subprocess.Popen(
        ["bash", "-c", script],
        cwd=ROOT,
        env=clean_env(SEMIF_DEMO_DIR=str(vision_checkpoint)),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        health = wait_ready(url, process)
        yield url, health
    finally:
        stop(process)
        log.close()


# ----------------------------------------------------------------------- the README's shape


def test_every_command_block_is_run_here_or_says_why_not():
    found = blocks()
    assert len(found) >= len(RUNS)
    for b in found:
        if b.reason is not None:
            assert b.reason.strip(), f"a marked block gives no reason: {b.first_line}"
            continue
        owners = [key for key in RUNS if b.first_line.startswith(key)]
        assert len(owners) == 1, f"no test runs this block (or several claim it): {b.first_line}"
    for key, test in RUNS.items():
        assert callable(globals().get(test)), f"{test} (for {key!r}) is not a test of this module"
        assert block(key)


def test_the_readme_starts_with_the_demo_and_test_commands():
    first = blocks()[0]
    assert first.reason is None
    assert first.body.splitlines()[0].startswith("uv run semif-serve demo")
    assert first.body.splitlines()[1].startswith("uv run pytest")


def test_the_configuration_table_lists_every_setting():
    for field in Settings.model_fields:
        assert f"| `{env_name(field)}` |" in README, env_name(field)


def test_the_readme_says_what_semif_is_in_a_sentence():
    assert re.search(
        r"\*\*SemIf\*\*.*?\s+is\s+a\s+method\s+that\s+scores\s+a\s+typed\s+decision", README, re.S
    )
    assert "TheoLeeCJ/SemIf" in README
    assert "second terminal" in README
    for variable in ("SEMIF_PORT", "SEMIF_API_TOKEN", "SEMIF_CALIBRATION"):
        assert variable in block("SEMIF_API_TOKEN=demo-token SEMIF_PORT="), variable


def test_the_pinned_revision_is_the_same_everywhere():
    fetch = marked("hf download")
    assert f"--revision {PINNED_REVISION}" in fetch
    assert REAL_MODEL_DIR in block("uv run semif-serve check-model ")
    for stack in ("semif", "semif-multi"):
        compose = (ROOT / "stacks" / stack / "compose.yaml").read_text(encoding="utf-8")
        assert f"${{MODEL_REVISION:-{PINNED_REVISION}}}" in compose, stack


# ----------------------------------------------------------------------- the demo blocks


def test_the_start_here_block_serves_the_demo_and_is_what_ci_runs(checkpoint):
    demo_line = here(block("uv run semif-serve demo ")).splitlines()[0]
    port = free_port()
    process = subprocess.Popen(
        ["bash", "-c", demo_line.split("#")[0]],
        env=clean_env(SEMIF_DEMO_DIR=str(checkpoint), SEMIF_PORT=str(port)),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        token = None
        for line in process.stdout:
            if line.startswith("token: "):
                token = line.removeprefix("token: ").strip()
                break
        assert token and token.startswith("demo-"), "the demo prints its token"
        url = f"http://127.0.0.1:{port}"
        assert wait_ready(url, process)["demo"] is True
        reply = httpx.post(
            f"{url}/decide",
            headers={"Authorization": f"Bearer {token}"},
            json={
                "id": "q",
                "state": "s",
                "question": "q?",
                "options": [{"id": "a", "description": "A."}, {"id": "b", "description": "B."}],
            },
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
    finally:
        stop(process)
    # The suite cannot run itself from inside; CI runs exactly this line (.ci/run's last command).
    ci_commands = [
        ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln and not ln.startswith("#")
    ]
    assert (
        ci_commands[-1]
        == "uv run pytest"
        == block("uv run semif-serve demo ").splitlines()[1].split("#")[0].strip()
    )


def test_the_demo_honours_the_documented_settings(demo):
    url, health = demo
    assert health["demo"] is True
    assert {"authored144", "wanli256", "every154"} <= set(health["calibration"]["workloads"])
    refused = httpx.post(f"{url}/decide", headers={"Authorization": "Bearer not-the-token"}, json={})
    assert refused.status_code == 401


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_the_curl_examples_answer_against_the_demo(demo):
    url, _ = demo
    script = block("T=demo-token").replace("http://127.0.0.1:8032", url)
    out = subprocess.run(
        ["bash", "-c", 'curl() { command curl "$@"; echo; }\n' + script],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    replies = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert len(replies) == script.count("curl ")
    assert replies[0]["option_ids"] == ["yes", "no"]
    assert replies[1]["combined"]["orderings"] == 3
    assert replies[2]["ready"] is True
    assert not any("error" in r for r in replies)


def test_the_python_client_example_answers_against_the_demo(demo):
    url, _ = demo
    result = subprocess.run(
        ["bash", "-c", here(block("SEMIF_API_TOKEN=demo-token uv run python examples/native_client.py"))],
        cwd=ROOT,
        env=clean_env(SEMIF_URL=url),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    answers = dict(line.split(": ", 1) for line in lines[:3])
    assert set(answers) == {"deploy-1", "is-bug", "queue"}
    assert answers["deploy-1"].split()[0] in ("yes", "no")
    assert answers["queue"].split()[0] in ("billing", "engineering", "sales")
    prefix = re.fullmatch(r"shared prefix: (\d+) tokens, 2 rows", lines[3])
    assert prefix and int(prefix[1]) > 0


def run_example(name: str, **env: str) -> subprocess.CompletedProcess:
    """Run one of examples/ as a user would, with only `env` added to a clean environment."""
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_python_client_example_exits_1_with_the_services_error(demo):
    url, _ = demo
    result = run_example("native_client.py", SEMIF_URL=url, SEMIF_API_TOKEN="wrong-token")
    assert result.returncode == 1
    assert "401 unauthorized" in result.stderr


def sdk_block_lines(demo, starts: str) -> list[str]:
    """The output lines of the README's SDK block that starts with `starts`, run against the demo."""
    url, _ = demo
    script = here(block(starts)).replace("http://127.0.0.1:8032", url)
    result = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_the_typesafe_sdk_example_answers_against_the_demo(demo):
    lines = sdk_block_lines(demo, "export TYPESAFE_BASE_URL=")
    answers = dict(line.split(": ", 1) for line in lines[:3])
    assert set(answers) == {"wants-refund", "team", "upset"}
    assert 0 <= float(re.fullmatch(r"P\(true\)=([0-9.]+)", answers["wants-refund"])[1]) <= 1
    assert answers["team"].split()[0] in ("billing", "engineering", "sales")
    assert re.fullmatch(r"[0-9.]+ on 0\.\.2 \(confidence [0-9.]+\)", answers["upset"])
    assert re.fullmatch(r"model Qwen/Qwen3\.5-4B@\S+: \d+ input tokens, 0 output", lines[3])


def test_the_typesafe_sdk_example_exits_1_with_the_services_error(demo):
    url, _ = demo
    result = run_example("systemone_client.py", TYPESAFE_BASE_URL=url, TYPESAFE_API_KEY="wrong-token")
    assert result.returncode == 1
    assert "401" in result.stderr and "the bearer token is not valid" in result.stderr


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_the_systemone_curl_example_answers_against_the_demo(demo):
    url, _ = demo
    script = block('curl -s -H "Authorization: Bearer demo-token" http://127.0.0.1:8032/v1/systemone')
    script = script.replace("http://127.0.0.1:8032", url)
    out = subprocess.run(
        ["bash", "-c", 'curl() { command curl "$@"; echo; }\n' + script],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    answered, models = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert answered["usage"]["output_tokens"] == 0
    assert {k: a["type"] for k, a in answered["answers"].items()} == {
        "wants-refund": "noul",
        "team": "choice",
        "upset": "score",
    }
    assert set(answered["answers"]["team"]["probabilities"]) == {"billing", "engineering"}
    assert answered["model"] == models["models"][0]["name"]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_the_image_curl_example_is_answered_by_the_demo(demo):
    url, _ = demo
    script = block("IMG=$(base64").replace("http://127.0.0.1:8032", url)
    out = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    answer = json.loads(out)["answers"]["red"]
    assert 0.0 < answer["noul"] < 1.0
    assert answer["x_semif"]["input_tokens"] > 100  # the prompt's text and the image's tokens


def test_the_sdk_image_example_prints_the_demos_answer(demo):
    url, _ = demo
    script = here(block("TYPESAFE_BASE_URL=http://127.0.0.1:8032 TYPESAFE_API_KEY")).replace(
        "http://127.0.0.1:8032", url
    )
    result = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"red: P\(true\)=0\.\d{3}\n", result.stdout), result.stdout


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_the_lev_curl_example_is_answered(demo):
    url, _ = demo
    script = block("curl -s http://127.0.0.1:8032/v1/systemone -H").replace("http://127.0.0.1:8032", url)
    out = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    reply = json.loads(out)
    assert reply["model"] == "lev-demo"
    answers = reply["answers"]
    assert {k: a["type"] for k, a in answers.items()} == {
        "urgent": "noul",
        "team": "choice",
        "upset": "score",
    }
    assert set(answers["team"]["probabilities"]) == {"billing", "engineering"}
    assert answers["team"]["x_lev"]["bucket"] == "choice:A:small" and answers["team"]["x_lev"]["orders"] == 2
    assert len(answers["urgent"]["x_lev"]["distribution"]) == 9  # lev reads a noul as a 0..8 rating


def test_the_sdk_reaches_the_demos_lev_release_by_its_alias(demo):
    lines = sdk_block_lines(demo, "TYPESAFE_DEFAULT_MODEL=local")
    assert set(dict(line.split(": ", 1) for line in lines[:3])) == {"wants-refund", "team", "upset"}
    assert re.fullmatch(r"model lev-demo: \d+ input tokens, 0 output", lines[3])


# ----------------------------------------------------------------------- installing and the real model


def test_the_cpu_only_sync_leaves_torch_and_the_cuda_libraries_out(tmp_path):
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH")
    for name in ("pyproject.toml", "uv.lock", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "src", tmp_path / "src")
    # Plan the sync only (--dry-run), from the lock and the cache (--offline): nothing is installed.
    script = block("CUDA_ONLY=").replace("$CUDA_ONLY", "$CUDA_ONLY --dry-run --offline")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "UV_NO_SYNC")}
    plan = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert plan.returncode == 0, plan.stderr
    would_install = set(re.findall(r"^ \+ ([A-Za-z0-9_.-]+)==", plan.stdout + plan.stderr, re.M))
    assert "transformers" in would_install and "fastapi" in would_install
    left_out = {"torch", "triton"} | {n for n in would_install if n.startswith("nvidia-")}
    assert not (would_install & left_out), sorted(would_install & left_out)
    lock = tomllib.loads((ROOT / "uv.lock").read_text(encoding="utf-8"))
    (torch,) = [p for p in lock["package"] if p["name"] == "torch"]
    assert f"torch=={torch['version']} --index-url https://download.pytorch.org/whl/cpu" in marked("whl/cpu")


def test_the_hf_download_command_asks_for_the_pinned_revision(tmp_path):
    """Offline, hf gets past its argument parsing and names the exact tree it would fetch."""
    command = here(marked("hf download")).replace("--cache-dir models", f"--cache-dir {tmp_path}")
    result = subprocess.run(
        ["bash", "-c", command],
        env=clean_env(HF_HUB_OFFLINE="1", NO_COLOR="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = result.stdout + result.stderr
    assert "No such option" not in out and result.returncode != 2, out
    assert f"Qwen/Qwen3.5-4B/tree/{PINNED_REVISION}" in out, out
    assert "offline mode is enabled" in out


def test_check_model_on_the_demo_checkpoint_says_complete(checkpoint):
    script = here(block("uv run semif-serve check-model ")).replace(REAL_MODEL_DIR, str(checkpoint))
    result = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert f"{checkpoint}: complete" in result.stdout


def test_the_batch_block_scores_its_file_as_the_demo_answers_each_line(demo, vision_checkpoint, tmp_path):
    from tests.support.batch import assert_close, comparable

    url, _ = demo
    result = subprocess.run(
        ["bash", "-c", here(block("cat > tickets.jsonl"))],
        cwd=tmp_path,
        env=clean_env(SEMIF_DEMO_DIR=str(vision_checkpoint)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "run-batch: 3 lines, 0 already in the output, 3 answered, 0 refused" in result.stderr
    asked = [json.loads(text) for text in (tmp_path / "tickets.jsonl").read_text().splitlines()]
    answered = [json.loads(text) for text in (tmp_path / "results.jsonl").read_text().splitlines()]
    for line, got in zip(asked, answered, strict=True):
        auth = {"Authorization": f"Bearer {DEMO_TOKEN}"}
        reply = httpx.post(url + line["url"], json=line["body"], headers=auth, timeout=60)
        assert got["custom_id"] == line["custom_id"] and got["error"] is None
        assert got["response"]["status_code"] == reply.status_code == 200
        assert_close(comparable(got["response"]["body"]), comparable(reply.json()), line["custom_id"])


def test_the_manifest_block_pins_and_verifies_the_demo_checkpoint(checkpoint, tmp_path):
    manifest = tmp_path / "weights.sha256"
    script = here(block("uv run semif-serve manifest "))
    script = script.replace(REAL_MODEL_DIR, str(checkpoint)).replace("conf/weights.sha256", str(manifest))
    result = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "model.safetensors" in manifest.read_text()
    assert re.search(r"manifest: all \d+ files match", result.stdout)


def test_the_presentation_checks_line_measures_the_demo_within_the_committed_report(vision_checkpoint):
    result = subprocess.run(
        ["bash", "-c", here(block("uv run semif-serve presentation-checks --demo"))],
        cwd=ROOT,
        env=clean_env(SEMIF_DEMO_DIR=str(vision_checkpoint)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "every metric within 0.05 of conf/presentation-report.json" in result.stderr
    committed = json.loads((ROOT / "conf" / "presentation-report.json").read_text())
    for kind, orderings in committed["checks"].items():
        for ordering, entry in orderings.items():
            row = next(r.split() for r in result.stdout.splitlines() if r.split()[:2] == [kind, ordering])
            lean = next(float(cell) for cell in row[2:] if cell[0] in "+-")  # the first signed column
            assert lean == pytest.approx(entry["raw"]["identical"]["metric"], abs=6e-4), row
